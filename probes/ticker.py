"""One thread for the probes' periodic work (stream flushes, heartbeats, hang-trigger polls).

Every wake-up of a Python thread inside a busy rank costs ~0.1 ms of CPU on a loaded host: the
thread must take the GIL from the job's thread, and both pay the hand-off. Three threads waking
5 times a second (flusher 2, heartbeat 1, watchdog 2) cost the 8-rank reference demo ~0.4 % of
its CPU. Here the tasks share one thread, and their periods are counted from one origin, so
tasks whose periods divide each other fire in the same wake-up (with the defaults, all 1 s:
one wake-up a second; 0.35 ms per rank and step on the demo, docs/overhead.md).

A task that raises is reported (three times at most) and keeps its schedule; a slow task delays the others
(they run late, never twice). Telemetry keeps its own thread: an NVML call can block for as
long as a GPU is falling off the bus, and it must not stall the heartbeat.
"""

from __future__ import annotations

import math
import threading
import time

from trainprof.probes import runtime

THREAD_NAME = "trainprof-tick"


class Ticker:
    def __init__(self, name: str = THREAD_NAME):
        self._tasks: list[list] = []  # [period_s, next_due (monotonic), fn, failures]
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a new task, a call to make soon, or stop
        self._soon: list = []  # one-shot calls for the ticker thread, made at its next wake-up
        self._stopped = False
        self._origin = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def every(self, period_s: float, fn) -> None:
        """Call ``fn()`` on the ticker thread every ``period_s`` seconds (first after one period),
        on the grid origin + k * period_s shared by all tasks."""
        period_s = max(0.01, float(period_s))
        with self._lock:
            now = time.monotonic()
            k = math.floor((now - self._origin) / period_s) + 1
            self._tasks.append([period_s, self._origin + k * period_s, fn, 0])
        self._wake.set()

    def call_soon(self, fn) -> None:
        """Call ``fn()`` once on the ticker thread as soon as it is free: the caller (the job's
        thread) never waits for it, whatever ``fn`` costs (a stalled network disk)."""
        with self._lock:
            if fn not in self._soon:
                self._soon.append(fn)
        self._wake.set()

    def _run_soon(self) -> None:
        with self._lock:
            calls, self._soon = self._soon, []
        for fn in calls:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                runtime.warn(f"{getattr(fn, '__qualname__', fn)} failed: {type(e).__name__}: {e}")

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stopped:
            self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        runtime.name_native_thread()
        while not self._stopped:
            with self._lock:
                due = min((t[1] for t in self._tasks), default=None)
            timeout = None if due is None else max(0.0, due - time.monotonic())
            if self._wake.wait(timeout):
                self._wake.clear()
                self._run_soon()
                continue  # re-read the schedule (a new task, or stop)
            self.run_due()

    def run_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [t for t in self._tasks if t[1] <= now + 1e-4]
        for task in due:
            if self._stopped:
                return
            period, _, fn, _ = task
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a probe's task must not end the others
                task[3] += 1
                if task[3] <= 3:
                    runtime.warn(f"periodic {getattr(fn, '__qualname__', fn)} failed: "
                                 f"{type(e).__name__}: {e}")
            # the next slot on the grid after now: a task that ran late is not run twice
            after = time.monotonic()
            task[1] = self._origin + (math.floor((after - self._origin) / period) + 1) * period
