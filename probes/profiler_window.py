"""A scheduled torch.profiler window over a few training steps.

Steps are counted by the probes' own StepClock, so the window is "steps A..B of the job"
whatever the training loop looks like. The trace is exported as gzip Chrome-trace JSON with
distributedInfo into RUN/profiler/rank-NNNNN.pt.trace.json.gz, which HTA loads as a trace set.
The export runs on a thread of ours, off the job's step (docs/overhead.md); its span of time is
reported to the session (meta.json ``overhead_spans``, kind ``trace_export``), so that the
analysis leaves the steps it overlapped out of step statistics.
"""

from __future__ import annotations

import threading
import time

from trainprof import settings
from trainprof.probes import job_profiler, runtime
from trainprof.probes.profiler_quiet import Primer, quiet

ENV_EXPORT = "TRAINPROF_TRACE_EXPORT"  # "inline": write the trace in the job's step
EXPORT_WAIT_S = 300.0  # at the session's close, how long a pending trace export may still take
_PENDING: list = []    # export threads not yet joined


def wait_exports(timeout: float = EXPORT_WAIT_S) -> None:
    """Let pending trace exports finish (the session's close, before the process exits)."""
    deadline = time.monotonic() + timeout
    while _PENDING:
        t = _PENDING.pop()
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            runtime.warn(f"profiler trace export still running after {timeout:.0f} s: "
                         "the trace may be missing")


def parse_steps(spec: str | None) -> tuple[int, int] | None:
    """"3-4" -> (3, 4) inclusive; "5" -> (5, 5); "none"/"" -> None."""
    if spec is None:
        return None
    spec = spec.strip().lower()
    if spec in ("", "none", "off", "0-0x"):
        return None
    a, _, b = spec.partition("-")
    first, last = int(a), int(b or a)
    if first < 0 or last < first:
        raise ValueError(f"profile steps {spec!r}: expected FIRST-LAST with 0 <= FIRST <= LAST")
    return first, last


class ProfilerWindow:
    """Created by the session just before the window (one warm-up step ahead), so nothing of
    the profiler runs, and CUDA is not touched, before the job has set its device.

    Every torch call runs inside job_profiler.ours() (the job-profiler guard lets it through).
    After a failure the window is ``done`` and never touched again: a profiler in an unknown
    state is left alone rather than stopped, since stopping could end the job's session."""

    def __init__(self, trace_path, warmup: int, active: int, cuda: bool, on_span=None):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.trace_path = trace_path
        self.on_span = on_span   # on_span(kind, start_ns, end_ns | None): the export's span
        self.exported = False
        self.done = False        # exported, discarded or failed: the session drops the window
        self._discard = False
        self.export_ms = 0.0
        activities = [ProfilerActivity.CPU]
        if cuda:
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._export,
            record_shapes=True,      # shapes and dtypes feed the FLOP/roofline analysis
            profile_memory=True,     # allocation events: the CPU memory timeline
            with_stack=False,
        )
        self._primer = Primer()  # allocated before the window: freed when recording starts
        with job_profiler.ours(), quiet():  # torch's own lines stay out of the job's fd 2
            self._prof.start()

    def _export(self, prof) -> None:
        """on_trace_ready, on the job's thread inside its step: the results are collected by
        now; writing and gzipping them (0.6-2.4 s on CPU for a few steps) runs on a thread of
        ours while the job goes on (joined at the session's close, wait_exports)."""
        if self._discard:
            return  # stepping aside for the job's profiler: no partial trace
        self.exported = True  # the window is over; the file follows
        if settings.value(ENV_EXPORT) == "inline":  # on the job's thread, as torch does
            self._write(prof)
            return
        try:
            t = threading.Thread(target=self._write, args=(prof,), name="trainprof-trace-export",
                                 daemon=True)
            t.start()
            _PENDING.append(t)
        except Exception:  # noqa: BLE001 - no thread to be had: write it here
            self._write(prof)

    def _write(self, prof) -> None:
        t0 = time.perf_counter()
        start_ns = time.time_ns()
        self._span(start_ns, None)  # open: a process killed mid-export leaves its start
        try:
            self.trace_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.trace_path.with_name(self.trace_path.name.replace(".json.gz", ".tmp.json.gz"))
            with job_profiler.ours():  # per thread: this one's export is ours too
                prof.export_chrome_trace(str(tmp))
            tmp.replace(self.trace_path)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"profiler trace export failed: {e}")
        self.export_ms = (time.perf_counter() - t0) * 1e3
        self._span(start_ns, time.time_ns())

    def _span(self, start_ns: int, end_ns: int | None) -> None:
        if self.on_span is None:
            return
        try:
            self.on_span("trace_export", start_ns, end_ns)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"profiler trace export span not recorded: {type(e).__name__}: {e}")

    def step(self) -> None:
        if self.done:
            return
        try:
            with job_profiler.ours(), quiet():
                self._prof.step()
                if self._primer is not None and _recording(self._prof):
                    self._primer.fire()  # the allocator's one warning, printed here
                    self._primer = None
        except Exception as e:  # noqa: BLE001
            self.done = True
            runtime.warn(f"profiler window abandoned: {type(e).__name__}: {e}")
            return
        if self.exported:
            self.stop()

    def stop(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            with job_profiler.ours(), quiet():
                self._prof.stop()
        except Exception:  # noqa: BLE001
            pass

    def discard(self) -> None:
        """Stop without exporting (the job is starting its own profiler)."""
        self._discard = True
        self.stop()


def _recording(prof) -> bool:
    """The profiler records now (memory events included): past its warm-up."""
    try:
        return "RECORD" in str(prof.current_action)
    except Exception:  # noqa: BLE001
        return False
