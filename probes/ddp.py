"""DistributedDataParallel's gradient all-reduce in the collective log (collectives.jsonl).

DDP's Reducer issues its bucketed all-reduce from C++, below the Python ``ProcessGroup`` methods
the collective log wraps. The one Python entry DDP offers is the communication hook, so every DDP
model gets a recording hook (registered with ``dist._register_comm_hook``, the call DDP's own
``register_comm_hook`` makes) that either

* composes with the job's hook: a hook the job registers with ``register_comm_hook`` (before or
  after ours, including DDP's own mixed-precision and fused-optimizer hooks) becomes the target our
  hook calls with the job's state; DDP's Python bookkeeping (``_comm_hooks``, the logger's hook
  name, the signature check) is done exactly as without trainprof; or
* reproduces the Reducer's built-in path: gradients scaled by 1/world in the bucket, then one
  ``all_reduce`` (sum) of the bucket. Bit-identical to the built-in path where that multiplies
  (``gradient_as_bucket_view=False``; any world size that is a power of two); where it divides
  (``gradient_as_bucket_view=True`` on other world sizes) or the divisor changes per step
  (``Join(divide_by_initial_world_size=False)``), sparse gradients, compiled-autograd DDP
  (python reducer) or a built-in C++ hook the job registered: no hook is installed and the
  run's meta says why (docs/collectives.md).

The hook is installed at the model's first forward (hooks must be registered before backward;
jobs register theirs right after wrapping the model), so a job registering a built-in hook keeps
it untouched. Records: op ``all_reduce`` (or whatever the job's hook issues), ``api``
``ddp.bucket``, ``bucket`` (index), ``end_ns`` when the bucket's future completed and
``blocked_ms`` = the time backward waited for this bucket after the last bucket was launched
(compute done): buckets sorted by end, each charged max(0, end - max(last launch, previous end)),
so their sum is max(0, last end - last launch). ``dist._broadcast_coalesced`` (DDP's start-up
parameter sync and per-forward buffer broadcast) is recorded as one sync ``broadcast`` op.
"""

from __future__ import annotations

import functools
import time
import weakref

from trainprof.probes import collectives, runtime

API = "ddp.bucket"
_TAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # DDP module -> _Tap
_patched = False


class _Tap:
    """Per DDP model: the hook's target and the buckets of the backward pass in flight."""

    __slots__ = ("__weakref__", "ddp", "pg", "target", "installed", "reason", "launched",
                 "done", "t_last", "scale")

    def __init__(self, ddp):
        self.ddp = weakref.ref(ddp)
        self.pg = ddp.process_group
        self.target = None          # (hook, state) of the job, or None: the built-in path
        self.installed = False
        self.reason = None          # why no hook was installed
        self.scale = 1.0 / self.pg.size()
        self._reset()

    def _reset(self):
        self.launched = 0
        self.done = []              # (ops, t_end) of completed buckets of this pass
        self.t_last = None          # when the last bucket was launched


# --------------------------------------------------------------------------- the hook


def _new_ops(log, mark):
    """Ops the log issued since ``mark`` (the last rid before): rids grow, dicts keep order."""
    out = []
    for rid in reversed(log._ops):
        if rid <= mark:
            break
        out.append(log._ops[rid])
    out.reverse()
    return out


def _last_rid(log):
    return next(reversed(log._ops), -1)


def _hook(tap, bucket):
    log = collectives._LOG
    if log is None or log.closed:
        return _call_target(tap, bucket)
    try:
        mark = _last_rid(log)
    except Exception:  # noqa: BLE001
        return _call_target(tap, bucket)
    fut = _call_target(tap, bucket)  # the job's hook or the built-in path: its errors are its own
    try:
        ops = _new_ops(log, mark)
        index, last = bucket.index(), bucket.is_last()
        for o in ops:
            rec = o.rec
            rec["api"] = API
            rec["bucket"] = index
            if tap.target is not None:
                rec["hook"] = getattr(tap.target[0], "__qualname__", None)
        tap.launched += 1
        if last:
            tap.t_last = time.time_ns()
    except Exception as e:  # noqa: BLE001
        collectives._note_error(log, e)
        return fut
    return fut.then(functools.partial(_bucket_done, tap, log, ops))


