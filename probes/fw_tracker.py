"""What a training framework tells about its steps, shared by probes/fw_*.py.

A ``Tracker`` is one framework's view of a training run in this process. Once it ``begin()``s
(at the framework's train start, before the run's first optimizer update) it supplies the step
boundaries: the step clock's marker source, so the global optimizer-step hook stands down and
an update is never counted twice. If the framework then stops reporting boundaries while the
optimizer keeps stepping (a loop that bypasses its callbacks), the optimizer hook takes over
again, with a warning. The job's own ``trainprof.step()`` markers always win (seen as steps the
clock closed without us).

Between boundaries it counts micro-steps (gradient accumulation) and the micro-batches' samples
and tokens, and publishes run facts into ``run_info`` (values the job declared with
``set_run_info()`` win) and meta.json ``framework``.
"""

from __future__ import annotations

import os
import weakref

from trainprof.probes import runtime

UNMARKED_LIMIT = 3  # leader-optimizer updates without a boundary before the optimizer hook takes over
_MAX_WALK = 16      # items of a batch looked at when searching it for token ids

_owner: "Tracker | None" = None  # the framework whose boundaries count now
_ours: dict = {}                  # run_info values this module published
_optimizer_hook = None


class Tracker:
    def __init__(self, name: str, version: str | None, step_source: str):
        self.name, self.version = name, version
        self.marking = False        # this tracker supplies the step boundaries now
        self.gave_up = False        # it stopped supplying them once: never trusted again
        self.marked = 0             # boundaries it supplied
        self._prior = None          # the clock's source before the claim
        self._clock_at_mark = None  # the clock's step count after our last boundary
        self._leader = None         # id() of the optimizer the fallback watches
        self.unmarked = 0
        self.steps = 0
        self.micro = self.samples = self.tokens = 0
        self.per_step: list[tuple[int, int, int]] = []  # (micro-steps, samples, tokens)
        self.facts: dict = {}       # run_info facts from the framework's configuration
        self.meta: dict = {"name": name, "version": version, "step_source": step_source}
        self.dp = 1                 # data-parallel replicas: global batch = this rank's × dp
        self.tokens_seen = None     # callable -> global tokens seen, where the framework counts them
        self._tokens_seen0 = None
        self._warned: set = set()
        self._close_registered = False
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # models whose inputs are counted

    # -- the step source
    def begin(self) -> None:
        global _owner
        if _owner is not None and _owner is not self:
            _owner.release()  # the newest run reports (a Trainer built on accelerate wins over it)
        _owner = self
        if self.tokens_seen is not None:
            self._tokens_seen0 = self._read_tokens_seen()
        s = runtime.active() or _activate(self.name)
        if s is not None and not self._close_registered:
            self._close_registered = True
            s.on_close(self.publish)
        if s is not None and not self.marking and not self.gave_up and s.clock.source != "marker":
            self._prior = s.clock.source
            s.clock.source = "marker"
            self.marking, self.unmarked, self._leader = True, 0, None
            self._clock_at_mark = s.clock.step
            _ensure_optimizer_hook()
        self.publish()

    def release(self) -> None:
        global _owner
        s = runtime.active()
        if self.marking and s is not None and s.clock.source == "marker":
            s.clock.source = self._prior
        self.marking = False
        if _owner is self:
            _owner = None

    def end(self) -> None:
        """The framework's train end: final facts, boundaries back to the optimizer hook."""
        self.publish()
        self.release()

    def owns(self) -> bool:
        return _owner is self

    # -- events
    def count_micro(self) -> None:
        self.micro += 1

    def count_batch(self, batch) -> None:
        n, t, seq = batch_facts(batch)
        self.samples += n
        self.tokens += t
        if seq:
            self.facts.setdefault("seq_len", seq)

    def end_step(self) -> None:
        self.steps += 1
        self.per_step.append((self.micro, self.samples, self.tokens))
        del self.per_step[:-1000]
        self.micro = self.samples = self.tokens = 0
        s = runtime.active() if self.marking else None
        if s is not None and s.clock.step != self._clock_at_mark:
            # the steps advanced without us: the job marks them with trainprof.step()
            self.warn_once("job_markers", f"{self.name}: the job marks its steps with trainprof.step(); "
                                          "those markers count")
            self.marking, self.gave_up = False, True  # the clock's source stays the job's marker
        elif s is not None:
            self.unmarked = 0
            self.marked += 1
            s.mark_step(source=self.name)
            self._clock_at_mark = s.clock.step
        if self.steps >= 2 and self.steps & (self.steps - 1) == 0:  # at steps 2, 4, 8, ...
            self.publish()

    def on_optimizer_step(self, optimizer) -> None:
        if not self.marking:
            return
        if self._leader is None:
            self._leader = id(optimizer)
        if id(optimizer) != self._leader:
            return
        self.unmarked += 1
        if self.unmarked > UNMARKED_LIMIT:
            self.warn_once("fallback", f"{self.name}: no step boundary for {UNMARKED_LIMIT + 1} optimizer "
                                       "updates; counting optimizer steps instead")
            self.gave_up = True
            self.release()

    # -- facts
    def _read_tokens_seen(self):
        try:
            v = self.tokens_seen()
            return int(v) if v else None
        except Exception:  # noqa: BLE001
            return None

    def measured(self) -> dict:
        import statistics

        rows = self.per_step[1:] or self.per_step  # step 0 may be partial (set-up, resumption)
        if not rows:
            return {}
        out: dict = {}
        micro = statistics.median(r[0] for r in rows)
        if micro:
            out["micro_steps_per_step"] = micro
        samples = statistics.median(r[1] for r in rows)
        if samples:
            out["samples_per_step_rank"] = samples
            self.facts["global_batch"] = int(round(samples * self.dp))
        tokens = sum(r[2] for r in rows) / len(rows)
        seen, seen0 = self._read_tokens_seen(), self._tokens_seen0
        if seen and seen0 is not None and self.steps and seen > seen0:
            self.facts["tokens_per_step"] = int(round((seen - seen0) / self.steps))
            out["tokens_basis"] = f"{self.name}'s num_input_tokens_seen"
        elif tokens:
            self.facts["tokens_per_step"] = int(round(tokens * self.dp))
            out["tokens_per_step_rank"] = tokens
            out["tokens_basis"] = f"this rank's input tokens per step x {self.dp} data-parallel rank(s)"
            if len({r[2] for r in rows}) > 1:
                out["tokens_per_step_varies"] = True
        return out

    def publish(self) -> None:
        try:
            measured = self.measured()
            publish_run_info({"framework": self.name, "framework_version": self.version, **self.facts})
            s = runtime.active()
            if s is not None:
                meta = {**self.meta, "data_parallel_size": self.dp, "steps_seen": self.steps,
                        "steps_marked": self.marked, **measured}
                if s.meta.get("framework") != meta:
                    s.update_meta(framework=meta)
        except Exception as e:  # noqa: BLE001
            self.warn_once("publish", f"{self.name}: run facts not recorded: {type(e).__name__}: {e}")

    def model_facts(self, model) -> None:
        try:
            self.meta.update(param_facts(model))
            self.facts["n_params_non_embedding"] = self.meta["n_params"] - self.meta["n_params_embedding"]
            self.facts.update(config_facts(model))
        except Exception as e:  # noqa: BLE001
            self.warn_once("model", f"{self.name}: model size not read: {type(e).__name__}: {e}")

    def count_forward_inputs(self, model):
        """A forward pre-hook counting the training inputs of each step (reads shapes only).
        Inside code torch.compile traces it does nothing (no side effect enters a graph, and
        fullgraph compiles see no break); such inputs are then not counted. Returns the handle."""
        from torch.compiler import is_compiling

        if model in self._hooked:  # prepared again (e.g. for evaluation): one hook is enough
            return None
        self._hooked.add(model)

        def pre_hook(module, args, kwargs):
            if is_compiling():
                return
            if module.training and _owner is self:
                try:
                    self.count_batch((kwargs, args) if kwargs else args)
                except Exception:  # noqa: BLE001
                    pass

        return model.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            runtime.warn(msg)


