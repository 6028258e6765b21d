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
import zlib

from trainprof import settings
from trainprof.probes import runtime

STREAM = "nan"
# "replay" (default): loss + gradient checks always on, root module calls kept by reference and
# replayed with module/op checks after a detection. "all" | "leaf": module-level flags always on
# (also on CUDA without a sync; costly). "off": loss + gradient checks only.
ENV_MODULES = "TRAINPROF_NAN_MODULES"
ENV_SYNC = "TRAINPROF_NAN_SYNC"        # "1": on CUDA read the flags at the optimizer pre-step hook
ENV_PEER_WAIT = "TRAINPROF_NAN_PEER_WAIT_S"  # coordinated (TP / FSDP2) replay: wait for peers
ENV_KEEP_MB = "TRAINPROF_NAN_KEEP_MB"  # cap on output-gradients kept per step for a replay
MAX_CANDIDATES = 8
PARAM_BUDGET = 0.001      # share of a step the parameter-finiteness pass may cost on average
PARAM_MAX_INTERVAL = 16   # ...checked at least every this many steps
MAX_ROOT_CALLS = 64
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_WATCH: "NanWatch | None" = None
_orig_backward = None


def clean_path(path: str) -> str:
    for p in WRAPPER_PREFIXES:
        path = path.replace(p, "")
    return path


def _finite(v) -> bool:
    return v is None or math.isfinite(v)



def tensors_in(x, acc: list, tensor_cls, keep=None) -> list:
    """Append to acc the tensors (those keep() accepts) found in nested tuples, lists and dicts."""
    if isinstance(x, tensor_cls):
        if keep is None or keep(x):
            acc.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            tensors_in(y, acc, tensor_cls, keep)
    elif isinstance(x, dict):
        for y in x.values():
            tensors_in(y, acc, tensor_cls, keep)
    return acc


def _is_floating(t) -> bool:
    return t.is_floating_point()


def fp32_norms(torch, ts: list, order) -> list:
    """Per-tensor ``order``-norms of ts as fp32 0-dim tensors, in ts's order: one pass over the
    values (non-finite in, non-finite out). ``_foreach_norm(dtype=float32)`` reads fp32 in place
    and keeps fp16 from overflowing at 65504; bf16 on CPU is normed in bf16 (torch accumulates it
    in fp32, and bf16 has fp32's range) and only the result is cast, because there dtype=float32
    converts the whole tensor first (2-6x the time, 8.4M values)."""
    bf16 = torch.bfloat16
    if ts[0].device.type != "cpu" or not any(t.dtype is bf16 for t in ts):
        return torch._foreach_norm(ts, order, dtype=torch.float32)
    out = [None] * len(ts)
    low = [i for i, t in enumerate(ts) if t.dtype is bf16]
    rest = [i for i, t in enumerate(ts) if t.dtype is not bf16]
    for i, n in zip(low, torch._foreach_norm([ts[i] for i in low], order)):
        out[i] = n.float()
    if rest:
        for i, n in zip(rest, torch._foreach_norm([ts[i] for i in rest], order, dtype=torch.float32)):
            out[i] = n
    return out

class _Call:
    """One module call: what the resolver and a replay need."""

    __slots__ = ("name", "module", "args", "kwargs", "versions", "in_ok", "out_ok", "gout_ok",
                 "gouts", "__weakref__")

    def __init__(self, name, module):
        self.name, self.module = name, module
        self.args = self.kwargs = self.versions = None
        self.in_ok = self.out_ok = True
        self.gout_ok = True
        self.gouts: dict = {}


class _Root:
    """One root module call of the current step (a module called outside any other module): what
    a replay needs, by reference (no copies in the hot path)."""

    __slots__ = ("module", "args", "kwargs", "versions", "rng", "cuda_rng", "grads", "outs",
                 "held", "grad_explicit", "peers")

    def __init__(self, module, args, kwargs, versions, rng, cuda_rng, peers=None):
        self.module, self.args, self.kwargs, self.versions = module, args, kwargs, versions
        self.peers = peers  # mesh ranks a replay must run with (DTensor parameters: TP, FSDP2)
        self.rng, self.cuda_rng = rng, cuda_rng
        self.grads: dict = {}    # floating output index -> gradient w.r.t. it (from a grad hook)
        self.outs: list = []     # weakrefs to the floating outputs
        self.held: list = []     # (index, output) with retain_grad(), until its gradient is taken
        self.grad_explicit = False  # an output was a backward root with an explicit gradient (p2p)


