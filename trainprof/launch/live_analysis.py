"""`wrap --analyze-every MIN`: summary.json and report.html refreshed while the job runs, so that
a job killed at its wall-time limit (SIGKILL to the whole allocation, wrap included) still
leaves a recent analysis.

A daemon thread of the launcher starts, every MIN minutes, one `trainprof analyze RUN --quiet`
in a child process at the lowest CPU priority (nice 19), with one digest worker, and waits for
it: one analysis at a time, never piling up (the next starts MIN minutes after the previous one
ended), never in the job's way (the job's processes are not touched, its output is not written
to: the child's output is kept in memory, its last error said when wrap ends). The analysis reads the run as a
snapshot and writes its outputs atomically (summary.json says run.state "running"). When the
job ends, the thread stops and a child still running is ended (SIGTERM to its process group),
before wrap's own final analysis.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

NICE = 19
# the child: `trainprof analyze RUN --quiet` at the lowest CPU priority (a program of its own:
# the launcher never imports the analysis)
CHILD = ("import os, sys\n"
         "try:\n    os.nice(%d)\nexcept OSError:\n    pass\n"
         "from trainprof.cli import main\n"
         "main(['analyze', sys.argv[1], '--quiet'], prog_name='trainprof')\n" % NICE)


class PeriodicAnalysis:
    def __init__(self, out: Path, every_s: float):
        self.out, self.every_s = Path(out), float(every_s)
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="trainprof-analyze-every", daemon=True)
        self.runs = 0
        self.failures = 0
        self.last_error = ""

    def start(self) -> "PeriodicAnalysis":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._once()
            except Exception:  # noqa: BLE001 - a refresh that fails is skipped, never the job's
                self.failures += 1

    def _once(self) -> None:
        if not (self.out / "ranks").is_dir():
            return  # no rank has written anything yet
        env = dict(os.environ, TRAINPROF_DIGEST_WORKERS="1")
        with self._lock:
            if self._stop.is_set():
                return
            # (the child lowers its own priority: no preexec_fn in a process with threads)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(self.out)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env=env, process_group=0)
        _, err = self._proc.communicate()
        self.runs += 1
        if self._proc.returncode not in (0, 3) and not self._stop.is_set():  # 3: nothing yet
            self.failures += 1
            self.last_error = (err or b"").decode(errors="replace").strip()[-500:]

    def summary(self) -> str:
        """One line on what the refreshes did (for wrap's closing lines)."""
        s = f"analyze-every: {self.runs} refresh{'es' if self.runs != 1 else ''} during the job"
        if self.failures:
            s += f", {self.failures} failed (last: {self.last_error.splitlines()[-1] if self.last_error else '?'})"
        return s

    def stop(self, timeout: float = 10.0) -> None:
        """Stop refreshing; end an analysis still running (its outputs are written atomically:
        the previous ones stay whole)."""
        self._stop.set()
        with self._lock:
            p = self._proc
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        self._thread.join(timeout)

