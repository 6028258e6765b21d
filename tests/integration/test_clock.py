"""Clock alignment: the NTP estimator, the store round trips with a skewed clock, timeouts,
the analyzers' offset functions, and the offsets a real multi-rank run records on one host.

Single-process cases: tests/unit/probes/test_clock_offsets.py."""

from __future__ import annotations

import json

import pytest

from collective_job import collective_run  # noqa: F401 - shared session fixture


@pytest.mark.multiproc
def test_offsets_on_one_host_are_near_zero(collective_run):
    """Every rank of a real run recorded start and end estimates, 0 on one host: the ranks on
    rank 0's host record offset 0 without round trips (one host, one wall clock)."""
    from trainprof.analysis.run import RunDir

    run = RunDir(collective_run)
    for r in run.ranks:
        recs = run.stream(r, "clock")
        phases = {x["phase"] for x in recs}
        assert phases == {"start", "end"}, (r, recs)
        for x in recs:
            assert x["uncertainty_ns"] < 50e6
            assert abs(x["offset_ns"]) <= x["uncertainty_ns"] + 1000, x
            if r != 0:
                assert x["rounds"] == 0 and x["same_host"] is True, x


# --------------------------------------------------------------------------- a failing process


CRASH_JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(20):
    if rank == 1 and step == 3:
        raise RuntimeError("boom: corrupt batch at step 3")
    loss = m(torch.randn(2, 8)).sum(); loss.backward()
    for p in m.parameters(): dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_crashing_rank_closes_at_once_and_is_a_rank_failure(tmp_path):
    """A rank that raises closes its heartbeat right after its failure record (no wait on its
    peer, which is blocked in a collective until the agent stops it); the job's exit code is
    kept; the analysis names the exception, and it is no hang."""
    import sys

    from helpers import run_cli

    script = tmp_path / "job.py"
    script.write_text(CRASH_JOB)
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--", sys.executable, "-m",
                   "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                  timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.count("boom: corrupt batch at step 3") >= 1  # the job's traceback, kept
    hb = [json.loads(x) for x in (out / "ranks/rank-00001/heartbeat.jsonl").read_text().splitlines()]
    (fail,) = [h for h in hb if h["event"] == "failure"]
    close = hb[-1]
    assert close["event"] == "close" and close["failure"]["exc_type"] == "RuntimeError"
    assert fail["failure"]["exc"] == "boom: corrupt batch at step 3"
    gap_s = (close["t_ns"] - fail["t_ns"]) / 1e9
    print(f"failure record -> close: {gap_s:.3f} s")
    assert gap_s < 2.5  # was the clock end budget (5 s) and more; generous for a loaded box
    assert not [x for x in (out / "ranks/rank-00001/clock.jsonl").read_text().splitlines()
                if '"end"' in x]  # the end estimate was skipped, not attempted
    summary = json.loads((out / "summary.json").read_text())
    kinds = [f["kind"] for f in summary["findings"] if f["analyzer"] == "hang"]
    assert kinds == ["rank_failure"], summary["findings"]
    (f,) = [f for f in summary["findings"] if f["kind"] == "rank_failure"]
    assert f["ranks"] == [1]
    assert "raised RuntimeError: boom: corrupt batch at step 3 (exited with code 1)" in f["message"]