class _NoHandle:
    @staticmethod
    def remove():
        pass


class _Resolver:
    """Consumes one step's events in execution order (values already floats)."""

    def __init__(self, watch, step):
        self.w, self.step = watch, step
        self.first = None
        self.fwd_bad = False
        self.n_candidates = 0
        self.seen = set()

    def feed(self, kind, call, vals, tensors=None, t_ns=None):
        created = False
        if kind == "fwd":
            in_v, out_v = vals
            call.in_ok = all(_finite(v) for v in in_v)
            bad = not all(_finite(v) for v in out_v)
            call.out_ok = not bad
            created = bad and call.in_ok
            self.fwd_bad |= bad
            phase, role = "forward", "output"
        elif kind == "gout":
            bad = not _finite(vals[0])
            call.gout_ok &= not bad
            phase, role = "backward", "grad_output"
        elif kind == "gin":
            bad = not _finite(vals[0])
            # a backward can only create what its forward did not already carry
            created = bad and call.gout_ok and call.in_ok and call.out_ok
            phase, role = "backward", "grad_input"
        elif kind == "loss":
            bad = not _finite(vals[0])
            created = bad and not self.fwd_bad and self.w.modules_on
            self.fwd_bad |= bad
            phase, role = "forward", "loss"
        elif kind == "grads":
            bad = not _finite(vals[0])
            created = bad and self.first is None and self.w.modules_on
            phase, role = "backward", "parameter_grads"
        else:  # params after the optimizer step
            bad = not _finite(vals[0])
            created = bad and self.first is None
            phase, role = "optimizer", "parameters"
        if not bad:
            return
        first = self.first is None
        late = self.w.detected_step is not None and self.step > self.w.detected_step
        key = (getattr(call, "name", kind), kind)
        if created and not first and key in self.seen:
            return  # the same module again (another micro-batch)
        if first or (created and not late and self.n_candidates < MAX_CANDIDATES):
            self.seen.add(key)
            rec = self.w._nonfinite_record(self.step, kind, phase, role, call, vals, tensors,
                                           created, first, t_ns)
            if first:
                self.first = rec
            if created:
                self.n_candidates += 1
                self.w._candidate(rec, call, kind, tensors)


