"""Always-on NaN/Inf watch (nan.jsonl): loss and gradient-norm finiteness per step, module-level
finiteness flags, and op-level localization of the first creation on this rank.

What runs in the hot path:
* ``torch.autograd.backward`` is wrapped (``Tensor.backward`` and the pipelining schedules'
  ``stage_backward`` both call it): scalar roots with no explicit gradient are losses; a detached
  reference is kept, nothing is read.
* A global optimizer pre-step hook takes the per-parameter gradient L2 norms in one
  ``torch._foreach_norm`` (fp32 results, ``fp32_norms``: one read of every gradient, the floor on
  CPU); after the step, one more over the parameters (every k-th step where that pass would cost
  more than 0.1 % of the step: ``_check_params``).
* Every module call (global forward pre-hook, which appends a forward hook to the module the first
  time it runs, so it fires *after* the module's own hooks) gets max |x| of its floating inputs and
  outputs, and tensor hooks on those that require grad give max |grad| w.r.t. its outputs
  (fires before the module's backward) and inputs (after it).

All these are 0-dim device tensors. On CPU they are read at once (no device to sync with); on CUDA
they are concatenated at the step boundary, copied non-blocking to pinned memory with an event,
and read at a later boundary once the event has passed: no extra host-device sync.

Resolution (``_Resolver``), in execution order within a step: a module whose inputs were finite
and whose output is not *created* the value in the forward; one whose output-gradients were
finite and whose input-gradient is not created it in the backward; otherwise it received it.
Creation candidates (CPU/immediate mode) keep their inputs; before the optimizer changes the
parameters, ``nan_locate.replay`` re-runs the module call under an op-checking dispatch mode to
name the aten op. Formats: docs/nan.md.
"""

from __future__ import annotations

import functools
import math
import time
import weakref

from trainprof import settings
from trainprof.probes import post_import, runtime
from trainprof.probes.nan_agreement import PeerAgreement
from trainprof.probes.nan_deferred import DeferredSteps
from trainprof.probes.nan_hooks import ModuleHooks, _quiet_compile_warning, _remove_global_hooks
from trainprof.probes.nan_records import RecordBuilder
from trainprof.probes.nan_values import _jsonable, _Resolver, fp32_norms

STREAM = "nan"
# "replay" (default): loss + gradient checks always on, root module calls kept by reference and
# replayed with module/op checks after a detection. "all" | "leaf": module-level flags always on
# (also on CUDA without a sync; costly). "off": loss + gradient checks only.
ENV_MODULES = "TRAINPROF_NAN_MODULES"
ENV_SYNC = "TRAINPROF_NAN_SYNC"        # "1": on CUDA read the flags at the optimizer pre-step hook
ENV_PEER_WAIT = "TRAINPROF_NAN_PEER_WAIT_S"  # coordinated (TP / FSDP2) replay: wait for peers
ENV_KEEP_MB = "TRAINPROF_NAN_KEEP_MB"  # cap on output-gradients kept per step for a replay
PARAM_BUDGET = 0.001      # share of a step the parameter-finiteness pass may cost on average
PARAM_MAX_INTERVAL = 16   # ...checked at least every this many steps
_WATCH: "NanWatch | None" = None
_orig_backward = None


