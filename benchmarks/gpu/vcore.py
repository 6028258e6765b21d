"""The validation suite's plumbing: a check, its verdict, and jobs run under a time limit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

DRY_SLOWER = 3  # --dry-run: a shared CPU runs the jobs slower than the GPU machine's limits assume


@dataclass
class Check:
    name: str
    fn: Callable            # fn(ctx, verdict, results) fills the verdict
    timeout_s: float        # the check's own limit (its jobs are killed past it)
    what: str               # one line for the table's detail and the docs
    after: tuple = ()       # checks whose output it reads (they run first)
    exclusive: bool = False  # runs alone (timing)


@dataclass
class Result:
    name: str
    ok: bool | None         # None: skipped
    number: str
    detail: str
    seconds: float = 0.0
    criteria: list = field(default_factory=list)
    data: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "skip" if self.ok is None else ("PASS" if self.ok else "FAIL")

    def line(self) -> str:
        return f"  {self.verdict}  {self.name}: {self.number}  ({self.seconds:.0f} s) {self.detail}"

    def to_dict(self) -> dict:
        return {"check": self.name, "verdict": self.verdict, "number": self.number,
                "detail": self.detail, "seconds": round(self.seconds, 1),
                "criteria": [{"criterion": c, "ok": o} for c, o in self.criteria], "data": self.data}


class Verdict:
    """The criteria of one check: each one recorded with whether it held."""

    def __init__(self):
        self.criteria: list[tuple[str, bool]] = []
        self.number = ""
        self.notes: list[str] = []
        self.data: dict = {}

    def need(self, label: str, ok) -> bool:
        self.criteria.append((label, bool(ok)))
        return bool(ok)

    @property
    def ok(self) -> bool:
        return bool(self.criteria) and all(o for _, o in self.criteria)

    def failed(self) -> list[str]:
        return [c for c, o in self.criteria if not o]


class CheckTimeout(Exception):
    pass


@dataclass
class Job:
    rc: int | None
    log: Path
    seconds: float

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ctx:
    """What the checks share: CUDA or dry run, the work folder, time limits, job launching."""

    def __init__(self, cuda: bool, work: Path, root: Path, hta_python: str, t_end: float):
        self.cuda, self.work, self.root = cuda, work, root
        self.hta_python, self.t_end = hta_python, t_end
        self.py = sys.executable
        self._deadline = threading.local()

    # ----------------------------------------------------------------- check runner
    def run_check(self, check: Check, results: dict, until: float | None = None) -> Result:
        """Run one check within its own limit and before `until` (monotonic; default the
        suite's end)."""
        v, t0 = Verdict(), time.monotonic()
        limit = check.timeout_s * (1 if self.cuda else DRY_SLOWER)
        self._deadline.t = min(t0 + limit, until or self.t_end)
        self._deadline.name = check.name
        err = None
        try:
            missing = [d for d in check.after if d not in results]
            if missing:
                v.notes.append(f"(ran without {', '.join(missing)})")
            check.fn(self, v, results)
        except CheckTimeout as e:
            err = f"timed out ({e})"
        except Exception as e:  # noqa: BLE001 - the check fails, the suite goes on
            err = f"{type(e).__name__}: {e}"
            (self.work / f"{check.name}.error.log").write_text(traceback.format_exc())
        if err:
            v.need(err, False)
        failed = v.failed()
        detail = ("; ".join(failed) if failed else check.what) + (" " + " ".join(v.notes) if v.notes else "")
        return Result(name=check.name, ok=v.ok, number=v.number or "-", detail=detail,
                      seconds=time.monotonic() - t0, criteria=v.criteria, data=v.data)

    def left(self) -> float:
        return self._deadline.t - time.monotonic()

    # ----------------------------------------------------------------- jobs
    def env(self, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROF_")}
        env.update(PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        # checks run side by side: a share of the cores each, not all of them (as torchrun does)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 4) // 4)))
        if not self.cuda:
            # no CUDA; the one-off peak calibration only where a check reads it (mfu)
            env.update(CUDA_VISIBLE_DEVICES="", TRAINPROF_CALIBRATION="0")
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def run(self, name: str, cmd: list, env: dict | None = None, timeout: float | None = None,
            cwd: Path | None = None) -> Job:
        """Run cmd (its own process group) with output to WORK/name.log; past the check's time
        (or timeout) the whole group is killed and CheckTimeout raised."""
        log = self.work / f"{name}.log"
        limit = min(timeout or 1e9, self.left())
        if limit <= 1:
            raise CheckTimeout(f"no time left for {name}")
        t0 = time.monotonic()
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(map(str, cmd)) + "\n")
            fh.flush()
            p = subprocess.Popen([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT,
                                 env=self.env(env), cwd=cwd or self.work, start_new_session=True)
            try:
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_group(p)
                why = "the check's limit" if limit < (timeout or 1e9) else "its timeout"
                raise CheckTimeout(f"{name} killed at {why}, after {limit:.0f} s") from None
        return Job(rc=rc, log=log, seconds=time.monotonic() - t0)

    def trainprof(self, *args) -> list:
        return [self.py, "-m", "trainprof", *map(str, args)]

    def torchrun(self, n: int) -> list:
        return [self.py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]

    def wrap(self, name: str, job_cmd: list, env: dict | None = None, profile: str = "none",
             timeout: float | None = None, report: bool = False,
             analyze: bool = True) -> tuple[Job, Path, dict | None]:
        """`trainprof wrap --no-analyze` around job_cmd, then `trainprof analyze`: (wrap's job,
        the run directory, summary.json or None)."""
        run = self.work / name
        job = self.run(name, self.trainprof("wrap", "--out", run, "--no-analyze", "--profile-steps",
                                            profile, "--", *job_cmd), env=env, timeout=timeout)
        if not analyze:
            return job, run, None
        an = self.run(f"{name}.analyze", self.trainprof("analyze", run, "--quiet",
                                                         *([] if report else ["--no-report"])))
        summary = None
        if an.rc == 0 and (run / "summary.json").is_file():
            summary = json.loads((run / "summary.json").read_text())
        return job, run, summary

    def launch1(self) -> list:
        """One rank of the reference: torchrun on CUDA (as users run it); the dry run saves
        torchrun's process (the reference makes a world of one itself)."""
        return self.torchrun(1) if self.cuda else [self.py]

    def reference(self, *args) -> list:
        """`python -m trainprof.reference` arguments for this device (the sizes of vchecks)."""
        dev = ["--device", "cuda", "--dtype", "bf16"] if self.cuda else ["--device", "cpu"]
        return ["-m", "trainprof.reference", *dev, *map(str, args)]

    def job_file(self, rel: str) -> Path:
        """A test job of the repo (tests/support/jobs/X)."""
        p = self.root / "tests" / "support" / "jobs" / rel
        if not p.is_file():
            raise FileNotFoundError(f"{rel} not in tests/support/jobs")
        return p


def _kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