class NanWatch:
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
    def _name(self, mod) -> str:
        n = self._names.get(mod)
        if n is None:
            root_cls = type(mod).__name__
            ddp = root_cls == "DistributedDataParallel"
            for path, m in mod.named_modules():
                if ddp and path.startswith("module."):
                    path = path[len("module."):]
                if m not in self._names:
                    self._names[m] = clean_path(path) if path else f"<{type(m).__name__}>"
            for path, p in mod.named_parameters():
                if ddp and path.startswith("module."):
                    path = path[len("module."):]
                self._pnames.setdefault(id(p), (weakref.ref(p), clean_path(path)))
            n = self._names[mod]
        return n

    def _param_name(self, p) -> str | None:
        ent = self._pnames.get(id(p))
        return ent[1] if ent and ent[0]() is p else None

    # -- values
    def _stat(self, t):
        """max |x| of a tensor (NaN if any NaN): a host float on CPU, a 0-dim device tensor on
        CUDA. Cached per (tensor, version): one module's output is the next one's input."""
        lt = getattr(t, "_local_tensor", None)
        if lt is not None:
            t = lt
        key = id(t)
        c = self._cache.get(key)
        if c is not None and c[0]() is t and c[1] == t._version:
            return c[2]
        if t.numel() == 0:
            return None
        d = t.detach()
        if d.device.type == "cpu":
            # aminmax is one vectorized pass on CPU (vector_norm(inf) is a scalar loop, 5-10x slower)
            mn, mx = self.torch.aminmax(d)
            mn, mx = float(mn), float(mx)
            v = mx if mx != mx else max(mx, -mn)  # NaN propagates through both
        else:
            v = self.torch.linalg.vector_norm(d, math.inf)  # one kernel, no overflow
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[key] = (weakref.ref(t), t._version, v)
        return v

    def _floats(self, x, acc):
        return tensors_in(x, acc, self.torch.Tensor, _is_floating)

    def _emit(self, kind, call, vals, tensors=None):
        """Feed the resolver now (host values) or queue for the boundary (device values)."""
        flat = vals if kind != "fwd" else vals[0] + vals[1]
        if any(v is not None and not isinstance(v, float) for v in flat):
            self.events.append((kind, call, vals, time.time_ns()))
        else:
            self.resolver.feed(kind, call, vals, tensors, time.time_ns())

    # -- hooks (hot path)
    def _pre(self, mod, args):
        if mod not in self._hooked and not self._off:
            try:
                self._name(mod)
                if self.modules_mode == "leaf" and next(mod.children(), None) is not None:
                    self._hooked[mod] = _NoHandle  # containers unwatched: fewer hooks per step
                    return
                self._hooked[mod] = mod.register_forward_hook(self._post, with_kwargs=True)
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    def _post(self, mod, args, kwargs, out):
        if self._off:
            return None
        try:
            outs = self._floats(out, [])
            if not outs:
                return None
            ins = self._floats(args, [])
            if kwargs:
                self._floats(kwargs, ins)
            call = _Call(self._names.get(mod) or self._name(mod), mod)
            in_v = [self._stat(t) for t in ins]
            out_v = [self._stat(t) for t in outs]
            self.calls += 1
            immediate = isinstance(out_v[0], float) or out_v[0] is None
            if immediate and self.detected_step is None:
                call.args, call.kwargs = args, kwargs  # refs; cloned only if a candidate
            if self.torch.is_grad_enabled() and any(t.requires_grad for t in outs):
                if immediate and self.detected_step is None:
                    call.versions = [t._version for t in ins]
                for i, t in enumerate(outs):
                    if t.requires_grad:
                        self._tensor_hook(t).append(("gout", call, i, immediate))
                for t in ins:
                    if t.requires_grad:
                        self._tensor_hook(t).append(("gin", call, None, None))
            self._emit("fwd", call, (in_v, out_v), (ins, outs))
            if call.versions is None:
                call.args = call.kwargs = None  # no backward will need them
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return None

    def _tensor_hook(self, t) -> list:
        """One gradient hook per tensor. A tensor that is module A's output and module B's
        input gets one gradient: B's input-gradient is judged first (B's backward produced it),
        then A's output-gradient (A merely receives it)."""
        slot = t.__dict__.get("_trainprof_nan")
        if slot is None or slot[2] is not self.slots:
            # new tensor, or one reused from an earlier step (pipelining's recv buffers: a
            # leaf keeps its hooks across backward passes)
            slot = t.__dict__["_trainprof_nan"] = [[], None, self.slots]
            self.slots.append(slot)
        else:
            # Move our hook behind hooks registered since (e.g. by B's forward pre-hooks):
            # B's input-gradient is what B's backward receives after all of them.
            slot[1].remove()
        slot[1] = t.register_hook(functools.partial(self._grad_hook, slot[0]))
        return slot[0]

    def _grad_hook(self, entries, g):
        if self._off or g is None:
            return None
        try:
            v = self._stat(g)
            for kind, call, i, keep in sorted(entries, key=lambda e: e[0] != "gin"):
                if kind == "gin":
                    self._emit("gin", call, [v], [g])
                    call.gouts = {}  # this call's backward is over: drop the references
                else:
                    if keep and self.detected_step is None:
                        call.gouts[i] = g
                    self._emit("gout", call, [v], [g])
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return None

    # -- root module calls (replay mode): global hooks only until the roots are known
    def _discover(self, on):
        from torch.nn.modules import module as nnm

        if on and not self._discover_handles:
            self._depth = 0
            self._discover_handles = [
                nnm.register_module_forward_pre_hook(self._g_pre),
                nnm.register_module_forward_hook(self._g_post, always_call=True, with_kwargs=True)]
            _quiet_compile_warning(True)
        elif not on:
            _remove_global_hooks(self._discover_handles)
            self._discover_handles = []
            if not self.modules_on:
                _quiet_compile_warning(False)

    def _g_pre(self, mod, args):
        self._depth += 1
        if self._depth == 1:
            self._root_start(mod, args, None)

    def _g_post(self, mod, args, kwargs, out):
        self._depth -= 1
        if self._depth == 0:
            if self.roots and self.roots[-1].module is mod and self.roots[-1].kwargs is None and kwargs:
                self.roots[-1].kwargs = kwargs
            self._root_end(mod, out)

    def _install_roots(self):
        """Per-root hooks replace the global ones: module calls inside the roots pay nothing."""
        for m in list(self.roots_known):
            if m in self._root_hooked:
                continue
            self._root_hooked.add(m)
            self._root_handles.append(m.register_forward_pre_hook(self._r_pre, with_kwargs=True, prepend=True))
            self._root_handles.append(m.register_forward_hook(self._r_post, always_call=True))
        self._discover(False)
        self._depth = 0

    def _r_pre(self, mod, args, kwargs):
        self._depth += 1
        if self._depth == 1:
            self._root_start(mod, args, kwargs)

    def _r_post(self, mod, args, out):
        self._depth -= 1
        if self._depth == 0:
            self._root_end(mod, out)

    def _refusal(self, mod) -> tuple:
        """(why a replay is impossible, or None; the ranks a replay must run with, or None).
        Modules whose parameters are DTensors on one device mesh — tensor parallel, FSDP2
        (fully_shard), or both on a 2-D mesh — replay together with every rank of that mesh
        (nan_locate: coordinated replay); FSDP1's flat parameters are refused."""
        m = mod.module if type(mod).__name__ == "DistributedDataParallel" else mod
        for x in m.modules():
            if type(x).__name__ == "FullyShardedDataParallel":
                return "FSDP1-managed (flat parameters): a replay would all-gather into the job's state", None
        meshes = {}
        for t in list(m.parameters()) + list(m.buffers()):
            mesh = getattr(t, "device_mesh", None)
            if mesh is None and hasattr(t, "_local_tensor"):
                return "DTensor parameters without a device mesh", None
            if mesh is not None:
                meshes[id(mesh)] = mesh
        if not meshes:  # (a one-rank replay still refuses FSDP state: nan_locate._refuse_distributed)
            return None, None
        # FSDP2 over TP: the sharded TP weights live on the 2-D (dp, tp) mesh, the others on
        # their 1-D dp sub-mesh; every collective of a replay stays within the union
        ranks = sorted({int(r) for x in meshes.values() for r in x.mesh.flatten().tolist()})
        return None, ranks if len(ranks) > 1 else None

    def _root_start(self, mod, args, kwargs):
        if self._off:
            return
        try:
            torch = self.torch
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # eval / no_grad calls, and checkpoint recomputation inside the backward
            ent = self._replayable.get(id(mod))
            if ent is None or ent[0]() is not mod:
                why, peers = self._refusal(mod)
                ent = self._replayable[id(mod)] = (weakref.ref(mod), why, peers)
                self._name(mod)
                self.roots_known.add(mod)
                self._write({"kind": "root", "step": self.s.clock.step, "module": self._names.get(mod),
                             "module_class": type(mod).__name__, "replayable": why is None, "reason": why,
                             "replay_with": peers})
            why, peers = ent[1], ent[2]
            if why is not None or len(self.roots) >= MAX_ROOT_CALLS:
                return
            T = torch.Tensor
            if not kwargs and all(type(a) is T for a in args):  # the common case: no walk
                ts = list(args)
            else:
                ts = self._tensors(args, [])
                if kwargs:
                    self._tensors(kwargs, ts)
            cuda = ts[0].is_cuda if len(ts) == 1 else any(t.is_cuda for t in ts)
            if cuda and not self.sync:
                return  # the detection arrives steps later on CUDA: nothing to replay with
            self.roots.append(_Root(mod, args, kwargs, [t._version for t in ts], torch.get_rng_state(),
                                    torch.cuda.get_rng_state() if cuda else None, peers))
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _root_end(self, mod, out):
        c = self.roots[-1] if self.roots else None
        if c is None or c.module is not mod or c.outs or self._off:
            return
        try:
            if not self.torch.is_grad_enabled():
                return
            for i, t in enumerate(self._floats(out, [])):
                c.outs.append(weakref.ref(t))
                if t.requires_grad and self.kept_bytes + 2 * t.numel() * t.element_size() <= self.keep_bytes:
                    # autograd stores the gradient on the output (a C++ hook, ~3 µs; a Python grad
                    # hook costs 20-40 µs per call, and measured +1.5 % more on the toy reference).
                    # The output is held only until the next backward call or the optimizer step,
                    # which take the gradient (_harvest); the cap counts it with its gradient.
                    t.retain_grad()
                    c.held.append((i, t))
                    self.kept_bytes += 2 * t.numel() * t.element_size()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _harvest(self, final=False):
        """Move the gradients w.r.t. root outputs out of the held outputs, then drop those."""
        for c in self.roots:
            if not c.held:
                continue
            keep = []
            for i, t in c.held:
                g = t.grad
                if g is None:
                    if not final:
                        keep.append((i, t))  # its backward has not run yet
                    continue
                c.grads[i] = g  # counted in kept_bytes when held; autograd does not modify it
            c.held = keep

    def _tensors(self, x, acc):
        return tensors_in(x, acc, self.torch.Tensor)

    def _locate(self, where):
        """First detection on this rank: replay the step's root calls with module- and op-level
        checks (nan_locate), before the optimizer changes the parameters."""
        from trainprof.probes import nan_locate

        self.located = True
        first = self.resolver.first or {}
        loss_bad = any(not math.isfinite(float(x)) for x in self.losses)
        grads_bad = self.grad_info is not None and not math.isfinite(float(self.grad_info[0]))
        t0 = time.perf_counter()
        self._off += 1
        self.s.state["nan_replay"] = True  # the collective log marks what the replay issues
        try:
            bad = nan_locate.nonfinite_parameters(self.roots, self._param_name)
            peers = sorted({r for c in self.roots for r in (c.peers or ())})
            agreed = note = None
            if peers:  # every peer must replay the same calls, or its collectives would hang
                ready = not bad and all(nan_locate.inputs_unchanged(c) for c in self.roots)
                agreed, note = self._agree(peers, ready)
            if bad:  # the forward read a parameter that was already non-finite: a replay would
                res = self._parameter_verdict(bad)  # convict the first module that uses it
            elif peers and not agreed:
                res = {"created": False, "notes": [note]}
            else:
                res = nan_locate.locate_step(self.roots, self._names.get, loss_bad, grads_bad,
                                             coordinated=bool(peers))
                if peers:
                    res["replayed_with"] = peers
        except Exception as e:  # noqa: BLE001
            res = {"notes": [f"locate failed: {type(e).__name__}: {e}"]}
        finally:
            self._off -= 1
            self.s.state["nan_replay"] = False
        rec = {"kind": "origin", "step": self.resolver.step, "t_ns": first.get("t_ns"),
               "detected_by": first.get("role"), "at": where, "root_calls": len(self.roots),
               "loss_nonfinite": loss_bad, "grads_nonfinite": grads_bad}
        rec.update(res)
        rec["replay_ms"] = (time.perf_counter() - t0) * 1e3
        self._write(rec)

    def _agree(self, peers: list, ready: bool) -> tuple:
        """Through the job's TCPStore (no collective, so a peer that never detects costs one
        bounded wait, not a hang): this rank publishes its readiness and root-call count for this
        step and waits up to TRAINPROF_NAN_PEER_WAIT_S for its mesh peers' (tensor parallel,
        FSDP2). Keys are per peer group: the stages of a pipeline agree separately."""
        import json
        from datetime import timedelta

        import torch.distributed as dist

        step, me = self.resolver.step, self.s.rank
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception as e:  # noqa: BLE001
            return False, f"coordinated replay skipped: no store ({type(e).__name__}: {e})"
        group = ",".join(map(str, peers))
        prefix = f"trainprof/nan_replay/{step}/{peers[0]}-{zlib.crc32(group.encode()):08x}/"
        store.set(prefix + str(me), json.dumps({"calls": len(self.roots), "ready": bool(ready)}))
        others = [p for p in peers if p != me]
        try:
            store.wait([prefix + str(p) for p in others], timedelta(seconds=self.peer_wait_s))
        except Exception:  # noqa: BLE001 - timeout: some peer did not detect at this step
            missing = [p for p in others if not store.check([prefix + str(p)])]
            return self._decide(store, prefix, "abort",
                                f"coordinated replay skipped: mesh peers {missing} did not "
                                f"detect at step {step} within {self.peer_wait_s:g} s")
        info = {p: json.loads(store.get(prefix + str(p))) for p in others}
        odd = [p for p, i in info.items() if not i.get("ready") or i.get("calls") != len(self.roots)]
        note = None
        if not ready or odd:
            note = (f"coordinated replay skipped: ranks {sorted(odd + ([me] if not ready else []))} "
                    f"not ready (inputs changed, stale parameters, or other root calls)")
        return self._decide(store, prefix, "abort" if note else "go", note)

    def _decide(self, store, prefix, mine: str, note):
        """Every rank proposes; the first proposal stored wins and every rank follows it (a rank
        whose wait timed out proposes abort, so a late peer cannot replay alone)."""
        try:
            got = store.compare_set(prefix + "decision", "", mine)
            got = got.decode() if isinstance(got, bytes) else str(got)
        except Exception as e:  # noqa: BLE001
            return False, f"coordinated replay skipped: store decision failed ({type(e).__name__}: {e})"
        if got == "go":
            return True, None
        return False, note or "coordinated replay skipped: a peer's wait for the others timed out"

    def _parameter_verdict(self, bad: list) -> dict:
        """Parameters were non-finite before this step's forward: written so by an optimizer step
        (or code updating them) after the last step whose parameter check was finite."""
        step, ok = self.resolver.step, self._params_ok_step
        lo = ok + 1 if ok is not None else 0
        if lo > step - 1:  # finite after the previous optimizer step: changed within this step
            window = [step, step]
            when = f"code that changed it during step {step}, before its forward (not an optimizer step)"
        else:
            window = [lo, step - 1]
            when = (f"the optimizer step of step {lo}" if lo == step - 1 else
                    f"an optimizer step between steps {lo} and {step - 1}")
        last = (f" (parameters were last checked finite at step {ok})" if ok is not None else
                " (never checked finite before: possibly loaded or initialized so)")
        first = bad[0]
        return {"created": True, "phase": "optimizer", "role": "parameters", "module": first["module"],
                "op": None, "param": first["param"], "origin_steps": window, "value": value_kind_of(first),
                "params_nonfinite": [b["param"] for b in bad[:20]], "first_params": bad[:5],
                "evidence": f"parameter {first['param']} was already {value_kind_of(first)} when step "
                            f"{step}'s forward read it: written by {when}{last}, not by this "
                            f"step's computation"}

    def _maybe_locate(self, where):
        first = self.resolver.first
        if (self.replay_on and not self.located and first is not None
                and first.get("role") in ("loss", "parameter_grads")):
            self._locate(where)

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

    def _queue(self, entry):
        """Deferred mode: one concatenation and one non-blocking copy per step."""
        torch = self.torch
        vals, layout = [], []
        for kind, call, v, t_ns in entry["events"]:
            flat = v if kind != "fwd" else v[0] + v[1]
            layout.append(len(flat))
            vals += [x for x in flat if x is not None]
        for key in ("grad", "params"):
            if entry[key] is not None and not isinstance(entry[key], float):
                vals.append(entry[key])
        if entry["loss"] is not None:
            vals += entry["loss"] if isinstance(entry["loss"], list) else list(entry["loss"].reshape(-1))
        dev = [v for v in vals if isinstance(v, torch.Tensor)]
        if not dev:
            self._write_step(entry)
            return
        flat = torch.stack([v.float().reshape(()) if isinstance(v, torch.Tensor)
                            else torch.tensor(v, device=dev[0].device) for v in vals])
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda)
        host.copy_(flat, non_blocking=True)
        ev = None
        if flat.is_cuda:
            ev = torch.cuda.Event()
            ev.record()
        entry.update(host=host, cuda_event=ev)
        self._pending.append(entry)

    def _resolve_pending(self, wait=False):
        keep = []
        for e in self._pending:
            ev = e.get("cuda_event")
            if ev is not None and not ev.query():
                if not wait:
                    keep.append(e)
                    continue
                ev.synchronize()  # only at shutdown
            try:
                self._replay_events(e)
            except Exception as ex:  # noqa: BLE001
                self._fail(ex)
        self._pending = keep

    def _replay_events(self, e):
        """Feed a deferred step's events to its resolver with the copied host values."""
        vals = e["host"].tolist()
        pos = 0
        res = e["resolver"]
        for kind, call, v, t_ns in e["events"]:
            flat = v if kind != "fwd" else v[0] + v[1]
            host = []
            for x in flat:
                if x is None:
                    host.append(None)
                else:
                    host.append(vals[pos])
                    pos += 1
            if kind == "fwd":
                n = len(v[0])
                hv = (host[:n], host[n:])
            else:
                hv = host
            res.feed(kind, call, hv, None, t_ns)
        for key in ("grad", "params"):
            if e[key] is not None and not isinstance(e[key], float):
                e[key] = vals[pos]
                pos += 1
        if e["loss"] is not None:
            e["loss"] = vals[pos:]
        e["events"] = []
        self._write_step(e)

    def _write_step(self, e):
        loss = e["loss"]
        if loss is not None and not isinstance(loss, list):
            loss = loss.tolist()
        grad = e["grad"]
        grad = float(grad) if grad is not None and not isinstance(grad, float) else grad
        params = e["params"]
        if params is not None and math.isfinite(params):
            self._params_ok_step = max(e["step"], self._params_ok_step or 0)
        fin = [x for x in (loss or []) if x is not None]
        res = e["resolver"]
        rec = {"kind": "step", "step": e["step"], "t_ns": e["t_ns"],
               "loss": (sum(fin) / len(fin)) if fin and all(map(math.isfinite, fin)) else None,
               "loss_sum": sum(fin) if fin and all(map(math.isfinite, fin)) else None,
               "n_loss": len(fin), "loss_finite": all(map(math.isfinite, fin)) if fin else None,
               "grad_norm": grad if grad is not None and math.isfinite(grad) else None,
               "grad_finite": math.isfinite(grad) if grad is not None else None,
               "params_finite": math.isfinite(params) if params is not None else None,
               "params_every": self.params_interval,
               "modules_finite": res.first is None or res.first.get("role") in
               ("loss", "parameter_grads", "parameters"),
               "module_calls": e["calls"], "root_calls": e.get("roots", 0), "mode": self.modules_mode}
        if res.first is not None:
            rec["first_nonfinite"] = {k: res.first.get(k) for k in ("phase", "module", "role", "value")}
        self._write(rec)

    # -- detection records and candidates
    def _nonfinite_record(self, step, kind, phase, role, call, vals, tensors, created, first, t_ns):
        from trainprof.probes import nan_locate

        rec = {"kind": "nonfinite", "step": step, "t_ns": t_ns or time.time_ns(), "phase": phase,
               "role": role, "created": bool(created), "first": bool(first)}
        if kind in ("fwd", "gout", "gin"):
            rec["module"] = call.name
            rec["module_class"] = type(call.module).__name__
        elif kind == "loss":
            rec["module"] = "<loss>"
        elif kind == "grads":
            total, norms, params = call
            bad = [p for p, n in zip(params, norms) if not math.isfinite(float(n))]
            rec["module"] = "<parameters>"
            rec["params_nonfinite"] = len(bad)
            names = [self._param_name(p) for p in bad[:5]]
            rec["first_params"] = [n for n in names if n]
        else:
            rec["module"] = "<optimizer>"
        try:
            if kind == "fwd":
                in_v, out_v = vals
                rec["inputs_max_abs"] = in_v
                rec["outputs_max_abs"] = out_v
                if tensors is not None:
                    ins, outs = tensors
                    rec["inputs"] = [nan_locate.stats(t) for t in ins[:4]]
                    rec["output"] = nan_locate.stats(next(t for t, v in zip(outs, out_v) if not _finite(v)))
                    rec["value"] = nan_locate.value_kind(rec["output"])
            elif tensors is not None:
                s = nan_locate.stats(tensors[0])
                rec["output" if kind == "loss" else "grad"] = s
                rec["value"] = nan_locate.value_kind(s)
            if "value" not in rec:
                v = next((x for x in (vals[1] if kind == "fwd" else vals) if not _finite(x)), None)
                rec["value"] = "nan" if v is not None and math.isnan(v) else "inf"
        except Exception as e:  # noqa: BLE001
            rec["evidence_error"] = f"{type(e).__name__}: {e}"
        if kind == "gin":
            rec["grad_output_finite"] = bool(call.gout_ok)
        if created:
            rec["evidence"] = ("inputs finite, output non-finite" if phase == "forward" else
                               "gradient w.r.t. outputs finite, gradient w.r.t. inputs non-finite"
                               if kind == "gin" else "first non-finite value of the step")
        self._write(rec)
        if self.detected_step is None:
            self.detected_step = step
        return rec

    def _candidate(self, rec, call, kind, tensors):
        """Keep what a replay of this module call needs (immediate mode only)."""
        if kind not in ("fwd", "gin") or call is None or call.module is None or self.replayed:
            return
        if any(c[0].get("module") == rec.get("module") and c[2]["phase"] == rec["phase"]
               for c in self.candidates):
            return  # the same module again (another micro-batch)
        torch = self.torch

        def clone(x):
            if isinstance(x, torch.Tensor):
                return x.detach().clone().requires_grad_(x.requires_grad) if x.is_floating_point() else x.detach().clone()
            if isinstance(x, (tuple, list)):
                return type(x)(clone(y) for y in x)
            if isinstance(x, dict):
                return {k: clone(v) for k, v in x.items()}
            return x

        if kind == "fwd":
            if call.args is None:
                return
            material = {"phase": "forward", "args": clone(call.args), "kwargs": clone(call.kwargs or {}),
                        "grads": None}
        else:
            if call.args is None:
                return
            now = [t._version for t in self._floats(call.args, []) + self._floats(call.kwargs or {}, [])]
            if call.versions is not None and now != call.versions:
                rec_note = "inputs were modified in place after the call; no replay"
                self._write({"kind": "op", "step": rec["step"], "module": rec["module"],
                                "phase": "backward", "op": None, "note": rec_note})
                return
            n = max(call.gouts) + 1 if call.gouts else 0
            grads = [clone(call.gouts.get(i)) for i in range(n)]
            material = {"phase": "backward", "args": clone(call.args), "kwargs": clone(call.kwargs or {}),
                        "grads": grads}
        self.candidates.append((rec, call.module, material))

    def _maybe_replay(self):
        if self.replayed or not self.candidates:
            return
        self.replayed = True
        from trainprof.probes import nan_locate

        cands, self.candidates = self.candidates, []
        self._off += 1
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

    def _write(self, rec):
        # detections go out at once (the job may die of them); step records ride the ticker
        kind = rec.get("kind")  # step records hold finite numbers or None: no conversion pass
        self.out.write(rec if kind == "step" else _jsonable(rec), urgent=kind not in ("step", "root"))

    def _fail(self, e):
        if not getattr(self, "_warned", False):
            self._warned = True
            runtime.warn(f"nan watch: {type(e).__name__}: {e}")


