"""DistributedDataParallel's gradient all-reduce in the collective log (collectives.jsonl).

DDP's Reducer issues its bucketed all-reduce from C++, below the Python ``ProcessGroup`` methods
the collective log wraps. The one Python entry DDP offers is the communication hook, so every DDP
model gets a recording hook (registered with ``dist._register_comm_hook``, the call DDP's own
``register_comm_hook`` makes) that either

* composes with the job's hook: a hook the job registers with ``register_comm_hook`` (before or
  after ours, including DDP's own mixed-precision and fused-optimizer hooks) becomes the target our
  hook calls with the job's state; DDP's Python bookkeeping (``_comm_hooks``, the logger's hook
  name, the signature check) is done exactly as without trainprof; or
* reproduces the Reducer's built-in path: gradients scaled by 1/world in the bucket (under
  ``Join(divide_by_initial_world_size=False)``, by 1/the ranks not yet joined, read from Join's
  forward-pass all-reduce as the Reducer reads it), then one ``all_reduce`` (sum) of the bucket.
  Bit-identical to the built-in path where that multiplies (``gradient_as_bucket_view=False``;
  any world size that is a power of two). Where it divides (``gradient_as_bucket_view=True`` on
  other world sizes), sparse gradients, compiled-autograd DDP (python reducer) or a built-in C++
  hook the job registered: no hook is installed and the run's meta says why
  (docs/collectives.md).

A job hook that runs DDP's own all-reduce in C++ (``Reducer._run_allreduce_hook``: DDP's
mixed-precision and optimizer-in-backward hooks) issues nothing the log sees: its bucket gets one
record sized by the bucket, marked ``inferred``.

The hook is installed at the model's first forward (hooks must be registered before backward;
jobs register theirs right after wrapping the model), so a job registering a built-in hook keeps
it untouched. Records: op ``all_reduce`` (or whatever the job's hook issues), ``api``
``ddp.bucket``, ``bucket`` (index), ``end_ns`` when the bucket's future completed and
``blocked_ms`` = the time backward waited for this bucket after the last bucket was launched
(compute done): buckets sorted by end, each charged max(0, end - max(last launch, previous end)),
so their sum is max(0, last end - last launch); charged by an autograd final callback queued
after DDP's own (which waits for every bucket), or at the step boundary. ``dist._broadcast_coalesced`` (DDP's start-up
parameter sync and per-forward buffer broadcast) is recorded as one sync ``broadcast`` op.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

from trainprof.probes import collectives, runtime

API = "ddp.bucket"
MAX_PENDING = 4096  # completed buckets kept for one pass's charge (a safety net, never reached)
_TAPS: dict = {}    # id(DDP module) -> _Tap (by id: a DDP subclass may be unhashable)
_patched = False
_cpp_allreduce = threading.local()  # .n: Reducer._run_allreduce_hook calls inside a job's hook


class _Tap:
    """Per DDP model: the hook's target and the buckets of the backward pass in flight."""

    __slots__ = ("__weakref__", "ddp", "pg", "target", "installed", "reason", "launches",
                 "done", "queued", "scale", "join_work", "entry")

    def __init__(self, ddp):
        self.ddp = weakref.ref(ddp)
        self.pg = ddp.process_group
        self.target = None          # (hook, state) of the job, or None: the built-in path
        self.installed = False
        self.reason = None          # why no hook was installed
        self.scale = 1.0 / self.pg.size()
        self.join_work = None       # Join's forward-pass work: the live ranks' count
        self.entry = None           # this model's entry in meta["ddp"]
        self._reset()

    def _reset(self):
        self.launches = []          # launch times of this pass's buckets
        self.done = []              # (ops, t_end) of its completed buckets
        self.queued = False         # the end-of-backward charge is queued


def _tap_of(ddp, create=True):
    tap = _TAPS.get(id(ddp))
    if tap is not None and tap.ddp() is not ddp:  # an id reused after its model was freed
        tap = _TAPS.pop(id(ddp), None) and None
    if tap is None and create:
        tap = _TAPS[id(ddp)] = _Tap(ddp)
        weakref.finalize(ddp, _TAPS.pop, id(ddp), None)
    return tap


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


