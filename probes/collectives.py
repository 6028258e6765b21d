"""Always-on log of every collective and point-to-point op (collectives.jsonl, groups.jsonl).

Hook points, chosen so that every API is caught once and user code keeps the function objects
it compares by identity (pipelining tests `p.op is dist.isend`):

* the ``ProcessGroup`` methods (allreduce, all_gather_single, reduce_scatter_single, send, ...):
  every ``torch.distributed.*`` API funnels into exactly one of them per wire operation, so they
  catch the c10d functions, FSDP2 (``dist.all_gather_single``/``reduce_scatter_single`` with
  ``async_op``), batch_isend_irecv and the pipelining schedules' p2p traffic, however the caller
  imported them;
* the ``torch.ops._c10d_functional.*`` op packets (replaced by delegating proxies on the op
  namespace): the functional collectives of DTensor / TP and the funcol API call them from
  Python, and their C++ kernels never touch the Python ProcessGroup methods;
* ``Work.wait`` and ``_c10d_functional.wait_tensor``: where the calling thread blocks.

Finished records are handed to the stream at each step boundary and at close, and serialized and
written by the session's ticker thread, not the job's; issued but
unfinished ops live in ``session.state["inflight_collectives"]`` so the heartbeat/watchdog see
them even if the process hangs before the next flush. Record fields: docs/collectives.md.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time

from trainprof import settings
from trainprof.probes import runtime
from trainprof.probes.rankinfo import MESH_ALIASES

try:  # the per-op hot path in C (setup.py builds it where a compiler is; optional)
    from trainprof.probes import _fastlog as _fast
except ImportError:  # pragma: no cover - exercised by the TRAINPROF_COLLECTIVES_PY tests
    _fast = None
ENV_PY = "TRAINPROF_COLLECTIVES_PY"  # =1: the pure-Python path even where the C one is built

_LOG: "CollectiveLog | None" = None
_patched = False
_tls = threading.local()  # .busy: inside a recorded call (nested calls are the same wire op)


# One flag per thread, shared by the C and the Python paths (bound to C's in _install_patches).
# partial() of the builtins: a call without a Python frame, which the job's thread would pay per op.
_busy = functools.partial(getattr, _tls, "busy", False)
_set_busy = functools.partial(setattr, _tls, "busy")

C10D_MODULE = "torch.distributed.distributed_c10d"
P2P = ("send", "recv")
MAX_PENDING_FLUSHES = 8  # device events not resolved after this many flushes: written without


# --------------------------------------------------------------------------- sizes


_DTYPES: dict = {}  # torch.dtype -> (itemsize, name): str(dtype) costs ~0.4 us per op


def _dtype_info(dt) -> tuple[int, str]:
    d = _DTYPES.get(dt)
    if d is None:
        d = _DTYPES[dt] = (dt.itemsize, str(dt).replace("torch.", ""))
    return d


def _nbytes(x) -> tuple[int, int, str | None]:
    """(bytes, numel, dtype) of a tensor or a (nested) list of tensors."""
    if x is None:
        return 0, 0, None
    if isinstance(x, (list, tuple)):
        if len(x) == 1:  # c10d passes [tensor]: the common case, no accumulation
            return _nbytes(x[0])
        b = n = 0
        dt = None
        for y in x:
            yb, yn, ydt = _nbytes(y)
            b, n, dt = b + yb, n + yn, dt or ydt
        return b, n, dt
    try:
        n = x.numel()
        size, name = _dtype_info(x.dtype)
        return n * size, n, name
    except Exception:  # noqa: BLE001 - not a tensor
        return 0, 0, None


def _size(x) -> tuple[int, int, str | None, bool]:
    """(bytes, numel, dtype, on CUDA) of a tensor, [tensor] or a (nested) list of tensors;
    the single tensor, the case of nearly every op, takes no list walk."""
    if type(x) is list and len(x) == 1:
        x = x[0]
    try:
        n = x.numel()
        dt = x.dtype
        d = _DTYPES.get(dt) or _dtype_info(dt)
        return n * d[0], n, d[1], x.is_cuda is True
    except Exception:  # noqa: BLE001 - a list of several tensors, or no tensor at all
        b, n, dt = _nbytes(x)
        t = _first_tensor(x)
        return b, n, dt, t is not None and getattr(t, "is_cuda", False) is True


def _first_tensor(x):
    while isinstance(x, (list, tuple)):
        if not x:
            return None
        x = x[0]
    return x


# ProcessGroup method -> (canonical op, index of the argument whose size is the nccl-tests
# "size" of the op: the output for all_gather/gather, the input for reduce_scatter/all_to_all/
# scatter, the buffer otherwise; see docs/collectives.md).
PG_METHODS: dict[str, tuple[str, int | None]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "reduce": ("reduce", 0),
    "broadcast": ("broadcast", 0),
    "allgather": ("all_gather", 0),
    "_allgather_base": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "reduce_scatter": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "alltoall_base": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "alltoall": ("all_to_all", 1),
    "gather": ("gather", 0),
    "scatter": ("scatter", 1),
    "barrier": ("barrier", None),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recv", 0),
}

# _c10d_functional op -> (canonical op, input arg index, "x n" for ops whose size is the output
# = input × group size, index of the group argument)
FUNCOL_OPS: dict[str, tuple[str, int, bool, int]] = {
    "all_reduce": ("all_reduce", 0, False, 2),
    "all_reduce_": ("all_reduce", 0, False, 2),
    "all_reduce_coalesced": ("all_reduce", 0, False, 2),
    "all_reduce_coalesced_": ("all_reduce", 0, False, 2),
    "all_gather_into_tensor": ("all_gather", 0, True, 2),
    "all_gather_into_tensor_out": ("all_gather", 0, True, 2),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, True, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False, 3),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0, False, 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False, 3),
    "all_to_all_single": ("all_to_all", 0, False, 3),
    "broadcast": ("broadcast", 0, False, 2),
    "broadcast_": ("broadcast", 0, False, 2),
    "isend": ("send", 0, False, 3),
    "irecv": ("recv", 0, False, 3),
}
FUNCOL_AUTOGRAD_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


# --------------------------------------------------------------------------- the log


class _Op:
    """Book-keeping of one issued op; ``rec`` is the public record (collectives.jsonl fields)."""

    __slots__ = ("rid", "rec", "work", "sync", "done", "ev_start", "ev_end", "flushes", "t_wait",
                 "code")

    def __init__(self, rid, rec, sync, code=None):
        self.rid, self.rec, self.sync = rid, rec, sync
        self.code = code  # the issuing c10d function: if it waits itself, async_op was False
        self.work = None
        self.done = False
        self.ev_start = self.ev_end = None
        self.flushes = 0
        self.t_wait = 0


class CollectiveLog:
    def __init__(self, session):
        self.session = session
        self.state, self.clock = session.state, session.clock  # read per op
        self.closed = False
        self.writer = session.stream("collectives")  # deferred: written by the ticker thread
        self.groups_writer = session.stream("groups")
        self._lock = threading.Lock()
        self._rid = itertools.count()
        self._seq: dict[str, int] = {}      # group name -> next sequence number
        self._groups: dict = {}             # id(pg) or name -> (name, ranks, backend)
        self._groups_written: set = set()
        self._groups_checked = 0  # len(_groups) when last written: new groups only, not per step
        self._ops: dict[int, _Op] = {}      # rid -> op, until written
        self._works: dict[int, tuple] = {}  # id(Work) -> (Work, [ops])
        self._funcol: dict[int, list] = {}  # storage data_ptr of a funcol output -> [ops]
        self._coalescing: dict[int, list] = {}  # id(pg) -> ops issued inside _start/_end_coalescing
        self.inflight: dict[int, dict] = {}
        self.dim_hints: dict[str, str] = {}  # pg name -> mesh dim known otherwise (DDP's group: dp)
        session.state["inflight_collectives"] = self.inflight
        session.state["last_collective"] = None
        self.errors = 0

    # -- groups
    def group(self, pg):
        key = id(pg)
        g = self._groups.get(key)
        if g is None:
            import torch.distributed as dist

            name = getattr(pg, "group_name", None) or dist.distributed_c10d._get_process_group_name(pg)
            try:
                ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
            except Exception:  # noqa: BLE001 - e.g. a group this rank is not part of
                ranks = []
            try:
                backend = str(dist.get_backend(pg))
            except Exception:  # noqa: BLE001
                backend = None
            g = self._groups[key] = (str(name), ranks, backend)
        return g

    def group_by_name(self, name):
        if not isinstance(name, str):  # funcol accepts a ProcessGroup too
            return self.group(name)
        g = self._groups.get(name)
        if g is None:
            from torch.distributed import distributed_c10d as c10d

            g = self._groups[name] = self.group(c10d._resolve_process_group(name))
        return g

    # -- issue / complete
    def issue(self, op, pg_info, nbytes, numel, dtype, peer, is_async, api, cuda, sync, code=None):
        # the job's thread runs this for every op (70+ a step on a 3D mesh): keep it flat
        # (where _fastlog is built, attach() replaces this method and complete() by its C twins)
        name = pg_info[0]
        seq = self._seq.get(name, 0)
        self._seq[name] = seq + 1
        rec = {"step": self.clock.step, "pg": name, "seq": seq, "op": op,
               "bytes": nbytes, "dtype": dtype, "numel": numel, "enqueue_ns": time.time_ns(),
               "end_ns": None, "blocked_ms": 0.0, "device_ms": None, "peer": peer,
               "async": is_async, "api": api}
        state = self.state
        if state.get("nan_replay"):  # a NaN replay's collective, not the job's
            rec["replay"] = True
        rid = next(self._rid)
        o = _Op(rid, rec, sync, code)
        if cuda:
            o.ev_start = _cuda_event()
        self._ops[rid] = o
        self.inflight[rid] = rec
        state["last_collective"] = rec
        return o

    def attach_work(self, ops, work, cuda):
        if work is None:  # the backend completed the op inside the call
            t = time.time_ns()
            for o in ops:
                if o.code is not None:  # a c10d function: the caller was blocked for all of it
                    o.sync, o.rec["async"] = True, False
                self.complete(o, t)
            return
        entry = self._works.get(id(work))
        if entry is not None and entry[0] is work:
            entry[1].extend(ops)
        else:
            self._works[id(work)] = (work, list(ops))
        for o in ops:
            o.work = work
        # Completion is observed at wait() (a future callback would be exact on gloo but
        # costs ~30 us per op in GIL hand-offs); works never waited are closed at the flush.

    def waited(self, work, t0, t1, waiter=None):
        """``waiter``: the code object that called wait(). c10d functions called with
        async_op=False wait on their Work themselves before returning; any other waiter means
        the caller held the Work (async). Cheaper than reading async_op from the c10d frame's
        locals at issue (~4 us per op: f_locals copies every local)."""
        entry = self._works.pop(id(work), None)
        if entry is None or entry[0] is not work:
            return
        for o in entry[1]:
            if o.code is not None and o.code is waiter:
                o.sync, o.rec["async"] = True, False
            o.t_wait += t1 - t0
            self.complete(o, t1)

    def complete(self, o, t_end):
        if o.done:
            return
        rec = o.rec
        if rec["end_ns"] is None or rec["end_ns"] > t_end:
            rec["end_ns"] = t_end
        # sync ops: the calling thread was blocked for the whole call; async: inside wait()
        rec["blocked_ms"] = ((t_end - rec["enqueue_ns"]) if o.sync else o.t_wait) / 1e6
        if o.ev_start is not None:
            o.ev_end = _cuda_event()
        o.done = True
        o.work = None  # the job's Work (and its tensors) goes when the job drops it
        self.inflight.pop(o.rid, None)

    # -- flushing
    def on_step(self, _rec=None):
        self.flush(final=False)

    def flush(self, final=False):
        lines = []
        with self._lock:
            for rid, o in list(self._ops.items()):
                if not o.done:
                    work = o.work
                    finished = o.rec["end_ns"] is not None
                    if not finished and work is not None:
                        try:
                            finished = work.is_completed()
                        except Exception:  # noqa: BLE001
                            finished = False
                    if not (finished or final):
                        continue  # really in flight: stays visible to the heartbeat
                    o.done = True
                    self.inflight.pop(rid, None)
                    if work is not None:
                        self._works.pop(id(work), None)
                if o.ev_end is not None and o.rec["device_ms"] is None:
                    try:
                        if final:
                            o.ev_end.synchronize()  # at shutdown only, never in the hot path
                        if o.ev_end.query():
                            o.rec["device_ms"] = o.ev_start.elapsed_time(o.ev_end)
                        elif o.flushes < MAX_PENDING_FLUSHES:
                            o.flushes += 1
                            continue  # the GPU has not got there yet: next flush
                    except Exception:  # noqa: BLE001
                        pass
                del self._ops[rid]
                lines.append(o.rec)  # done: nothing changes it any more
            # funcol outputs freed without a wait leave stale keys: drop those of written ops
            # (in place: _fastlog holds this dict, a new one would leave it writing the old)
            if self._funcol and len(self._funcol) > 4096:
                stale = [k for k, v in self._funcol.items()
                         if not any(o.rid in self._ops for o in v)]
                for k in stale:
                    del self._funcol[k]
        if len(self._groups) != self._groups_checked:
            self._write_groups()
        if lines:  # serialized by the ticker thread, not the job's
            self.writer.write_records(lines)

    def _write_groups(self):
        groups = list(self._groups.items())
        self._groups_checked = len(groups)
        for key, (name, ranks, backend) in groups:
            if (name, tuple(ranks)) in self._groups_written or not isinstance(key, int):
                continue
            self._groups_written.add((name, tuple(ranks)))
            dim = mesh_dim(self.session.meta.get("mesh"), ranks, self.session.rank)
            self.groups_writer.write({"pg": name, "ranks": ranks,
                                      "mesh_dim": dim or self.dim_hints.get(name),
                                      "backend": backend, "size": len(ranks)})

    def close(self):
        if self.closed:
            return
        try:
            self.flush(final=True)
        finally:
            self.closed = True
            if _C_ON:
                _fast.close(self)  # the C paths test this, not .closed
            self.writer.flush()


def mesh_dim(mesh: dict | None, ranks: list[int], my_rank: int) -> str | None:
    """The mesh dimension a group spans: the group's ranks are exactly those that share this
    rank's coordinates on every other dim. Assumes the row-major rank layout of
    init_device_mesh; dims that mean the same axis (dp_replicate × dp_shard) are merged."""
    if not mesh or not mesh.get("shape") or not ranks:
        return None

    names, shape = list(mesh["dim_names"]), [int(s) for s in mesh["shape"]]
    total = 1
    for s in shape:
        total *= s
    if my_rank >= total:
        return None
    coord, rest = [], my_rank
    for s in reversed(shape):
        coord.append(rest % s)
        rest //= s
    coord.reverse()
    target = sorted(ranks)
    candidates = [(n, [n]) for n in names]
    for canon, aliases in MESH_ALIASES.items():
        dims = [n for n in names if n.lower() in aliases]
        if len(dims) > 1:
            candidates.insert(0, (canon, dims))
    # non-trivial dims first, so that a size-1 group is not mistaken for another size-1 dim
    for label, dims in sorted(candidates, key=lambda c: _span(shape, names, c[1]) != len(target)):
        idx = [names.index(d) for d in dims]
        group = []
        for r in range(total):
            c, rr = [], r
            for s in reversed(shape):
                c.append(rr % s)
                rr //= s
            c.reverse()
            if all(c[i] == coord[i] for i in range(len(shape)) if i not in idx):
                group.append(r)
        if group == target:
            low = label.lower()
            for canon, aliases in MESH_ALIASES.items():
                if low in aliases or low == canon:
                    return canon
            return label
    return None


def _span(shape, names, dims):
    n = 1
    for d in dims:
        n *= shape[names.index(d)]
    return n


def _cuda_event():
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _active():
    log = _LOG
    if log is None or log.closed or _busy():
        return None
    return log


# --------------------------------------------------------------------------- patches


def _wrap_pg_method(cls, method, op, size_arg):
    original = getattr(cls, method)

    def wrapper(self, *args, **kwargs):
        log = _LOG  # _active() inlined: every call of the job pays this line
        if log is None or log.closed or _busy():
            return original(self, *args, **kwargs)
        try:
            ops, cuda = _pg_issue(log, self, method, op, size_arg, args)
        except Exception as e:  # noqa: BLE001
            _note_error(log, e)
            return original(self, *args, **kwargs)
        _set_busy(True)
        try:
            work = original(self, *args, **kwargs)
        finally:
            _set_busy(False)
        try:
            co = log._coalescing.get(id(self))
            if co is not None:  # the work of the batch comes from _end_coalescing
                co.extend(ops)
            else:
                log.attach_work(ops, work, cuda)
        except Exception as e:  # noqa: BLE001
            _note_error(log, e)
        return work

    wrapper.__name__ = method
    wrapper.__qualname__ = f"{cls.__name__}.{method}"
    wrapper.__doc__ = original.__doc__
    wrapper._trainprof_original = original
    if _C_ON:  # the C method takes the common case and hands every other to this wrapper
        # gather/scatter size the whole buffer and barrier has none: always the wrapper's
        size = size_arg if size_arg is not None and op not in ("gather", "scatter") else -1
        p2p = (2 if method == "recv_anysource" else 1) if op in P2P else 0
        fast = _fast.Method(original, wrapper, op, _SITES.setdefault(method, {}), size, p2p, False)
        fast.__name__, fast.__qualname__, fast.__doc__ = method, wrapper.__qualname__, original.__doc__
        wrapper = fast
    setattr(cls, method, wrapper)


# ProcessGroup method -> {caller's code object: (api, the code if it waits itself when sync)}
_SITES: dict[str, dict] = {}


def _site(caller, method) -> tuple:
    code = caller.f_code
    sites = _SITES.get(method)
    if sites is None:
        sites = _SITES[method] = {}
    site = sites.get(code)
    if site is None:
        c10d = caller.f_globals.get("__name__") == C10D_MODULE
        fname = code.co_name
        api = f"c10d.{fname}" if c10d else f"ProcessGroup.{method}"
        # a raw ProcessGroup call hands its Work to the caller (async); c10d isend/irecv (and
        # send/recv, which call them) are async at this level; other c10d functions wait on the
        # Work themselves when async_op=False, which CollectiveLog.waited recognizes
        site = sites[code] = (api, code if c10d and fname not in ("isend", "irecv") else None)
    return site


def _pg_issue(log, pg, method, op, size_arg, args):
    info = log.group(pg)
    api, code = _site(sys._getframe(2), method)
    nbytes = numel = 0
    dtype = None
    cuda = False
    if size_arg is not None and len(args) > size_arg:
        nbytes, numel, dtype, cuda = _size(args[size_arg])
        if op in ("gather", "scatter"):  # size = the whole gathered / scattered buffer
            n = len(info[1]) or 1
            src = args[1] if op == "gather" else args[0]
            b1, n1, dt1 = _nbytes(src)
            nbytes, numel, dtype = b1 * n, n1 * n, dt1
    peer = None
    if op in P2P and method != "recv_anysource" and len(args) > 1:
        try:
            peer = info[1][int(args[1])] if info[1] else int(args[1])
        except Exception:  # noqa: BLE001
            peer = None
    # async until the issuing c10d function is seen waiting (waited) or the op completes inside
    # the call (attach_work with no Work): then sync, blocked for the whole call
    o = log.issue(op, info, nbytes, numel, dtype, peer, True, api, cuda, sync=False, code=code)
    return [o], cuda


def _patch_coalescing(cls):
    start, end = cls._start_coalescing, cls._end_coalescing

    def _start_coalescing(self, *args, **kwargs):
        log = _active()
        if log is not None:
            log._coalescing[id(self)] = []
        return start(self, *args, **kwargs)

    def _end_coalescing(self, *args, **kwargs):
        log = _LOG
        ops = log._coalescing.pop(id(self), None) if log is not None else None
        work = end(self, *args, **kwargs)
        if ops:
            try:
                log.attach_work(ops, work, cuda=ops[0].ev_start is not None)
            except Exception as e:  # noqa: BLE001
                _note_error(log, e)
        return work

    _start_coalescing._trainprof_original = start
    _end_coalescing._trainprof_original = end
    cls._start_coalescing = _start_coalescing
    cls._end_coalescing = _end_coalescing


def _patch_work(cls):
    original = cls.wait

    def wait(self, *args, **kwargs):
        log = _LOG
        if log is None or not log._works or id(self) not in log._works:
            return original(self, *args, **kwargs)
        t0 = time.time_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            try:
                log.waited(self, t0, time.time_ns(), sys._getframe(1).f_code)
            except Exception as e:  # noqa: BLE001
                _note_error(log, e)

    wait.__doc__ = original.__doc__
    wait._trainprof_original = original
    if _C_ON:  # the same in C: no Python frame per wait
        wait = _fast.Method(original, None, "wait", {}, -1, 0, True)
        wait.__name__, wait.__qualname__, wait.__doc__ = "wait", f"{cls.__name__}.wait", original.__doc__
    cls.wait = wait


class _FuncolProxy:
    """Stands in for a torch.ops._c10d_functional op packet: records the call, and delegates
    every attribute (``.default`` and friends) to the real packet so identities are kept."""

    __slots__ = ("_packet", "_op", "_arg", "_times_n", "_group_arg", "_api")

    def __init__(self, packet, op, arg, times_n, group_arg, api):
        self._packet, self._op, self._arg = packet, op, arg
        self._times_n, self._group_arg, self._api = times_n, group_arg, api

    def __getattr__(self, item):
        return getattr(self._packet, item)

    def __repr__(self):
        return repr(self._packet)

    def __call__(self, *args, **kwargs):
        # Tensor parallel issues ~50 of these a step per rank on a small model, and inside a job
        # every Python call here costs several times its isolated price (cold caches): the
        # common case (one tensor in, one out, a group name) is inlined into this one frame.
        log = _LOG
        if log is None or log.closed or _busy() or _is_compiling():
            return self._packet(*args, **kwargs)
        o = None
        try:
            ga = self._group_arg
            group = args[ga] if len(args) > ga else kwargs.get("group_name")
            info = log._groups.get(group) or log.group_by_name(group)
            src = args[self._arg] if args else kwargs.get("input")
            if type(src) is _Tensor:
                numel = src.numel()
                d = _DTYPES.get(src.dtype) or _dtype_info(src.dtype)
                nbytes, dtype, cuda = numel * d[0], d[1], src.is_cuda
            else:
                nbytes, numel, dtype, cuda = _size(src)
            if self._times_n:
                n = len(info[1]) or 1
                nbytes, numel = nbytes * n, numel * n
            peer = int(args[1]) if self._op in P2P and len(args) > 1 else None  # global ranks
            o = log.issue(self._op, info, nbytes, numel, dtype, peer, True, self._api, cuda, False)
        except Exception as e:  # noqa: BLE001
            _note_error(log, e)
        _set_busy(True)
        try:
            out = self._packet(*args, **kwargs)
        finally:
            _set_busy(False)
        if o is not None:
            try:
                f = log._funcol
                if type(out) is _Tensor:
                    key = out.untyped_storage().data_ptr()
                    prev = f.get(key)
                    if prev is None:
                        f[key] = [o]
                    else:  # a reused storage whose op was not waited
                        prev.append(o)
                else:
                    self._key_outputs(out, o)
            except Exception as e:  # noqa: BLE001
                _note_error(log, e)
        return out

    def _key_outputs(self, out, o):
        """Key a list (coalesced op) or subclass output by storage, for the wait to find."""
        f = _LOG._funcol
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            key = _storage_key(t)
            prev = f.get(key)
            if prev is None:
                f[key] = [o]
            else:  # a coalesced op's outputs in one storage
                prev.append(o)


def _wait_tensor_proxy(packet):
    class _Wait(_FuncolProxy):
        __slots__ = ()

        def __call__(self, *args, **kwargs):
            log = _LOG
            if log is None or not log._funcol or _busy() or _is_compiling():
                return self._packet(*args, **kwargs)
            try:
                t = args[0]
                if type(t) is not _Tensor:  # an AsyncCollectiveTensor: its elem holds the storage
                    t = getattr(t, "elem", t)
                ops = log._funcol.pop(t.untyped_storage().data_ptr(), None)
            except Exception:  # noqa: BLE001
                ops = None
            if not ops:
                return self._packet(*args, **kwargs)
            t0 = time.time_ns()
            # waiting on an AsyncCollectiveTensor dispatches to wait_tensor(elem) again: that
            # inner call is this same wait, no second lookup
            _set_busy(True)
            try:
                return self._packet(*args, **kwargs)
            finally:
                _set_busy(False)
                t1 = time.time_ns()
                for o in ops:
                    o.t_wait += t1 - t0
                    log.complete(o, t1)

    return _Wait(packet, "wait", 0, False, 0, "funcol.wait_tensor")


def _storage_key(t) -> int:
    # ACT views of an output (aten.view on AsyncCollectiveTensor) share its storage. A wrapper
    # subclass has no storage of its own: asking raises, and a C++ error costs ~40 us per op
    if type(t).__name__ != "Tensor":
        t = getattr(t, "elem", t)
    return t.untyped_storage().data_ptr()


def _not_compiling() -> bool:
    return False


_is_compiling = _not_compiling  # torch.compiler.is_compiling once torch is patched
_Tensor = None  # torch.Tensor: `type(x) is _Tensor` is the hot path's cheapest test


def _patch_funcol():
    global _is_compiling, _Tensor
    import torch

    _Tensor = torch.Tensor
    # dynamo traces these proxies inside compiled code and reads is_compiling() as True there
    _is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _not_compiling)

    for ns_name, names, api in (("_c10d_functional", FUNCOL_OPS, "funcol"),
                                ("_c10d_functional_autograd", FUNCOL_AUTOGRAD_OPS, "funcol_autograd")):
        try:
            ns = getattr(torch.ops, ns_name)
        except Exception:  # noqa: BLE001
            continue
        for name in names:
            op, arg, times_n, group_arg = FUNCOL_OPS[name]
            try:
                packet = getattr(ns, name)
            except Exception:  # noqa: BLE001 - op not in this torch build
                continue
            if _is_proxy(packet):
                continue
            py = _FuncolProxy(packet, op, arg, times_n, group_arg, f"{api}.{name}")
            setattr(ns, name, _c_proxy(py, packet, op, arg, times_n, group_arg, False) or py)
    ns = torch.ops._c10d_functional
    try:
        wt = ns.wait_tensor
        if not _is_proxy(wt):
            py = _wait_tensor_proxy(wt)
            ns.wait_tensor = _c_proxy(py, wt, "wait", 0, False, 0, True) or py
    except Exception:  # noqa: BLE001
        pass
    # funcol.wait_tensor / ACT.trigger_wait look the packet up on the namespace at call time


def _is_proxy(x) -> bool:
    return isinstance(x, _FuncolProxy) or (_fast is not None and isinstance(x, _fast.Proxy))


def _c_proxy(py, packet, op, arg, times_n, group_arg, wait):
    """The C proxy in front of the Python one (which takes every uncommon case), or None."""
    if not _C_ON or op in P2P:  # p2p (peers, tags): the Python proxy
        return None
    # calling an OpOverloadPacket runs its Python __call__, which calls the C++ _op unless the
    # op has torchbind overloads: the proxy calls _op itself (one Python frame less per call)
    call = packet
    if not getattr(packet, "_has_torchbind_op_overload", True) and callable(getattr(packet, "_op", None)):
        call = packet._op
    return _fast.Proxy(packet, call, py, op, py._api, arg, group_arg, times_n, wait)


_C_ON = False  # decided once, when the patches go in: the C path or the pure-Python one


def _install_patches():
    global _patched, _busy, _set_busy, _C_ON
    if _patched:
        return
    _patched = True
    _C_ON = _fast is not None and not settings.value(ENV_PY)
    if _C_ON:
        _busy, _set_busy = _fast.busy, _fast.set_busy
    from torch._C._distributed_c10d import ProcessGroup, Work

    for method, (op, size_arg) in PG_METHODS.items():
        if hasattr(ProcessGroup, method):
            _wrap_pg_method(ProcessGroup, method, op, size_arg)
    if hasattr(ProcessGroup, "_start_coalescing") and hasattr(ProcessGroup, "_end_coalescing"):
        _patch_coalescing(ProcessGroup)
    _patch_work(Work)
    _patch_funcol()


def _note_error(log, e):
    log.errors += 1
    if log.errors <= 3:
        runtime.warn(f"collective log: {type(e).__name__}: {e}")


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not log into its parent's session; checked
    here once instead of an os.getpid() per op."""
    global _LOG
    _LOG = None
    if _fast is not None:
        _fast.configure(None, None, None, None, None)


def attach(session) -> None:
    global _LOG
    import torch.distributed as dist

    if not dist.is_available():
        return
    log = CollectiveLog(session)
    if not _patched:
        os.register_at_fork(after_in_child=_forget_in_child)
    _install_patches()
    if _C_ON:
        import torch

        _fast.configure(log, _DTYPES, torch.Tensor, _is_compiling, _cuda_event)
        log.issue, log.complete = _fast.issue, _fast.complete  # the C twins, same fields
    _LOG = log
    session.on_step(log.on_step)
    session.on_close(log.close)