def _call_target(tap, bucket):
    if tap.target is not None:
        hook, state = tap.target
        return hook(state, bucket)
    buf = bucket.buffer()
    buf.mul_(tap.scale)  # what the Reducer does to each gradient when it has no hook
    import torch.distributed as dist

    return dist.all_reduce(buf, group=tap.pg, async_op=True).get_future().then(_first)


def _first(fut):
    return fut.value()[0]


def _bucket_done(tap, log, ops, fut):
    t = time.time_ns()
    try:
        if ops:
            mine = {id(o) for o in ops}
            for o in ops:
                if not o.done:
                    log.complete(o, t)
            for k, (_w, wops) in list(log._works.items()):
                if any(id(o) in mine for o in wops):
                    log._works.pop(k, None)
        tap.done.append((ops, t))
        if tap.t_last is not None and len(tap.done) >= tap.launched:
            _charge_blocked(tap)
    except Exception as e:  # noqa: BLE001
        collectives._note_error(log, e)
    return fut.value()  # the bucket's new value, or the job's hook's error, unchanged


def _charge_blocked(tap):
    cursor = tap.t_last
    for ops, t_end in sorted(tap.done, key=lambda x: x[1]):
        b = max(0, t_end - cursor)
        cursor = max(cursor, t_end)
        if ops:
            for o in ops:
                o.rec["blocked_ms"] = 0.0
            ops[-1].rec["blocked_ms"] = b / 1e6
    tap._reset()


# --------------------------------------------------------------------------- install


def _why_not(ddp) -> str | None:
    """Why the built-in path cannot be reproduced bit for bit (None: it can)."""
    if getattr(ddp, "_use_python_reducer", False):
        return "compiled-autograd DDP (python reducer)"
    if getattr(ddp, "reducer", None) is None:
        return "no reducer"
    n = ddp.process_group.size()
    if getattr(ddp, "gradient_as_bucket_view", False) and n & (n - 1):
        return (f"gradient_as_bucket_view=True on {n} ranks (not a power of two): the built-in "
                "path divides in place, a hook would multiply by 1/n")
    try:
        if any(getattr(p, "layout", None) is not None and p.is_sparse for p in ddp.parameters()):
            return "sparse parameters"
        if any(getattr(m, "sparse", False) for m in ddp.module.modules()):
            return "sparse gradients (an embedding with sparse=True)"
    except Exception:  # noqa: BLE001
        return "parameters could not be inspected"
    jc = getattr(ddp, "_join_config", None)
    if jc is not None and getattr(jc, "enable", False) and \
            not getattr(ddp, "_divide_by_initial_world_size", True):
        return "Join(divide_by_initial_world_size=False): the divisor changes per step"
    return None


def _tap(ddp, create=True):
    tap = _TAPS.get(ddp)
    if tap is None and create:
        tap = _TAPS[ddp] = _Tap(ddp)
    return tap


def _install(ddp, target=None) -> bool:
    """Register the recording hook on ``ddp`` (once). False: not installed (reason in meta)."""
    import torch.distributed as dist

    tap = _tap(ddp)
    if tap.installed:
        return True
    if target is None:
        tap.reason = _why_not(ddp)
        if tap.reason is not None:
            _note(ddp, tap)
            return False
    tap.target = target
    dist._register_comm_hook(ddp.reducer, tap, _hook)
    tap.installed = True
    _note(ddp, tap)
    return True


def _note(ddp, tap):
    """What the run's meta says about this model's gradient all-reduce (analysis reads it)."""
    s = runtime.active()
    log = collectives._LOG
    if s is None:
        return
    try:
        name = log.group(tap.pg)[0] if log is not None else None
        if log is not None and name is not None:
            log.dim_hints.setdefault(name, "dp")
        entry = {"pg": name, "world": tap.pg.size(), "recorded": tap.installed,
                 "hook": (getattr(tap.target[0], "__qualname__", None) if tap.target else None),
                 "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
                 "static_graph": bool(getattr(ddp, "static_graph", False)),
                 "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False))}
        if tap.reason:
            entry["not_recorded"] = tap.reason
            runtime.warn(f"DDP gradient all-reduce not recorded: {tap.reason}")
        models = list(s.meta.get("ddp") or [])
        models.append(entry)
        s.update_meta(ddp=models[-16:])
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"ddp probe: {type(e).__name__}: {e}")


