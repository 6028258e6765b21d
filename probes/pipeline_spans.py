"""Forward / backward / weight-grad spans per pipeline stage and micro-batch (pipeline.jsonl).

Every schedule of ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved, zero-bubble)
runs a stage's compute through three methods of ``_PipelineStageBase``:
``forward_one_chunk(fwd_chunk_id, ...)``, ``backward_one_chunk(bwd_chunk_id, loss=None,
full_backward=True, ...)`` and ``backward_weight_one_chunk(bwd_chunk_id, ...)``. Wrapping
them (on the base class, so every stage subclass and every schedule is covered) gives the
span of each F/B/W action with the p2p waits of the schedule outside it.

Record: ``{step, stage, microbatch, kind: "F"|"B"|"W", start_ns, end_ns}`` (time.time_ns).
``kind`` B is a full backward or, in zero-bubble schedules, the input-gradient half (then
``full: false``). Spans are buffered in memory and appended at each step boundary and at
close. meta.json gets ``pipeline: {stages, num_stages, virtual_stages, group_size, schedule,
micro_batches}``: the stage fields when a stage first runs, the schedule class name and its
micro-batch count when a schedule's ``step()`` (PipelineScheduleSingle/Multi) first runs.
"""

from __future__ import annotations

import os
import threading
import time

from trainprof.probes import post_import, runtime

STAGE_MODULE = "torch.distributed.pipelining.stage"
SCHEDULE_MODULE = "torch.distributed.pipelining.schedules"
STREAM = "pipeline"
MAX_BUFFER = 100_000  # spans held between flushes at most (a job that never steps)
MAX_PENDING_STEPS = 8  # steps whose CUDA events are not complete yet, at most
CLOSE_WAIT_S = 5.0     # at close, how long to wait for the GPU to pass the last events

_REC: "SpanRecorder | None" = None
_ON_CUDA: dict = {}  # torch.device -> a CUDA device? (hashing a device builds no string)
_fork_hooked = False
_patched: set = set()  # modules patched