def _hook(tap, bucket):
    log = collectives._LOG
    if log is None or log.closed:
        fut, unwrap = _call_target(tap, bucket)
        return _deliver(fut, unwrap, None)
    try:
        mark = next(reversed(log._ops), -1)
        t0 = time.time_ns()
        _cpp_allreduce.n = 0
    except Exception:  # noqa: BLE001
        mark = None
    # the job's hook or the built-in path: its errors are its own
    fut, unwrap = _call_target(tap, bucket)
    if mark is None:
        return _deliver(fut, unwrap, None)
    try:
        ops = _new_ops(log, mark)
        if not ops and getattr(_cpp_allreduce, "n", 0):
            # the job's hook ran DDP's own all-reduce in C++ (Reducer._run_allreduce_hook:
            # mixed precision, optimizer in backward): one record for it, sized by the bucket
            ops = [_issue_inferred(log, tap, bucket, t0)]
        index = bucket.index()
        hook = getattr(tap.target[0], "__qualname__", None) if tap.target is not None else None
        for o in ops:
            rec = o.rec
            rec["api"] = API
            rec["bucket"] = index
            if hook is not None:
                rec["hook"] = hook
        tap.launches.append(time.time_ns())
        if not tap.queued:
            _queue_charge(tap)
    except Exception as e:  # noqa: BLE001
        collectives._note_error(log, e)
        return _deliver(fut, unwrap, None)
    return _deliver(fut, unwrap, functools.partial(_bucket_done, tap, log, ops, unwrap))


def _deliver(fut, unwrap, done):
    """The future DDP gets for a bucket; ``done`` (a ``then`` callback) records its completion.

    A ``then`` callback that raises fails its future with torch's wrapper error ("Got the
    following error when running the callback: ...  At: <our file>"), never the original; so
    no future of ours may carry a failed all-reduce's error to the job:

    * the job's hook: its future goes to DDP untouched (its value, its error). The record is
      chained on a side future whose callback never raises, and that side future's wait is
      queued as an autograd final callback: queued before DDP queues its finalize (when the
      last bucket is ready), so finalize finds every bucket recorded, as when DDP waited our
      future;
    * the built-in path: DDP's Python hook wrapper wants a future whose value is the tensor,
      which in Python only ``then`` makes, so the chained future goes to DDP. Ahead of DDP's
      finalize, a final callback waits on the all-reduce's own future with the builtin
      ``torch._C.Future.wait``: a failed all-reduce raises its own error there, type and
      message as bare and no frame of ours, before finalize could see the wrapped one. (What
      differs: finalize has not run, where bare it stopped at that same wait; and in a
      static graph's first backward, whose buckets DDP launches from finalize itself, the
      wrapped error remains.) Outside backward (Join's shadow pass for a joined rank, which
      only waits on the future) the all-reduce's own future is returned.
    """
    if not unwrap:
        if done is not None:
            try:
                _queue_wait(fut.then(done))
            except Exception:  # noqa: BLE001 - not a Future: DDP says so, as without us
                pass
        return fut
    out = fut.then(done if done is not None else _first)
    try:
        _queue_wait(fut)
    except Exception:  # noqa: BLE001 - no final callback: outside backward, or out (as before)
        try:
            if not _in_backward():
                return fut
        except Exception:  # noqa: BLE001
            pass
    return out


_WAIT = None  # torch._C.Future.wait: a builtin, so what it raises carries no frame of ours


def _queue_wait(fut):
    """Queue ``fut``'s wait as an autograd final callback (inside backward only)."""
    global _WAIT
    from torch.autograd import Variable

    if _WAIT is None:
        import torch

        _WAIT = torch._C.Future.wait
    Variable._execution_engine.queue_callback(functools.partial(_WAIT, fut))


def _in_backward() -> bool:
    import torch

    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is None or current() != -1


def _call_target(tap, bucket):
    """(future, unwrap): the job's hook's future, or the built-in path's (value [tensor])."""
    if tap.target is not None:
        hook, state = tap.target
        return hook(state, bucket), False
    buf = bucket.buffer()
    buf.mul_(_scale(tap))  # what the Reducer does to each gradient when it has no hook
    import torch.distributed as dist

    return dist.all_reduce(buf, group=tap.pg, async_op=True).get_future(), True