def _first_forward(ddp, _args, _kwargs):
    """Forward pre-hook, removed at its first call: install the recording hook unless the job
    registered a built-in one or the built-in path cannot be reproduced."""
    try:
        import torch

        if torch.compiler.is_compiling():
            return None
        h = _HANDLES.pop(ddp, None)
        if h is not None:
            h.remove()
        tap = _tap(ddp)
        if not tap.installed and tap.reason is None and collectives._LOG is not None:
            _install(ddp)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"ddp probe: {type(e).__name__}: {e}")
    return None


_HANDLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _patch_ddp():
    global _patched
    if _patched:
        return
    _patched = True
    from torch.nn.parallel import DistributedDataParallel as DDP

    init, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if collectives._LOG is None or self in _TAPS and _TAPS[self].installed:
            return
        try:
            _tap(self)
            _HANDLES[self] = self.register_forward_pre_hook(_first_forward, with_kwargs=True)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"ddp probe: {type(e).__name__}: {e}")

    @functools.wraps(register)
    def register_comm_hook(self, state, hook):
        tap = _TAPS.get(self)
        if collectives._LOG is None and (tap is None or not tap.installed):
            return register(self, state, hook)
        if tap is not None and tap.installed and tap.target is not None:
            return register(self, state, hook)  # a second hook: DDP's own error, unchanged
        # DDP's Python side exactly as register_comm_hook does it, then our hook calls theirs
        self._check_comm_hook(hook)
        if self.logger is None:
            raise AssertionError("self.logger must not be None")
        try:
            tap = _tap(self)
            if tap.installed:
                tap.target = (hook, state)
            else:
                _install(self, target=(hook, state))
        except Exception as e:  # noqa: BLE001 - could not compose: the job's hook alone
            runtime.warn(f"ddp probe: {type(e).__name__}: {e}")
            if not (tap is not None and tap.installed):
                return register(self, state, hook)
            tap.target = (hook, state)
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        return None

    @functools.wraps(builtin)
    def _register_builtin_comm_hook(self, comm_hook_type):
        tap = _TAPS.get(self)
        if tap is None or not tap.installed:
            if tap is not None:
                tap.reason = f"the job registered the built-in {comm_hook_type} hook"
                _note(self, tap)
            return builtin(self, comm_hook_type)
        # ours is in already (the job registered after its first forward): its Python twin
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        import torch.distributed as dist

        twins = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        hook = twins.get(comm_hook_type)
        if hook is None:
            return builtin(self, comm_hook_type)  # DDP's own error (a hook is registered)
        runtime.warn(f"DDP built-in hook {comm_hook_type} registered after the first forward: "
                     "trainprof runs its Python equivalent")
        tap.target = (hook, self.process_group)
        self.logger._set_comm_hook_name(str(comm_hook_type))
        return None

    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook
    _patch_broadcast_coalesced()


def _patch_broadcast_coalesced():
    import torch.distributed as dist

    original = getattr(dist, "_broadcast_coalesced", None)
    if original is None or getattr(original, "_trainprof", False):
        return

    def _broadcast_coalesced(*args, **kwargs):
        log = collectives._LOG
        if log is None or log.closed or collectives._busy() or len(args) < 2:
            return original(*args, **kwargs)
        try:
            info = log.group(args[0])
            nbytes, numel, dtype = collectives._nbytes(list(args[1]))
            o = log.issue("broadcast", info, nbytes, numel, dtype, None, False,
                          "c10d._broadcast_coalesced", False, sync=True)
        except Exception as e:  # noqa: BLE001
            collectives._note_error(log, e)
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            try:
                log.complete(o, time.time_ns())
            except Exception as e:  # noqa: BLE001
                collectives._note_error(log, e)

    _broadcast_coalesced._trainprof = True
    _broadcast_coalesced._trainprof_original = original
    dist._broadcast_coalesced = _broadcast_coalesced


def attach(session) -> None:
    import torch.distributed as dist

    if not dist.is_available() or collectives._LOG is None:
        return  # the collective log is off: nothing to record into
    _patch_ddp()
