"""Per-rank step timings, from a global optimizer-step hook or explicit trainprof.step() markers.

A step is the interval between two boundaries; step 0 runs from probe activation (usually
init_process_group) to the first boundary and therefore includes set-up: analyzers treat it as
warm-up. Host timestamps are wall-clock ns (time.time_ns) so that ranks on different hosts can
be aligned later. On CUDA, a timing event is recorded at each boundary and resolved only once
the GPU has passed it (Event.query(), never synchronize), so the hot path has no host-device sync.
On Linux each record also carries the step's scheduler counters of the thread that closes the
steps (the training thread): what tells a rank starved of CPU by another process from a rank
with more work (the stragglers analyzer's host-contention evidence).
"""

from __future__ import annotations

import os
import sys
import threading
import time

try:
    import resource
except ImportError:  # not POSIX: ThreadSched stays off
    resource = None

from trainprof.rundir.files import JsonlWriter

SCHEDSTAT = "/proc/thread-self/schedstat"


class ThreadSched:
    """Per-step deltas of the calling thread's scheduler counters (Linux only; ~4 µs a step):
    ``cpu_ms`` on-CPU time and ``cpu_wait_ms`` time runnable but waiting for a CPU (fields 1 and
    2 of /proc/thread-self/schedstat, read with one pread on a descriptor kept open), ``nvcsw`` /
    ``nivcsw`` voluntary / involuntary context switches (getrusage RUSAGE_THREAD). Any failure
    turns it off for good; a step closed on another thread than the previous one gets no fields
    (the counters are per thread) and starts a new baseline."""

    def __init__(self):
        self.enabled = sys.platform.startswith("linux") and resource is not None
        self._fd: int | None = None
        self._owner: int | None = None
        self._last: tuple | None = None
        self.deltas()  # baseline at activation

    def _read(self) -> tuple:
        owner = threading.get_ident()
        if owner != self._owner:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._fd = os.open(SCHEDSTAT, os.O_RDONLY)  # non-inheritable (O_CLOEXEC)
            self._owner, self._last = owner, None
        run_ns, wait_ns = (int(x) for x in os.pread(self._fd, 128, 0).split()[:2])
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return run_ns, wait_ns, ru.ru_nvcsw, ru.ru_nivcsw

    def deltas(self) -> dict | None:
        if not self.enabled:
            return None
        try:
            last = self._last if self._owner == threading.get_ident() else None
            now = self._read()
        except Exception:  # noqa: BLE001 - no schedstat (kernel without it), no RUSAGE_THREAD
            self.enabled = False
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
            return None
        self._last = now
        if last is None:
            return None
        return {"cpu_ms": (now[0] - last[0]) / 1e6, "cpu_wait_ms": (now[1] - last[1]) / 1e6,
                "nvcsw": now[2] - last[2], "nivcsw": now[3] - last[3]}


class StepClock:
    def __init__(self, writer: JsonlWriter, device_writer: JsonlWriter | None = None):
        self.writer = writer
        self.device_writer = device_writer
        self.step = 0
        self.start_ns = time.time_ns()
        self.source: str | None = None  # "optimizer" or "marker", whichever is seen first wins
        self._leader: int | None = None  # id() of the optimizer whose steps count
        self._events: list = []          # (step, start_event, end_event) awaiting the GPU
        self._last_event = None
        self.overhead_ns = 0             # probe work booked into the current step (e.g. export)
        self.sched = ThreadSched()

    def on_optimizer_step(self, optimizer) -> bool:
        """True when this optimizer step closes a training step."""
        if self.source == "marker":
            return False
        if self._leader is None:
            self._leader = id(optimizer)
        if id(optimizer) != self._leader:  # a second optimizer in the same step
            return False
        self.source = "optimizer"
        return True

    def on_marker(self) -> bool:
        self.source = "marker"
        return True

    def close_step(self, extra: dict | None = None) -> dict:
        now = time.time_ns()
        rec = {"step": self.step, "start_ns": self.start_ns, "end_ns": now,
               "dur_ms": (now - self.start_ns) / 1e6, "source": self.source}
        if self.overhead_ns:
            rec["probe_overhead_ms"] = self.overhead_ns / 1e6
        sched = self.sched.deltas()
        if sched:
            rec.update(sched)
        if extra:
            rec.update(extra)
        self.writer.write(rec, urgent=True)  # one write per step: a killed job keeps every step
        self._record_device_event()
        self.step += 1
        self.start_ns = now
        self.overhead_ns = 0
        return rec

    # -- device time (CUDA only)
    def _record_device_event(self) -> None:
        try:
            import torch

            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            if self._last_event is not None:
                self._events.append((self.step, self._last_event, ev))
            self._last_event = ev
            self.resolve_device_events()
        except Exception:  # noqa: BLE001
            self._last_event = None

    def resolve_device_events(self, wait: bool = False) -> None:
        if self.device_writer is None:
            return
        pending = []
        for step, start, end in self._events:
            if wait:
                end.synchronize()  # only at shutdown, never in the hot path
            if end.query():
                self.device_writer.write({"step": step, "device_ms": start.elapsed_time(end)})
            else:
                pending.append((step, start, end))
        self._events = pending[-1000:]