def _scale(tap) -> float:
    """1/world, or under Join(divide_by_initial_world_size=False) 1/(ranks not yet joined): the
    Reducer's divisor, read from Join's forward-pass all-reduce as the Reducer reads it."""
    ddp = tap.ddp()
    jc = getattr(ddp, "_join_config", None)
    if jc is None or not getattr(jc, "enable", False) or \
            getattr(ddp, "_divide_by_initial_world_size", True) or tap.join_work is None:
        return tap.scale
    w = tap.join_work
    w.wait()
    return 1.0 / int(w.result()[0].item())


def _issue_inferred(log, tap, bucket, t0):
    buf = bucket.buffer()
    nbytes, numel, dtype = collectives._nbytes(buf)
    o = log.issue("all_reduce", log.group(tap.pg), nbytes, numel, dtype, None, True, API,
                  False, sync=False)
    o.rec["enqueue_ns"] = t0
    o.rec["inferred"] = True
    return o


def _first(fut):
    return fut.value()[0]


def _bucket_done(tap, log, ops, unwrap, fut):
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
        if len(tap.done) < MAX_PENDING:
            tap.done.append((ops, t))
    except Exception as e:  # noqa: BLE001
        collectives._note_error(log, e)
    # the bucket's new value (built-in path); the job's future is DDP's, not this one's
    return fut.value()[0] if unwrap else None


def _queue_charge(tap):
    """Charge blocked time once backward is over. DDP queues its finalize callback (which waits
    for every bucket) when its last bucket is ready, after our first bucket: so the callback
    queued here queues the charge once more, behind DDP's. Where a callback cannot be queued the
    step boundary charges the pass (_on_step)."""
    tap.queued = True
    try:
        from torch.autograd import Variable

        engine = Variable._execution_engine
        charge = functools.partial(_charge_blocked, tap)
        engine.queue_callback(lambda: _requeue(engine, charge))
    except Exception:  # noqa: BLE001
        pass


def _requeue(engine, charge):
    try:
        engine.queue_callback(charge)
    except Exception:  # noqa: BLE001 - charged at the step boundary
        pass


def _charge_blocked(tap):
    """Buckets sorted by completion; each is charged the time past the last launch (all
    gradients computed) not already charged to an earlier one."""
    if len(tap.done) < len(tap.launches) and len(tap.launches) <= MAX_PENDING:
        return  # buckets still in flight (a callback that ran early): the step charges it
    try:
        if tap.launches and tap.done:
            cursor = max(tap.launches)
            for ops, t_end in sorted(tap.done, key=lambda x: x[1]):
                b = max(0, t_end - cursor)
                cursor = max(cursor, t_end)
                if ops:
                    for o in ops:
                        o.rec["blocked_ms"] = 0.0
                    ops[-1].rec["blocked_ms"] = b / 1e6
    finally:
        tap._reset()


def _on_step(_rec=None):
    """Step boundary, before the collective log writes the step's records: a pass whose charge
    could not be queued (no autograd engine callback) is charged here."""
    for tap in list(_TAPS.values()):
        if tap.launches and len(tap.done) >= len(tap.launches):
            _charge_blocked(tap)
        elif len(tap.launches) > MAX_PENDING:
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
    return None


def _install(ddp, target=None) -> bool:
    """Register the recording hook on ``ddp`` (once). False: not installed (reason in meta)."""
    import torch.distributed as dist

    tap = _tap_of(ddp)
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
        cap = getattr(ddp, "bucket_bytes_cap", None)
        if isinstance(cap, int) and not isinstance(cap, bool):
            entry["bucket_bytes_cap"] = cap
        if tap.reason:
            entry["not_recorded"] = tap.reason
            runtime.warn(f"DDP gradient all-reduce not recorded: {tap.reason}")
        models = [m for m in (s.meta.get("ddp") or []) if m is not tap.entry]
        tap.entry = entry
        models.append(entry)
        s.update_meta(ddp=models[-16:])
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"ddp probe: {type(e).__name__}: {e}")


def _first_forward(ddp, _args, _kwargs):
    """Forward pre-hook, removed at its first call: install the recording hook unless the job
    registered a built-in one or the built-in path cannot be reproduced."""
    try:
        h = _HANDLES.pop(id(ddp), None)
        if h is not None:
            h.remove()
        tap = _tap_of(ddp)
        if not tap.installed and tap.reason is None and collectives._LOG is not None:
            _install(ddp)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"ddp probe: {type(e).__name__}: {e}")
    return None


_HANDLES: dict = {}  # id(DDP module) -> its first-forward pre-hook handle


