"""Estimates checked against reality: the job with a problem, the same job with the fix made; the
estimate the first run's analysis gives for the step after the fix must land within 15 % of the
second run's measured step time (docs/estimates.md has the numbers). 2 gloo ranks, a few steps:
the job's "compute" is a sleep, so that the step does not depend on how busy the cores are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TRAINPROF
from paths import JOBS

pytestmark = pytest.mark.multiproc

JOB = JOBS / "whatif_job.py"
TOLERANCE = 0.15
STEPS = "8"
COMPUTE_MS = "120"


def _pair(tmp_path: Path, problem: list[str], fixed: list[str]) -> tuple[dict, dict]:
    """Both jobs at once (their "compute" sleeps, so they hardly disturb each other), each
    wrapped, then analyzed: (problem summary, fixed summary)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    procs = {}
    for tag, args in (("problem", problem), ("fixed", fixed)):
        cmd = [*TRAINPROF, "wrap", "--out", str(tmp_path / tag), "--no-analyze", "--profile-steps",
               "none", "--", sys.executable, str(JOB), "--steps", STEPS, "--compute-ms", COMPUTE_MS,
               *args]
        procs[tag] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for tag, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    # both analyses at once too (each mostly starts Python and imports)
    ana = {tag: subprocess.Popen([*TRAINPROF, "analyze", str(tmp_path / tag), "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for tag in procs}
    out = []
    for a in ana.values():
        stdout, err = a.communicate(timeout=300)
        assert a.returncode in (0, 1), err[-3000:]
        out.append(json.loads(stdout))
    return out[0], out[1]


def _one(summary: dict, kind: str) -> dict:
    fs = [f for f in summary["findings"] if f["kind"] == kind]
    assert len(fs) == 1, [(f["kind"], f["message"]) for f in summary["findings"]]
    return fs[0]


def _check(problem: dict, fixed: dict, kind: str) -> tuple[float, float]:
    f = _one(problem, kind)
    e = f["estimate"]
    assert f["fix"] and e and e["model"] and e["assumptions"]
    assert e["step_ms_before"] == pytest.approx(problem["metrics"]["step_time"]["job"]["median_ms"], abs=1e-3)
    measured = fixed["metrics"]["step_time"]["job"]["median_ms"]
    # the problem is real and the estimate is of the fixed run's step, not of the problem's
    assert measured < 0.85 * e["step_ms_before"], (e, measured)
    assert abs(e["step_ms_after"] - measured) <= TOLERANCE * measured, (e, measured)
    # it leads "What to change first"
    assert problem["actions"] and problem["actions"][0]["kind"] == kind
    assert not [x for x in fixed["findings"] if x["kind"] == kind], fixed["findings"]
    return e["step_ms_after"], measured


def _checked_pair(tmp_path: Path, problem: list[str], fixed: list[str], kind: str):
    """One more pair when the first misses: on a loaded shared machine one run of a pair can be
    slowed more than the other (measured: a 120 ms sleep taking 130-290 ms at load 25 on 2
    cores). Two misses fail."""
    try:
        return _check(*_pair(tmp_path / "1", problem, fixed), kind)
    except AssertionError as first:
        print(f"first pair missed ({first}); once more")
        return _check(*_pair(tmp_path / "2", problem, fixed), kind)


def test_straggler_removed_estimate_matches_the_run_without_it(tmp_path):
    est, measured = _checked_pair(tmp_path, ["--slow-rank", "1", "--slow-ms", "80"], [], "straggler")
    print(f"straggler: estimate {est:.1f} ms, measured {measured:.1f} ms")


def test_data_loading_in_workers_estimate_matches_the_run_with_workers(tmp_path):
    est, measured = _checked_pair(tmp_path, ["--data-ms", "80", "--data-rank", "1"],
                                  ["--data-ms", "80", "--data-rank", "1", "--workers", "2"],
                                  "data_starvation")
    print(f"data loading: estimate {est:.1f} ms, measured {measured:.1f} ms")


def test_larger_ddp_buckets_estimate_matches_the_run_with_default_buckets(tmp_path):
    # 40 small layers (82 gradients of ≤ 1 KB) in buckets of ~100 bytes: ~40 all-reduces per
    # step, each paying gloo's fixed cost; the fix is DDP's default bucket_cap_mb (one bucket)
    model = ["--compute-ms", "40", "--layers", "40", "--width", "16"]
    est, measured = _checked_pair(tmp_path, [*model, "--bucket-mb", "0.0001"], model, "exposed_comm")
    print(f"DDP buckets: estimate {est:.1f} ms, measured {measured:.1f} ms")
