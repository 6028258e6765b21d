"""Estimates checked against reality: the job with a problem, the same job with the fix made; the
estimate the first run's analysis gives for the step after the fix must land within 15 % of the
second run's measured step time (docs/estimates.md has the numbers). 2 gloo ranks, a few steps:
the job's "compute" is a sleep, so that the step does not depend on how busy the cores are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from statistics import median

import pytest

from trainprof.analyzers import comm_compute, estimates
from helpers import TRAINPROF, run_cli
from paths import JOBS

pytestmark = pytest.mark.multiproc

JOB = JOBS / "whatif_job.py"
TOLERANCE = 0.15
STEPS = "8"
COMPUTE_MS = "120"


def _pair(tmp_path: Path, problem: list[str], fixed: list[str], profile: str = "none",
          steps: str = STEPS, together: bool = True) -> tuple[dict, dict]:
    """Both jobs at once (their "compute" sleeps, so they hardly disturb each other) or, with
    ``together=False``, one after the other (jobs whose communication is real CPU work: run at
    once, the one with the problem communicates while the other sleeps and is slowed by it
    alone), each wrapped, then analyzed: (problem summary, fixed summary)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    procs = {}
    for tag, args in (("problem", problem), ("fixed", fixed)):
        cmd = [*TRAINPROF, "wrap", "--out", str(tmp_path / tag), "--no-analyze", "--profile-steps",
               profile, "--", sys.executable, str(JOB), "--steps", steps, "--compute-ms", COMPUTE_MS,
               *args]
        procs[tag] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not together:
            _finished(procs[tag])
    if together:
        for p in procs.values():
            _finished(p)
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


def _finished(p: subprocess.Popen) -> None:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, (err or "")[-3000:]


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


def _checked_pair(tmp_path: Path, problem: list[str], fixed: list[str], kind: str, run=None,
                  check=None):
    """One more pair when the first misses: on a loaded shared machine one run of a pair can be
    slowed more than the other (measured: a 120 ms sleep taking 130-290 ms at load 25 on 2
    cores). Two misses fail."""
    run, check = run or _pair, check or _check
    try:
        return check(*run(tmp_path / "1", problem, fixed), kind)
    except AssertionError as first:
        print(f"first pair missed ({first}); once more")
        return check(*run(tmp_path / "2", problem, fixed), kind)


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


# --------------------------------------------------------------------------- overlap
def _profiled_window(summary: dict) -> float:
    """The profiled steps' window, median over ranks (comm_compute): the basis the overlap
    estimate is computed on."""
    return median(r["step_window_ms"] for r in summary["metrics"]["comm_compute"]["per_rank"])


def _check_overlap(problem: dict, fixed: dict, kind: str) -> tuple[float, float]:
    f = _one(problem, kind)
    e = f["estimate"]
    # the fix fits the case: the job all-reduces by hand after backward, DDP is what overlaps
    assert f["fix"] == comm_compute.HAND_ALL_REDUCE_FIX and "DistributedDataParallel" in f["fix"]
    assert e and e["model"].startswith("overlap bound") and e["assumptions"]
    # of the ranks' profiled windows, the one of the rank whose bound is the job's (the lower
    # median): 2 ranks' windows differ by a few %, their median is their mean
    assert e["step_ms_before"] in [pytest.approx(r["step_window_ms"], abs=1e-3)
                                   for r in problem["metrics"]["comm_compute"]["per_rank"]]
    measured = _profiled_window(fixed)
    assert measured < 0.85 * e["step_ms_before"], (e, measured)
    assert abs(e["step_ms_after"] - measured) <= TOLERANCE * measured, (e, measured)
    assert kind in [a["kind"] for a in problem["actions"]]
    assert not [x for x in fixed["findings"] if x["kind"] == kind], fixed["findings"]
    return e["step_ms_after"], measured


def test_overlap_estimate_matches_the_run_with_async_hooks(tmp_path):
    # 32 MB of gradients in 8 tensors (almost no compute) all-reduced by hand after backward,
    # one blocking all_reduce per tensor, whose last 100 ms (a sleep at the input's end) could
    # hide them. The fix changes only the overlap: the same per-gradient all-reduces, issued
    # async from each parameter's post-accumulate-grad hook while backward runs (--grad-sync
    # hooks; DDP would also merge them into buckets). On CPU the bound counts the waits for a
    # peer still in its previous all-reduce and, under the sleep, the host's delay in them
    # (analyzers/_overlap_credit.py). 3 profiled steps of 8. The two jobs run one after the
    # other: at once, the fixed job's transfers (under its sleep) contend with the problem
    # job's for the cores and the problem's step grows 35-40 % (docs/estimates.md).
    job = ["--compute-ms", "0", "--backward-ms", "100", "--comm-mb", "32"]
    est, measured = _checked_pair(
        tmp_path, [*job, "--grad-sync", "manual"], [*job, "--grad-sync", "hooks"], "exposed_comm",
        run=lambda p, a, b: _pair(p, a, b, profile="3-5", together=False), check=_check_overlap)
    print(f"overlap: estimate {est:.1f} ms, measured {measured:.1f} ms ({est / measured - 1:+.0%})")


# --------------------------------------------------------------------------- pipeline
PIPE_ARGS = ["--dp", "1", "--pp", "2", "--tp", "1", "--steps", "20", "--global-batch", "16"]


def _pipeline_pair(tmp_path: Path, m: int) -> tuple[dict, dict]:
    """The reference job (2 stages, 1F1B, global batch 16) with m and 2m micro-batches, one
    after the other (their compute is real: run at once, each would slow the other), 4
    profiled steps each; (summary with m, summary with 2m)."""
    out = []
    for mb in (m, 2 * m):
        d = tmp_path / f"m{mb}"
        proc = run_cli(["wrap", "--out", d, "--no-analyze", "--profile-steps", "3-6", "--",
                        sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "trainprof.reference", *PIPE_ARGS,
                        "--micro-batches", str(mb)], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        a = run_cli(["analyze", d, "--json"], timeout=300)
        assert a.returncode in (0, 1), a.stderr[-3000:]
        out.append(json.loads(a.stdout))
    return out[0], out[1]


def _check_micro_batches(before: dict, after: dict, _kind) -> tuple[float, float]:
    pipe = before["metrics"]["pipeline"]
    mbc = pipe["micro_batch_cost"]
    assert mbc and 0 < mbc["ratio"] < 1.5, mbc
    e = estimates.more_micro_batches(pipe, before["metrics"]["step_time"]["job"]["median_ms"])
    assert "per op kind" in e["model"]
    predicted = e.get("step_ms_predicted", e["step_ms_after"])
    measured = after["metrics"]["step_time"]["job"]["median_ms"]
    print(f"m={pipe['config']['micro_batches']}: step {e['step_ms_before']:.1f} ms, a micro-batch "
          f"at half size {mbc['ratio']:.2f}x, estimate for 2m {predicted:.1f} ms, measured "
          f"{measured:.1f} ms")
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured, mbc)
    return predicted, measured


@pytest.mark.long  # two reference jobs one after the other: ~70 s a pair on 2 cores
def test_more_micro_batches_estimate_matches_the_run_with_twice_as_many(tmp_path):
    est, measured = _checked_pair(tmp_path, [], [], "pipeline_bubble",
                                  run=lambda p, a, b: _pipeline_pair(p, 2),
                                  check=_check_micro_batches)
    print(f"more micro-batches: estimate {est:.1f} ms, measured {measured:.1f} ms")