def value_kind_of(s: dict) -> str:
    from trainprof.probes.nan_locate import value_kind

    return value_kind(s) or "non-finite"


def _jsonable(x):
    """Non-finite floats as the strings "nan"/"inf"/"-inf" (strict JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _remove_global_hooks(handles) -> None:
    """Remove hook handles; a global forward hook registered with_kwargs also leaves its id in
    torch's _global_forward_hooks_with_kwargs (RemovableHandle does not clear it), which keeps
    torch.nn's "any global hook?" true for the rest of the job: cleared here too."""
    try:
        from torch.nn.modules import module as nnm

        leftover = getattr(nnm, "_global_forward_hooks_with_kwargs", None)
    except Exception:  # noqa: BLE001
        leftover = None
    for h in handles:
        h.remove()
        if leftover is not None and getattr(h, "id", None) in leftover \
                and h.id not in getattr(nnm, "_global_forward_hooks", {}):
            leftover.pop(h.id, None)


# torch.compile(module) warns on every OptimizedModule call while any global module hook is
# registered ("... hooks fire an extra time ..."): while ours are, that warning is about trainprof,
# not the job, and is filtered by its text; the filter goes when our global hooks go
_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
_compile_filter = None


def _quiet_compile_warning(on: bool) -> None:
    global _compile_filter
    import warnings

    try:
        if on and _compile_filter is None:
            warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
            _compile_filter = warnings.filters[0]
        elif not on and _compile_filter is not None:
            f, _compile_filter = _compile_filter, None
            if f in warnings.filters:
                warnings.filters.remove(f)
                mutated = getattr(warnings, "_filters_mutated", None)
                if mutated is not None:
                    mutated()
    except Exception:  # noqa: BLE001 - a warning shown is no reason to disturb the job
        pass


def _quiet_pipeline_inference():
    """torch.distributed.pipelining infers shapes in its first step by running the stage on
    ``torch.empty`` inputs (uninitialized memory, often NaN/Inf): not the job's values, so the
    watch looks away while it runs."""
    try:
        from torch.distributed.pipelining import stage as st
    except Exception:  # noqa: BLE001 - no distributed / pipelining in this build
        return
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
