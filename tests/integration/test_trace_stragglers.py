"""Stragglers from profiler traces alone (analyzers/trace_stragglers.py): real 2-rank gloo jobs
that run their own torch.profiler, one with a rank that sleeps every step, analysed as a bare
trace folder (`trainprof analyze TRACES/`). The late rank is named, the waiting rank is not
blamed for exposed communication, a clean job stays silent, and the output says which analyses
bare traces cannot give.

Single-process cases: tests/unit/analyzers/test_trace_stragglers_fixtures.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_bare_job, run_cli
from trainprof.analysis.run import RunDir

SLEEP_MS = 30

JOB = r"""
import os, time, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import profile, schedule, tensorboard_trace_handler, ProfilerActivity

dist.init_process_group("gloo")
rank = dist.get_rank()
slow = int(os.environ["SLOW_RANK"])
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=4),
             on_trace_ready=tensorboard_trace_handler(os.environ["PROF_DIR"])) as prof:
    for step in range(6):
        if rank == slow:
            time.sleep(float(os.environ["SLEEP_MS"]) / 1000)
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        prof.step()
dist.destroy_process_group()
"""


def _job(tmp: Path, name: str, slow_rank: int) -> Path:
    out = tmp / name
    script = tmp / "job.py"
    script.write_text(JOB)
    env = {"PROF_DIR": str(out), "SLOW_RANK": str(slow_rank), "SLEEP_MS": str(SLEEP_MS),
           "OMP_NUM_THREADS": "1"}
    res = run_bare_job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], env={**os.environ, **env}, timeout=300,
                       before=lambda: shutil.rmtree(out, ignore_errors=True))
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(list(out.glob("*.pt.trace.json"))) == 2
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("trace_strag")
    return {"slow": _job(tmp, "slow", 1), "clean": _job(tmp, "clean", -1)}


def _analyze(folder: Path) -> tuple[subprocess.CompletedProcess, dict]:
    res = run_cli(["analyze", folder, "--no-report"])
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads((folder / "summary.json").read_text())


@pytest.mark.multiproc
def test_sleeping_rank_named_from_traces_and_its_peer_not_blamed(jobs):
    res, s = _analyze(jobs["slow"])
    (f,) = [f for f in s["findings"] if f["kind"] == "straggler"]
    assert f["analyzer"] == "trace_stragglers" and f["ranks"] == [1]
    ev = f["evidence"]
    # rank 1 is off the CPU (sleeping) for the injected time, rank 0 waits about as long
    assert ev["excess_by_part_ms_per_step"]["idle_ms"] >= 0.6 * SLEEP_MS
    assert 0.6 * SLEEP_MS <= ev["excess_ms_per_step"] <= 3 * SLEEP_MS
    assert list(ev["waits_caused_ms"]) == ["0"] and ev["waits_caused_ms"]["0"] >= 0.5 * SLEEP_MS
    assert ev["waited_in"] == "all_reduce"
    assert "rank 1 spends" in f["message"] and "with no op recorded in the trace" in f["message"]
    assert "rank 0 waits" in f["message"]
    # the wait is rank 1's finding: rank 0 is not blamed for exposed communication
    assert not [g for g in s["findings"] if g["kind"] == "exposed_comm" and g["ranks"] == [0]]
    cc = s["metrics"]["comm_compute"]
    assert cc["waiting_for_late_ranks"]["late"] == [1]
    assert cc["exposed_comm_fraction_excl_late_ranks"] < cc["exposed_comm_fraction"]
    # the figures in the evidence are the per-rank metrics of the same analysis
    per = {r["rank"]: r for r in s["metrics"]["trace_stragglers"]["per_rank"]}
    assert per[1]["excess_ms_per_step"] == ev["excess_ms_per_step"]
    assert per[0]["collective_wait_ms_per_step"] == ev["waits_caused_ms"]["0"]
    assert "straggler" in res.stdout and "nothing looks wrong" not in res.stdout


@pytest.mark.multiproc
def test_clean_trace_folder_silent_and_says_what_was_not_analyzed(jobs):
    res, s = _analyze(jobs["clean"])
    assert not [f for f in s["findings"] if f["kind"] == "straggler"], s["findings"]
    ts = s["metrics"]["trace_stragglers"]
    assert len(ts["steps"]) >= 3 and all(r["excess_ms_per_step"] < ts["floor_ms"] for r in ts["per_rank"])
    cov = s["coverage"]
    missing = {m["analysis"] for m in cov["not_analyzed"]}
    assert {"step time", "stragglers over every step", "NaN origin", "hang"} <= missing
    assert "communication vs compute" in cov["analyzed"]
    assert cov["text"] in s["problems"]
    assert "nothing looks wrong" not in res.stdout and "steps.jsonl" in res.stdout
    # without findings (a tiny DDP job may have exposed communication): never "nothing looks
    # wrong" about the analyses bare traces cannot give, in the terminal nor in the report
    from rich.console import Console

    from trainprof.reports.html import render_html
    from trainprof.reports.terminal import render_terminal

    quiet = dict(s, findings=[])
    con = Console(record=True, width=200)
    render_terminal(quiet, console=con)
    text = con.export_text()
    assert "nothing looks wrong" not in text
    assert "no findings in what was analyzed" in text and "heartbeat.jsonl" in text
    html = render_html(quiet)
    assert "nothing looks wrong" not in html and "No findings in what was analyzed" in html
    assert "steps.jsonl" in html
    plain = {k: v for k, v in quiet.items() if k != "coverage"}  # a run directory's summary
    assert "nothing looks wrong" in render_html(plain)


@pytest.mark.multiproc
def test_straggler_from_traces_not_reported_twice_with_a_collective_log(jobs, tmp_path):
    """Inside a run directory with a collective log the stragglers analyzer judges: the trace
    analysis stays silent (the same traces, as RUN/profiler/, plus a collective log)."""
    from trainprof.analyzers import trace_stragglers

    bare = RunDir(jobs["slow"])
    assert trace_stragglers.analyze(bare).findings  # the traces alone: found
    assert trace_stragglers.waits(bare)["late"] == [1]

    class WithLog:  # the same traces with a collective log beside them
        trace_inputs: list = []
        problems: list = []

        def collectives(self):
            import pandas as pd

            return pd.DataFrame([{"rank": 0, "step": 1, "pg": "0", "blocked_ms": 1.0}])

        def trace_digests(self, name):
            return bare.trace_digests(name)

    assert not trace_stragglers.analyze(WithLog()).findings
    assert trace_stragglers.waits(WithLog()) == {"late": [], "wait_ms": {}}


