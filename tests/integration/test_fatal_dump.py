"""probes/fatal_dump.py (faulthandler on ranks/rank-N/fatal-stacks.txt) and its use by the hang
post-mortem: a rank that gloo aborts (SIGABRT) inside a collective is placed in the collective it
died in, so the peer that skipped one is named, with the aborted rank's call site.

Single-process cases: tests/unit/analyzers/test_fatal_stacks.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import run_cli, write_script
from trainprof.analyzers import _fatal_stacks as fatal
from trainprof.analysis.run import RunDir


# one optimizer step activates the probes; then the process aborts as gloo's terminate does
ABORT = """\
import os, torch
{pre}
def die_here():
    os.abort()

p = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([p], lr=0.1)
for _ in range(3):
    p.sum().backward(); opt.step(); opt.zero_grad()
if os.environ.get("DIE") == "1":
    die_here()
print("done", flush=True)
"""
USER_FH = "import faulthandler, sys\nfaulthandler.enable(file=sys.stderr, all_threads=True)"


def _wrap(tmp_path, script, name, env=None):
    out = tmp_path / name
    res = run_cli(["wrap", "--out", out, "--no-analyze", "--profile-steps", "none", "--",
                   sys.executable, script], env=env, timeout=180)
    return out, res


def test_abort_keeps_signal_exit_code_and_stderr_and_dumps_to_the_rank_file(tmp_path):
    script = write_script(tmp_path / "job.py", ABORT.format(pre=""))
    plain = subprocess.run([sys.executable, script], env={**os.environ, "DIE": "1"},
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == -signal.SIGABRT
    out, res = _wrap(tmp_path, script, "run", env={"DIE": "1"})
    man = json.loads((out / "manifest.json").read_text())
    assert man["signal"] == signal.SIGABRT and man["exit_code"] == 128 + signal.SIGABRT
    assert res.returncode == plain.returncode  # wrap ends as its job did
    # the job's stderr is as without trainprof (wrap's own lines aside): no faulthandler text
    job_err = [x for x in res.stderr.splitlines() if not x.startswith("trainprof")]
    assert job_err == plain.stderr.splitlines()
    assert "Fatal Python error" not in res.stderr
    text = (out / "ranks/rank-00000/fatal-stacks.txt").read_text()
    assert text.startswith("# trainprof fatal-stacks v1 pid=")
    parsed = fatal.parse(RunDir(out).fatal_stacks(0))
    assert parsed["signal_text"] == "Aborted" and parsed["main_known"]
    assert [f["function"] for f in parsed["main_thread"]][-2:] == ["<module>", "die_here"]


def test_job_with_its_own_faulthandler_keeps_its_stderr_dump(tmp_path):
    script = write_script(tmp_path / "job.py", ABORT.format(pre=USER_FH))
    out, res = _wrap(tmp_path, script, "run", env={"DIE": "1"})
    assert json.loads((out / "manifest.json").read_text())["signal"] == signal.SIGABRT
    assert "Fatal Python error: Aborted" in res.stderr and "in die_here" in res.stderr
    assert (out / "ranks/rank-00000/meta.json").exists()  # the probes ran
    assert not (out / "ranks/rank-00000/fatal-stacks.txt").exists()


def test_clean_exit_leaves_no_empty_file(tmp_path):
    script = write_script(tmp_path / "job.py", ABORT.format(pre=""))
    out, res = _wrap(tmp_path, script, "run")
    assert res.returncode == 0 and "done" in res.stdout
    assert (out / "ranks/rank-00000/meta.json").exists()
    assert not (out / "ranks/rank-00000/fatal-stacks.txt").exists()


SKIP = """\
import time, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def sync_metrics(t):
    dist.all_reduce(t)

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(8):
    time.sleep(0.1)
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    t = loss.detach().clone()
    if not (rank == 1 and step == 3):  # rank 1 skips the metric all_reduce at step 3
        sync_metrics(t)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_rank_aborted_in_a_skipped_collective_is_the_victim_with_its_call_site(tmp_path):
    script = write_script(tmp_path / "skip.py", SKIP)
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--hang-timeout", "20",
                   "--on-hang", "kill", "--", sys.executable, "-m", "torch.distributed.run",
                   "--standalone", "--nproc-per-node", "2", script], timeout=300)
    man = json.loads((out / "manifest.json").read_text())
    first = man.get("first_failures") or []
    assert [(w["rank"], w["signal_name"]) for w in first] == [(0, "SIGABRT")], (first, res.stderr)
    summary = json.loads((out / "summary.json").read_text())
    (f,) = [f for f in summary["findings"] if f["kind"] in ("desync", "rank_failure", "hang")]
    c = f["evidence"]["culprit"]
    assert f["kind"] == "desync" and f["ranks"] == [1] and c["reason"] == "desync", f["message"]
    assert [v["rank"] for v in c["victims"]] == [0]
    w = f["evidence"]["waiting_in"]["0"]
    assert w["inferred"] == "fatal-stacks" and w["op"] == "all_reduce"
    assert w["call_site"].endswith("skip.py:5 in sync_metrics")
    assert "called at " in f["message"] and "skip.py:5 in sync_metrics" in f["message"]
    assert "a victim of the mismatch" in f["message"]


