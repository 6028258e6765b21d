"""Shared multi-process runs of the reference workload for tests.

Starting 8 gloo ranks costs ~40 s on 2 cores, so tests share runs: ``reference_run(name, ...)``
(see conftest.py) runs ``trainprof wrap --no-analyze -- torchrun ... -m trainprof.reference ARGS``
once per session per *name* and returns the run directory. Tests that need the same job use the
same name (and the configs below); tests must not modify a shared run directory (analyze into
``tmp_path`` with ``--out`` instead).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import run_cli

# Canonical configs. Keep the list short: every entry is a multi-process job in CI.
MESH8 = ["--dp", "2", "--pp", "2", "--tp", "2"]
CONFIGS: dict[str, dict] = {
    # The 8-rank dp2·pp2·tp2 clean run most end-to-end tests share.
    "clean8": {"nproc": 8, "args": MESH8 + ["--steps", "8", "--loss-file", "{out}/loss.jsonl"]},
}


def straggler_delay_ms(reference_run) -> int:
    """≈20 % of a clean step as measured now: on a shared 2-core machine the clean step grows
    with the load (1.1 s idle, 1.4-2.9 s measured), and a fixed delay would shrink against it."""
    from trainprof.analyzers import step_time
    from trainprof.analysis.run import RunDir

    clean = step_time.analyze(RunDir(reference_run("clean8"))).metrics["job"]["median_ms"]
    return max(300, int(round(0.2 * clean, -1)))


def straggler_run(reference_run, rank: int) -> Path:
    """clean8's mesh with `straggler:rank=R` (≈20 % of a clean step), 16 steps, no profiler;
    shared by the straggler and the regression-gate tests."""
    delay = straggler_delay_ms(reference_run)
    return reference_run(f"straggler-r{rank}", nproc=8,
                         args=MESH8 + ["--steps", "16", "--inject", f"straggler:rank={rank},delay_ms={delay}"],
                         wrap_args=["--profile-steps", "none"])


class ReferenceRuns:
    def __init__(self, root: Path):
        self.root = root
        self._done: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def __call__(self, name: str, nproc: int | None = None, args: list[str] | None = None,
                 wrap_args: list[str] | None = None, timeout: int = 900, check: bool = True,
                 module: str = "trainprof.reference", env: dict | None = None) -> Path:
        return self.run(name, nproc, args, wrap_args, timeout, check, module, env)[0]

    def run(self, name, nproc=None, args=None, wrap_args=None, timeout=900, check=True,
            module="trainprof.reference", env=None):
        if name in self._done:
            return self._done[name]
        cfg = CONFIGS.get(name, {})
        nproc = nproc if nproc is not None else cfg["nproc"]
        args = list(args if args is not None else cfg["args"])
        wrap_args = list(wrap_args if wrap_args is not None else cfg.get("wrap_args", []))
        out = self.root / name
        args = [a.replace("{out}", str(out)) for a in args]  # e.g. --loss-file {out}/loss.jsonl
        cmd = ["wrap", "--out", out, "--no-analyze", *wrap_args, "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", module, *args]
        proc = run_cli(cmd, timeout=timeout, env=env)
        if check and proc.returncode != 0:
            raise AssertionError(f"reference run {name} failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        self._done[name] = (out, proc)
        return self._done[name]
