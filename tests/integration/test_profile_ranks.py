"""--profile-ranks: which ranks record the profiler window. The policy each rank applies on its
own (probes/profile_ranks.py) on synthetic meshes, and a real 2-rank job profiling rank 1 only.

Single-process cases: tests/unit/probes/test_profile_rank_sets.py."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_cli
from paths import JOBS

JOB = JOBS / "ddp_job.py"


def test_a_bad_spec_is_refused_before_the_job_starts(tmp_path):
    flag = tmp_path / "started"
    res = run_cli(["wrap", "--out", tmp_path / "run", "--profile-ranks", "3-1", "--",
                   sys.executable, "-c", f"open({str(flag)!r}, 'w')"])
    assert res.returncode == 2 and "--profile-ranks '3-1' is not accepted" in res.stderr
    assert not flag.exists()


@pytest.mark.multiproc
def test_profiling_rank_1_only_leaves_rank_0_without_a_trace_on_purpose(tmp_path):
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "2-3", "--profile-ranks", "1", "--",
                   sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", JOB, "--steps", "6"], timeout=300)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (out / "profiler").iterdir()) == ["rank-00001.pt.trace.json.gz"]
    m0 = json.loads((out / "ranks/rank-00000/meta.json").read_text())
    m1 = json.loads((out / "ranks/rank-00001/meta.json").read_text())
    assert (m0["profiled"], m0["profile_policy"], m0["profile_ranks"]) == (False, "list", "1")
    assert m1["profiled"] is True
    # the other probes ran on rank 0 as on rank 1
    for r in (0, 1):
        assert len((out / f"ranks/rank-0000{r}/steps.jsonl").read_text().splitlines()) >= 6
        assert (out / f"ranks/rank-0000{r}/collectives.jsonl").stat().st_size > 0
    steps0 = [json.loads(x) for x in (out / "ranks/rank-00000/steps.jsonl").read_text().splitlines()]
    assert not any(s.get("profiled") for s in steps0)
    s = json.loads((out / "summary.json").read_text())
    prof = s["run"]["profiled"]
    assert prof["text"] == "1 of 2 ranks profiled (policy list)"
    assert (prof["count"], prof["of"], prof["ranks"], prof["not_profiled"]) == (1, 2, [1], 1)
    assert "partial" not in s["run"]
    assert not [p for p in s["problems"] if "rank-00000" in p or "missing" in p or "trace" in p], \
        s["problems"]
    assert [r["rank"] for r in s["metrics"]["comm_compute"]["per_rank"]] == [1]
    assert "1 of 2 ranks profiled (policy list)" in res.stderr  # wrap prints on stderr