class NanWatch(ModuleHooks, PeerAgreement, DeferredSteps, RecordBuilder):
    def __init__(self, session):
        import torch

        self.torch = torch
        self.s = session
        self.out = session.stream(STREAM)
        self.handles = []
        self._hooked = weakref.WeakKeyDictionary()   # module -> its forward hook handle
        self._names = weakref.WeakKeyDictionary()    # module -> clean path
        self._pnames: dict[int, tuple] = {}          # id(param) -> (weakref, path)
        self._off = 0                                 # >0 during a replay
        self._cache: dict = {}                        # id(tensor) -> (weakref, version, stat)
        self.modules_mode = settings.value(ENV_MODULES)
        self.modules_on = self.modules_mode in ("all", "leaf")
        self.replay_on = self.modules_mode == "replay"
        self.sync = settings.value(ENV_SYNC)
        try:
            self.peer_wait_s = settings.value(ENV_PEER_WAIT)
        except ValueError:
            self.peer_wait_s = 10.0
        try:
            self.keep_bytes = settings.value(ENV_KEEP_MB) * 2**20
        except ValueError:
            self.keep_bytes = 2**30
        self.roots_known: weakref.WeakSet = weakref.WeakSet()   # modules seen as roots
        self._replayable: dict = {}  # id(module) -> (weakref, None | refusal reason): a plain dict
        # lookup, where a WeakKeyDictionary builds a weakref per call (~10 µs on this hot path)
        self._root_handles = []
        self._root_hooked: weakref.WeakSet = weakref.WeakSet()
        self._discover_handles = []
        self._depth = 0
        self.located = False
        self._bwd_seen = False
        self._pending = []   # deferred (CUDA) steps awaiting their copy
        self._params_due = 0  # next step whose parameters are checked (see _check_params)
        self._params_ok_step = None  # last step whose parameter check was finite
        self.params_interval = 1
        self._reset_step()
        self.detected_step = None
        self.candidates: list = []   # (record, material) awaiting replay
        self.replayed = False

    # -- per-step state
    def _reset_step(self):
        self.events = []          # deferred mode: (kind, call, [tensor values], t_ns)
        self.losses = []          # detached scalar roots
        self.grad_info = None     # (total_norm tensor, per-param norms, params)
        self.optimizers = []
        self.resolver = _Resolver(self, self.s.clock.step)
        self.calls = 0
        self.roots: list = []     # this step's root calls (replay mode)
        self.kept_bytes = 0
        self.detect_t_ns = None   # first non-finite loss/gradient seen this step (host clock)
        for slot in getattr(self, "slots", ()):
            slot[0].clear()  # drop this step's calls (and their input references)
            if slot[1] is not None:
                slot[1].remove()
        self.slots = []           # gradient-hook slots registered this step

    # -- install / remove
    def install(self):
        import torch
        from torch.nn.modules import module as nnm
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        global _orig_backward
        if _orig_backward is None:
            _orig_backward = torch.autograd.backward

            @functools.wraps(_orig_backward)
            def backward(tensors, grad_tensors=None, *args, **kwargs):
                w = _WATCH
                if w is not None:
                    w.on_backward(tensors, grad_tensors)
                return _orig_backward(tensors, grad_tensors, *args, **kwargs)

            torch.autograd.backward = backward
        _quiet_pipeline_inference()
        if self.modules_on:
            self.handles.append(nnm.register_module_forward_pre_hook(self._pre))
            _quiet_compile_warning(True)
        elif self.replay_on:
            self._discover(True)
        self.handles.append(register_optimizer_step_pre_hook(self._pre_step))
        self.s.on_step(self._on_step)
        self.s.on_close(self.close)

    def close(self):
        global _WATCH
        if _WATCH is self:
            _WATCH = None
        _remove_global_hooks(self.handles + self._root_handles + self._discover_handles)
        _quiet_compile_warning(False)
        self._root_handles, self._discover_handles = [], []
        for h in list(self._hooked.values()):
            h.remove()
        self._hooked = weakref.WeakKeyDictionary()
        self._resolve_pending(wait=True)
        self._maybe_replay()

    # -- naming


    # -- values


    # -- hooks (hot path)


    # -- root module calls (replay mode): global hooks only until the roots are known


    def on_backward(self, tensors, grad_tensors):
        if self._off:
            return
        try:
            T = self.torch.Tensor
            if self.roots:
                self._harvest()  # gradients of the previous backward calls
            roots = [tensors] if isinstance(tensors, T) else list(tensors or ())
            grads = [grad_tensors] if isinstance(grad_tensors, T) or grad_tensors is None else list(grad_tensors)
            self._bwd_seen = True
            for i, r in enumerate(roots):
                g = grads[i] if i < len(grads) else None
                if g is not None and self.roots:
                    for c in self.roots:  # a root call's output handed a gradient from elsewhere
                        if any(w() is r for w in c.outs):
                            c.grad_explicit = True
                if isinstance(r, T) and g is None and r.numel() == 1 and r.is_floating_point():
                    if type(r) is not T:  # DTensor loss: its local value
                        r = getattr(r, "_local_tensor", r)
                    if r.is_cpu:  # read at once: one op, and the list holds floats
                        v = r.item()
                        self.losses.append(v)
                        if not math.isfinite(v):  # the resolver only acts on a bad value
                            self._emit("loss", None, [v], [r.detach()])
                        continue
                    d = r.detach().reshape(())
                    self.losses.append(d)
                    v = float(d) if self.sync else d.abs()
                    self._emit("loss", None, [v], [d])
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _pre_step(self, optimizer, args, kwargs):
        try:
            torch = self.torch
            self.optimizers.append(optimizer)
            self._harvest(final=True)
            params, gs = [], []
            for gr in optimizer.param_groups:
                for p in gr["params"]:
                    g = p.grad
                    if g is not None:
                        params.append(p)
                        gs.append(g)
            if params:
                T = torch.Tensor
                if any(type(g) is not T for g in gs):  # DTensor gradients: their local shards
                    gs = [getattr(g, "_local_tensor", g) for g in gs]
                with torch.no_grad():
                    norms = fp32_norms(torch, gs, 2)
                    total = torch.linalg.vector_norm(torch.stack(norms))
                info = (total, norms, params)
                self.grad_info = info if self.grad_info is None else self.grad_info
                v = float(total) if total.device.type == "cpu" or self.sync else total
                if not (isinstance(v, float) and math.isfinite(v)):
                    self._emit("grads", info, [v])
            self._maybe_replay()  # before the optimizer changes the parameters
            self._maybe_locate("optimizer pre-step")
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    # -- step boundary
    def _on_step(self, rec):
        torch = self.torch
        step = rec["step"]
        params_v = None
        try:
            if step >= self._params_due:
                params_v = self._check_params(rec)
                if params_v is not None and not (isinstance(params_v, float) and math.isfinite(params_v)):
                    self._emit("params", None, [params_v])
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        try:  # whatever fails here, the next step must start clean
            if not self.losses:
                loss = None
            elif all(isinstance(x, float) for x in self.losses):
                loss = list(self.losses)  # CPU: read at backward time
            else:
                dev = next(x.device for x in self.losses if isinstance(x, torch.Tensor))
                loss = torch.stack([x.float() if isinstance(x, torch.Tensor) else torch.tensor(x, device=dev)
                                    for x in self.losses])
            grad = self.grad_info[0] if self.grad_info else None
            entry = {"step": step, "t_ns": rec.get("end_ns") or time.time_ns(), "loss": loss,
                     "grad": grad, "params": params_v, "events": self.events,
                     "resolver": self.resolver, "calls": self.calls, "roots": len(self.roots)}
            if self.events or any(isinstance(x, torch.Tensor) and x.device.type != "cpu"
                                  for x in (loss, grad, params_v)):
                self._queue(entry)
            else:
                self._write_step(entry)
            self._maybe_replay()
            try:
                self._harvest(final=True)
                self._maybe_locate("step boundary")  # no optimizer (explicit markers): the job may
                if self.replay_on:                   # have updated the parameters already
                    if self._discover_handles and len(self.roots_known):
                        self._install_roots()
                    elif not self._discover_handles and not self.roots and self._bwd_seen:
                        self._discover(True)  # a backward without any captured root call: look again
                self._bwd_seen = False
            except Exception as e:  # noqa: BLE001
                self._fail(e)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        finally:
            self._reset_step()
        self._resolve_pending()

    def _check_params(self, rec):
        """max-norm of every optimizer parameter (finiteness only). A parameter goes non-finite
        with finite gradients only through the optimizer itself (a bad lr, overflowed state),
        so when the pass costs more than PARAM_BUDGET of the step it runs every k-th step
        (k <= PARAM_MAX_INTERVAL): such a fault is then reported up to k-1 steps late, or first
        by the next forward's loss, whose replay shows the non-finite parameter as an input."""
        torch = self.torch
        ps = [p for o in self.optimizers for gr in o.param_groups for p in gr["params"]]
        if not ps:
            return None
        t0 = time.perf_counter()
        plain = (torch.Tensor, torch.nn.Parameter)
        ls = ps if all(type(p) in plain for p in ps) else [getattr(p, "_local_tensor", p) for p in ps]
        # on CPU the L2 norm is one vectorized pass (inf-norm is a scalar loop, 4-5x slower);
        # a parameter would need |x| > 1e19 to overflow it. fp32 norms stack without casts.
        order = 2.0 if ls[0].device.type == "cpu" else math.inf
        with torch.no_grad():
            m = torch.stack(fp32_norms(torch, ls, order)).max()
        v = float(m) if m.device.type == "cpu" else m
        cost = time.perf_counter() - t0  # host time (on CUDA: the launches, never the kernel)
        step_s = (rec.get("dur_ms") or 0) / 1e3
        k = 1
        if step_s > 0 and rec["step"] > 0:  # step 0 holds the set-up
            k = max(1, min(PARAM_MAX_INTERVAL, math.ceil(cost / (PARAM_BUDGET * step_s))))
        self.params_interval = k
        self._params_due = rec["step"] + k
        return v


    # -- detection records and candidates


    def _maybe_replay(self):
        if self.replayed or not self.candidates:
            return
        self.replayed = True
        from trainprof.probes import nan_locate  # lazy: start-up time of the job's ranks

        cands, self.candidates = self.candidates, []
        self._off += 1
        t0_ns = time.time_ns()
        try:
            for rec, module, m in cands:
                t0 = time.perf_counter()
                out = {"kind": "op", "step": rec["step"], "module": rec["module"], "phase": m["phase"]}
                try:
                    r = nan_locate.replay(module, m["args"], m["kwargs"], m["grads"], m["phase"])
                    out.update(nan_locate.summarize(r, m["phase"]))
                except nan_locate.ReplayRefused as e:
                    out.update(op=None, note=f"replay refused: {e}")
                except Exception as e:  # noqa: BLE001
                    out.update(op=None, note=f"replay failed: {type(e).__name__}: {e}")
                out["replay_ms"] = (time.perf_counter() - t0) * 1e3
                self._write(out)
                if out.get("op"):
                    break
        finally:
            self._off -= 1
            self._book_replay(t0_ns)

    def _book_replay(self, t0_ns: int) -> None:
        """A replay's time is trainprof's, inside the job's step: booked as the step's probe
        overhead (steps.jsonl ``probe_overhead_ms``) and recorded as a span (meta.json
        ``overhead_spans``, kind ``nan_replay``) whose steps step statistics leave out."""
        t1_ns = time.time_ns()
        try:
            self.s.clock.overhead_ns += t1_ns - t0_ns
            note = getattr(self.s, "note_span", None)
            if note is not None:
                note("nan_replay", t0_ns, t1_ns)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _write(self, rec):
        # detections go out at once (the job may die of them); step records ride the ticker
        kind = rec.get("kind")  # step records hold finite numbers or None: no conversion pass
        self.out.write(rec if kind == "step" else _jsonable(rec), urgent=kind not in ("step", "root"))

    def _fail(self, e):
        if not getattr(self, "_warned", False):
            self._warned = True
            runtime.warn(f"nan watch: {type(e).__name__}: {e}")




def _quiet_pipeline_inference():
    """torch.distributed.pipelining infers shapes in its first step by running the stage on
    ``torch.empty`` inputs (uninitialized memory, often NaN/Inf): not the job's values, so the
    watch looks away while it runs. Patched when the job imports pipelining (never imported
    here: 1-3 s of CPU per rank)."""
    post_import.when_imported("torch.distributed.pipelining.stage", _quiet_stage)


def _quiet_stage(st):
    cls = getattr(st, "PipelineStage", None)
    for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
        fn = getattr(cls, name, None)
        if fn is None or getattr(fn, "_trainprof_nan", False):
            continue

        def make(orig):
            @functools.wraps(orig)
            def quiet(*args, **kwargs):
                w = _WATCH
                if w is None:
                    return orig(*args, **kwargs)
                w._off += 1
                try:
                    return orig(*args, **kwargs)
                finally:
                    w._off -= 1
            quiet._trainprof_nan = True
            return quiet

        setattr(cls, name, make(fn))


def attach(session):
    global _WATCH
    w = NanWatch(session)
    w.install()
    _WATCH = w
    session.state["nan_watch"] = w
