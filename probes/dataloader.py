"""Time each step waits for its input batches (data.jsonl).

Wraps ``torch.utils.data.dataloader._BaseDataLoaderIter.__next__``, the one method every
DataLoader iterator (single- and multi-process) serves batches through, and sums the wall time
spent inside it per step: with worker processes that is the time the main thread waited for a
batch that was not ready, without workers it is the whole load. Record, one per step once the
job has drawn its first batch: ``{step, wait_ms, batches}`` (written at each step boundary).
"""

from __future__ import annotations

import os
import time

from trainprof.probes import runtime

STREAM = "data"
_PROBE: "DataWait | None" = None
_patched = False


class DataWait:
    def __init__(self, session):
        self.session = session
        self.writer = session.stream(STREAM)
        self.step = None      # step the accumulators belong to
        self.wait_ns = 0
        self.batches = 0
        self.seen = False     # no record at all for jobs that never use a DataLoader
        self.closed = False

    def add(self, t0, t1, ok):
        step = self.session.clock.step
        if step != self.step:  # a step closed without a boundary flush (should not happen)
            self._write()
            self.step = step
        self.wait_ns += t1 - t0
        self.batches += 1 if ok else 0
        self.seen = True

    def _write(self, step=None):
        step = self.step if step is None else step
        if self.seen and step is not None:
            self.writer.write({"step": step, "wait_ms": self.wait_ns / 1e6, "batches": self.batches})
        self.wait_ns, self.batches = 0, 0

    def on_step(self, rec):
        step = rec.get("step")
        if self.step is not None and self.step != step:
            self._write()  # leftovers of an earlier step
        self._write(step)
        self.step = None

    def close(self):
        if not self.closed:
            if self.wait_ns or self.batches:
                self._write()
            self.closed = True


def _patch():
    global _patched
    if _patched:
        return
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    original = cls.__next__
    if hasattr(original, "_trainprof_original"):
        _patched = True
        return

    def __next__(self):
        probe = _PROBE
        if probe is None or probe.closed:  # a forked child has none (_forget_in_child)
            return original(self)
        t0 = time.time_ns()
        ok = False
        try:
            out = original(self)
            ok = True
            return out
        finally:
            try:
                probe.add(t0, time.time_ns(), ok)
            except Exception as e:  # noqa: BLE001 - never raise into the job
                runtime.warn(f"dataloader probe: {type(e).__name__}: {e}")

    __next__._trainprof_original = original
    __next__.__doc__ = original.__doc__
    cls.__next__ = __next__
    _patched = True


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker iterating a loader of its own) must not record
    into its parent's session: cleared once at fork instead of an os.getpid() per batch."""
    global _PROBE
    _PROBE = None


def attach(session) -> None:
    global _PROBE
    if not _patched:
        os.register_at_fork(after_in_child=_forget_in_child)
    _patch()
    _PROBE = DataWait(session)
    session.on_step(_PROBE.on_step)
    session.on_close(_PROBE.close)