def _patch_ddp():
    global _patched
    if _patched:
        return
    _patched = True
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    init, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook
    # under torch.compile the pre-hook runs eagerly (dynamo would trace it and skip the install);
    # wrapped at the first DDP's construction, which imports dynamo anyway: a job without DDP
    # does not pay dynamo's import (1.5-3 s of CPU per rank) for the probe
    disabled: list = []

    def first_forward():
        if not disabled:
            disabled.append(torch.compiler.disable(_first_forward))
        return disabled[0]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            if collectives._LOG is None:
                return
            tap = _tap_of(self)
            if not tap.installed and id(self) not in _HANDLES:
                _HANDLES[id(self)] = self.register_forward_pre_hook(first_forward(),
                                                                    with_kwargs=True)
                weakref.finalize(self, _HANDLES.pop, id(self), None)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"ddp probe: {type(e).__name__}: {e}")

    @functools.wraps(register)
    def register_comm_hook(self, state, hook):
        try:
            tap = _tap_of(self, create=collectives._LOG is not None)
        except Exception:  # noqa: BLE001
            tap = None
        if tap is None or (tap.installed and tap.target is not None):
            return register(self, state, hook)  # no log; or a second hook: DDP's own error
        # DDP's Python side exactly as register_comm_hook does it, then our hook calls theirs
        self._check_comm_hook(hook)
        if self.logger is None:
            raise AssertionError("self.logger must not be None")
        try:
            if tap.installed:
                tap.target = (hook, state)
                _note(self, tap)
            else:
                _install(self, target=(hook, state))
        except Exception as e:  # noqa: BLE001 - could not compose: the job's hook alone
            runtime.warn(f"ddp probe: {type(e).__name__}: {e}")
            if not tap.installed:
                return register(self, state, hook)
            tap.target = (hook, state)
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        return None

    @functools.wraps(builtin)
    def _register_builtin_comm_hook(self, comm_hook_type):
        try:
            tap = _tap_of(self, create=False)
            twin = None
            if tap is not None and not tap.installed:
                tap.reason = f"the job registered the built-in {comm_hook_type} hook"
                _note(self, tap)
            elif tap is not None and tap.target is None:
                twin = _builtin_twin(comm_hook_type)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"ddp probe: {type(e).__name__}: {e}")
            tap = twin = None
        if twin is None:  # DDP's own call: registers, or raises its "only once" error
            return builtin(self, comm_hook_type)
        # ours went in at the first forward and the job registers now: its Python twin
        runtime.warn(f"DDP built-in hook {comm_hook_type} registered after the first forward: "
                     "trainprof runs its Python equivalent")
        tap.target = (twin, self.process_group)
        _note(self, tap)
        self.logger._set_comm_hook_name(str(comm_hook_type))
        return None

    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook
    _patch_broadcast_coalesced()
    _patch_join()
    _patch_reducer()


def _builtin_twin(comm_hook_type):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook
            }.get(comm_hook_type)


def _patch_join():
    """Join's forward-pass all-reduce counts the ranks not yet joined: the Reducer's divisor
    under Join(divide_by_initial_world_size=False), which the built-in path's twin needs."""
    try:
        from torch.distributed.algorithms.join import Join
    except ImportError:
        return
    original = Join.__dict__["notify_join_context"]
    fn = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(fn)
    def notify_join_context(joinable):
        work = fn(joinable)
        try:
            tap = _tap_of(joinable, create=False) if work is not None else None
            if tap is not None:
                tap.join_work = work
        except Exception:  # noqa: BLE001
            pass
        return work

    Join.notify_join_context = staticmethod(notify_join_context)


def _patch_reducer():
    """Count Reducer._run_allreduce_hook calls (DDP's all-reduce run from C++ by a job's hook)."""
    import torch.distributed as dist

    R = getattr(dist, "Reducer", None)
    original = getattr(R, "_run_allreduce_hook", None)
    if original is None:
        return

    def _run_allreduce_hook(self, *args, **kwargs):
        _cpp_allreduce.n = getattr(_cpp_allreduce, "n", 0) + 1
        return original(self, *args, **kwargs)

    try:
        R._run_allreduce_hook = _run_allreduce_hook
    except Exception:  # noqa: BLE001 - a build whose Reducer type is closed: no inferred records
        pass


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
    session._step_listeners.insert(0, _on_step)  # before the collective log writes the step
