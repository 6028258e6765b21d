"""Per-rank step timings, from a global optimizer-step hook or explicit trainprof.step() markers.

A step is the interval between two boundaries; step 0 runs from probe activation (usually
init_process_group) to the first boundary and therefore includes set-up: analyzers treat it as
warm-up. Host timestamps are wall-clock ns (time.time_ns) so that ranks on different hosts can
be aligned later. On CUDA, a timing event is recorded at each boundary and resolved only once
the GPU has passed it (Event.query(), never synchronize), so the hot path has no host-device sync.
"""

from __future__ import annotations

import time

from trainprof.rundir import JsonlWriter


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
