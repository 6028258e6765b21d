"""A real 2-rank gloo job that never destroys its process group: under wrap it exits 0 (the
probes' work at exit avoids torch's teardown abort, docs/hangs.md), so the analysis must say
what the user may see without trainprof; the same job with destroy_process_group() gets
nothing."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_cli, write_script

JOB = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
out = [torch.empty(1) for _ in range(n)]
for step in range(3):
    dist.all_gather(out, torch.tensor([r * 100.0 + step]))
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
if r == 0:
    print("ok", r, [float(x) for x in out], flush=True)
"""


@pytest.mark.multiproc
def test_group_left_live_is_said_and_a_destroyed_one_is_not(tmp_path):
    script = write_script(tmp_path / "job.py", JOB)
    seen = {}
    for mode in ("leave", "destroy"):
        out = tmp_path / mode
        res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--",
                       sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2", script, mode], timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "ok 0 [2.0, 102.0]" in res.stdout
        summary = json.loads((out / "summary.json").read_text())
        seen[mode] = ([f for f in summary["findings"] if f["kind"] == "process_group_not_destroyed"],
                      summary["metrics"].get("teardown"))
    (f,), m = seen["leave"]
    assert f["ranks"] == [0, 1] and f["severity"] == "warning"
    assert f["fix"].startswith("call torch.distributed.destroy_process_group()")
    assert m == {"ranks_recorded": 2, "live_at_exit": "0-1", "destroyed": ""}
    found, m = seen["destroy"]
    assert found == [] and m == {"ranks_recorded": 2, "live_at_exit": "", "destroyed": "0-1"}