class SpanRecorder:
    def __init__(self, session):
        self.session = session
        self.writer = session.stream(STREAM)
        self._buf: list[tuple] = []
        self._lock = threading.Lock()
        self._stages: dict[int, dict] = {}  # stage index -> what meta says about it
        self._schedule: dict = {}             # schedule class and micro-batches, once seen
        self._pending: list[list[tuple]] = []  # steps of spans with CUDA events not yet done
        self.closed = False
        self.errors = 0

    def add(self, stage, chunk, kind, t0, t1, full=True, events=None):
        idx = getattr(stage, "stage_index", None)
        if idx not in self._stages:
            self._note_stage(stage, idx)
        rec = (self.session.clock.step, idx, chunk, kind, t0, t1, full, events)
        with self._lock:
            if len(self._buf) < MAX_BUFFER:
                self._buf.append(rec)

    def _note_stage(self, stage, idx):
        self._stages[idx] = {"num_stages": getattr(stage, "num_stages", None),
                             "group_size": getattr(stage, "group_size", None)}
        self._write_meta()

    def note_schedule(self, schedule):
        info = {"schedule": type(schedule).__name__,
                "micro_batches": getattr(schedule, "_n_microbatches", None)}
        if info != self._schedule:
            self._schedule = info
            self._write_meta()

    def _write_meta(self):
        mine = sorted(i for i in self._stages if i is not None)
        first = next(iter(self._stages.values()), {})
        self.session.update_meta(pipeline={
            "stages": mine, "num_stages": first.get("num_stages"),
            "virtual_stages": len(mine), "group_size": first.get("group_size"), **self._schedule})

    def flush(self, _rec=None, wait=False):
        with self._lock:
            buf, self._buf = self._buf, []
        host = [x for x in buf if x[7] is None]
        timed = [x for x in buf if x[7] is not None]
        if host:  # serialized by the session's ticker thread, not the job's
            self.writer.write_records([self._record(x) for x in host])
        if timed:
            self._pending.append(timed)
        self._resolve(wait)

    def _resolve(self, wait):
        """Write the spans of steps whose CUDA events the GPU has passed (Event.query(): never a
        host-device sync in the hot path). At close ``wait`` polls for up to CLOSE_WAIT_S; a GPU
        that does not get there (hung, or far behind) leaves host times only."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._pending:
            spans = self._pending[0]
            try:
                done = spans[-1][7][1].query()  # one stream: the last end passed, all did
                while wait and not done and time.monotonic() < deadline:
                    time.sleep(0.005)
                    done = spans[-1][7][1].query()
            except Exception:  # noqa: BLE001 - a broken CUDA context: host times only
                done = None
            if done is False and not wait and len(self._pending) <= MAX_PENDING_STEPS:
                return
            self._pending.pop(0)
            if not done:  # the GPU is far behind, or the run ends without it
                self.writer.write_records([self._record(x) for x in spans])
                continue
            anchor = min(spans, key=lambda x: x[4])[7][0]  # the step's first span on this rank
            recs = []
            for x in spans:
                ev_start, ev_end = x[7]
                try:
                    dev = (anchor.elapsed_time(ev_start), ev_start.elapsed_time(ev_end))
                except Exception:  # noqa: BLE001 - e.g. an event never recorded
                    dev = None
                recs.append(self._record(x, dev))
            self.writer.write_records(recs)

    @staticmethod
    def _record(x, dev=None) -> dict:
        step, idx, chunk, kind, t0, t1, full, _ = x
        rec = {"step": step, "stage": idx, "microbatch": chunk, "kind": kind,
               "start_ns": t0, "end_ns": t1}
        if not full:
            rec["full"] = False
        if dev is not None:
            rec["device_start_ms"], rec["device_ms"] = dev
        return rec

    def close(self):
        if not self.closed:
            self.flush(wait=True)
            self.closed = True


def _active():
    rec = _REC
    if rec is None or rec.closed:  # a forked child has none (_forget_in_child)
        return None
    return rec


def _forget_in_child() -> None:
    global _REC
    _REC = None


def _chunk_id(args, kwargs, name):
    if args:
        return args[0]
    return kwargs.get(name)


def _start_events(stage):
    """(start, end, stream) CUDA timing events around a span on a GPU stage, start recorded
    on the stage's current stream; None on CPU. The host span of a GPU stage only covers the
    kernel launches: the device runs them later, so the bubble needs device times."""
    device = getattr(stage, "device", None)
    try:
        on_cuda = _ON_CUDA.get(device)
    except TypeError:  # not hashable: not a torch.device either
        return None
    if on_cuda is None:  # torch.device.type builds a new str per read: once per device
        on_cuda = _ON_CUDA[device] = getattr(device, "type", None) == "cuda"
    if not on_cuda:
        return None
    try:
        import torch

        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start, end, stream
    except Exception:  # noqa: BLE001 - host times only
        return None


def _wrap(cls, method, kind, chunk_kw):
    original = getattr(cls, method)

    def wrapper(self, *args, **kwargs):
        rec = _active()
        if rec is None:
            return original(self, *args, **kwargs)
        events = _start_events(self)
        t0 = time.time_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            t1 = time.time_ns()
            try:
                if events is not None:
                    events[1].record(events[2])
                full = kind != "B" or kwargs.get("full_backward", args[2] if len(args) > 2 else True)
                chunk = _chunk_id(args, kwargs, chunk_kw)
                rec.add(self, int(chunk) if chunk is not None else None, kind, t0, t1, bool(full),
                        events[:2] if events is not None else None)
            except Exception as e:  # noqa: BLE001 - never raise into the job
                rec.errors += 1
                if rec.errors <= 3:
                    runtime.warn(f"pipeline spans: {type(e).__name__}: {e}")

    wrapper.__name__ = method
    wrapper.__qualname__ = f"{cls.__name__}.{method}"
    wrapper.__doc__ = original.__doc__
    wrapper._trainprof_original = original
    setattr(cls, method, wrapper)


METHODS = (("forward_one_chunk", "F", "fwd_chunk_id"),
           ("backward_one_chunk", "B", "bwd_chunk_id"),
           ("backward_weight_one_chunk", "W", "bwd_chunk_id"))


def _wrap_schedule_step(cls):
    original = cls.step
    if hasattr(original, "_trainprof_original"):
        return

    def step(self, *args, **kwargs):
        rec = _active()
        if rec is not None and getattr(self, "_trainprof_seen", None) is not rec:
            try:  # once per schedule object: the schedule class and its micro-batch count
                self._trainprof_seen = rec
                rec.note_schedule(self)
            except Exception as e:  # noqa: BLE001 - never raise into the job
                runtime.warn(f"pipeline spans: {type(e).__name__}: {e}")
        return original(self, *args, **kwargs)

    step.__doc__ = original.__doc__
    step._trainprof_original = original
    cls.step = step


def _patch_module(module):
    name = module.__name__
    if name in _patched:
        return
    _patched.add(name)
    try:
        if name == STAGE_MODULE:
            cls = module._PipelineStageBase
            for method, kind, kw in METHODS:
                fn = getattr(cls, method, None)
                if fn is not None and not hasattr(fn, "_trainprof_original"):
                    _wrap(cls, method, kind, kw)
        elif name == SCHEDULE_MODULE:
            # every schedule's step() is one of these two (subclasses only override
            # _step_microbatches)
            for cls_name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
                cls = getattr(module, cls_name, None)
                if cls is not None and "step" in vars(cls):
                    _wrap_schedule_step(cls)
    except Exception as e:  # noqa: BLE001 - a torch whose pipelining looks different
        runtime.warn(f"pipeline spans disabled for {name}: {type(e).__name__}: {e}")


MODULES = (STAGE_MODULE, SCHEDULE_MODULE)


def _install_patches():
    """Patch the pipelining modules when the job imports them (never imported here: ~1-2 s,
    paid by every job that never uses it)."""
    for name in MODULES:
        if name not in _patched:
            post_import.when_imported(name, _patch_module)


def attach(session) -> None:
    global _REC, _fork_hooked
    rec = SpanRecorder(session)
    if not _fork_hooked:
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hooked = True
    _install_patches()
    _REC = rec
    session.on_step(rec.flush)
    session.on_close(rec.close)