def guard(name: str, fn, *args):
    """fn(*args); an exception only warns (the job's training never sees it)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"{name} integration error: {type(e).__name__}: {e}")
        return None


def _activate(reason: str):
    """Start the probes at a framework's train start, unless the job is still to become
    distributed (init_process_group then starts them)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return None
    except Exception:  # noqa: BLE001
        return None
    return runtime.activate(reason)


def publish_run_info(info: dict) -> None:
    """Merge into run_info the facts the job did not declare itself (nor changed after us)."""
    current = runtime._run_info
    out = {}
    for k, v in info.items():
        if v is None:
            continue
        if k in current and (k not in _ours or current[k] != _ours[k]):
            continue
        if current.get(k) != v:
            out[k] = v
    if out:
        _ours.update(out)
        runtime.remember_run_info(out)


def _ensure_optimizer_hook() -> None:
    global _optimizer_hook
    if _optimizer_hook is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def hook(optimizer, args, kwargs):
        t = _owner
        if t is not None:
            try:
                t.on_optimizer_step(optimizer)
            except Exception:  # noqa: BLE001
                pass

    _optimizer_hook = register_optimizer_step_post_hook(hook)


# --------------------------------------------------------------------------- batches and models
def batch_facts(batch) -> tuple[int, int, int | None]:
    """(samples, tokens, seq_len) of one micro-batch: tokens are the elements of ``input_ids``,
    or of the batch's first tensor when that is a 2-D integer tensor (token ids); samples the
    first dimension of that tensor (or of the first tensor). (0, 0, None) when nothing fits."""
    import torch

    first = ids = None
    todo, seen = [batch], 0
    while todo and seen < _MAX_WALK and first is None:
        x = todo.pop(0)
        seen += 1
        if isinstance(x, torch.Tensor):
            if x.dim() >= 1:
                first = x
        elif isinstance(x, dict) or (hasattr(x, "keys") and hasattr(x, "__getitem__")):
            try:
                keys = list(x.keys())
                if "input_ids" in keys:
                    ids = x["input_ids"]
                    break
                todo[:0] = [x[k] for k in keys[:_MAX_WALK]]
            except Exception:  # noqa: BLE001
                continue
        elif isinstance(x, (list, tuple)):
            todo[:0] = list(x[:_MAX_WALK])
    t = ids if isinstance(ids, torch.Tensor) else first
    if t is None or t.dim() < 1:
        return 0, 0, None
    if t.dim() == 2 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        return int(t.shape[0]), int(t.numel()), int(t.shape[1])
    return int(t.shape[0]), 0, None


def param_facts(model) -> dict:
    import torch

    total = sum(p.numel() for p in model.parameters())
    emb, seen = 0, set()
    for m in model.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            emb += m.weight.numel()
    return {"n_params": int(total), "n_params_embedding": int(emb)}


_CONFIG_KEYS = {"layers": "num_hidden_layers", "heads": "num_attention_heads",
                "hidden": "hidden_size", "vocab": "vocab_size"}


def config_facts(model) -> dict:
    """Transformer shape from a Hugging Face style ``config`` of the model or a submodule."""
    for i, m in enumerate(model.modules()):
        if i > 64:
            break
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(cfg, "num_hidden_layers"):
            continue
        out = {}
        for k, attr in _CONFIG_KEYS.items():
            try:
                v = getattr(cfg, attr, None)
            except Exception:  # noqa: BLE001
                v = None
            if isinstance(v, int) and v > 0:
                out[k] = v
        return out
    return {}
