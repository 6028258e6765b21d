"""Hangs: heartbeat, dump-on-trigger, the launcher's watchdog (--hang-timeout/--on-hang), and the
post-mortem (trainprof analyze / trainprof hang) on hung, desynchronized, SIGKILLed and clean runs.

Single-process cases: tests/unit/probes/test_hang_watchdog.py,
tests/unit/analyzers/test_hang_analyzer.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from helpers import run_cli, wait_for, write_script
from trainprof.launch.launcher import HANG_EXIT_CODE
from trainprof.rundir.files import write_json_atomic
from trainprof.analysis.run import RunDir
from hang_shared import _lines

HAVE_REFERENCE = importlib.util.find_spec("trainprof.reference.__main__") is not None


# --------------------------------------------------------------------------- probes, in-process


# --------------------------------------------------------------------------- launcher watchdog

SINGLE = """
import os, time, torch
def stuck_here():
    time.sleep(600)
def slow_phase():
    time.sleep(float(os.environ["PAUSE"]))
m = torch.nn.Linear(4, 4); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(12):
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    time.sleep(0.1)
    if i == 4:
        stuck_here() if os.environ["MODE"] == "stuck" else slow_phase()
"""


def test_on_hang_kill_single_process(tmp_path):
    script = write_script(tmp_path / "train.py", SINGLE)
    out = tmp_path / "run"
    t0 = time.monotonic()
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--hang-timeout", "3",
                   "--on-hang", "kill", "--", sys.executable, script],
                  env={"MODE": "stuck", "TRAINPROF_HEARTBEAT_S": "0.2"}, timeout=180)
    assert res.returncode == HANG_EXIT_CODE, res.stderr
    assert time.monotonic() - t0 < 120
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "hung" and man["exit_code"] == HANG_EXIT_CODE
    assert man["hangs"][0]["ranks_dumped"] == [0] and man["hangs"][0]["action"] == "kill"
    summary = json.loads((out / "summary.json").read_text())
    f = next(f for f in summary["findings"] if f["kind"] == "hang")
    assert f["ranks"] == [0] and f["severity"] == "critical"
    assert f["evidence"]["culprit"]["frame"].endswith("train.py:4 in stuck_here")
    assert "time.sleep(600)" in f["message"]


def test_on_hang_dump_keeps_waiting_and_run_recovers(tmp_path):
    script = write_script(tmp_path / "train.py", SINGLE)
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--hang-timeout", "2",
                   "--on-hang", "dump", "--", sys.executable, script],
                  env={"MODE": "pause", "PAUSE": "6", "TRAINPROF_HEARTBEAT_S": "0.2"}, timeout=180)
    assert res.returncode == 0, res.stderr
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "ok" and len(man["hangs"]) == 1  # fired once, in the pause only
    dump = json.loads((out / "ranks/rank-00000/hang-dump.json").read_text())
    assert dump["threads"][0]["main"] and dump["threads"][0]["frames"][-1]["function"] == "slow_phase"
    steps = _lines(out / "ranks/rank-00000/steps.jsonl")
    assert len(steps) == 12  # the job ran to its end
    f = next(f for f in json.loads((out / "summary.json").read_text())["findings"]
             if f["kind"] == "hang")
    assert f["severity"] == "warning" and "recovered" in f["message"]


def test_hang_dump_on_a_live_job(tmp_path):
    import os
    import signal
    import subprocess

    from helpers import TRAINPROF

    script = write_script(tmp_path / "train.py", SINGLE)
    out = tmp_path / "run"
    proc = subprocess.Popen(TRAINPROF + ["wrap", "--out", str(out), "--no-analyze",
                                         "--profile-steps", "none", "--", sys.executable,
                                         str(script)],
                            env={**os.environ, "MODE": "stuck"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        hb = out / "ranks/rank-00000/heartbeat.jsonl"
        assert wait_for(lambda: hb.exists() and '"step":5' in hb.read_text(), timeout=120)
        res = run_cli(["hang", out, "--dump", "--wait", "20", "--json"], timeout=120)
        pm = json.loads(res.stdout)["postmortem"]
        assert pm["ranks"][0]["dumped"] and pm["ranks"][0]["user_frame"].endswith("in stuck_here")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_usage_errors(tmp_path):
    res = run_cli(["wrap", "--out", tmp_path / "r", "--on-hang", "kill", "--", "true"])
    assert res.returncode == 2 and "--hang-timeout" in res.stderr
    res = run_cli(["wrap", "--out", tmp_path / "r", "--hang-timeout", "0", "--", "true"])
    assert res.returncode != 0 and "hang timeout must be > 0" in res.stderr


# --------------------------------------------------------------------------- analyzer, synthetic


# --------------------------------------------------------------------------- multi-process

HANG_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
R, S, MODE = int(os.environ["HANG_RANK"]), int(os.environ["HANG_STEP"]), os.environ["MODE"]
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)

def inject_hang(step):
    if rank == R and step == S and MODE == "sleep":
        time.sleep(3600)

for step in range(8):
    loss = m(torch.randn(2, 8)).sum(); loss.backward()
    for p in m.parameters(): dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
    inject_hang(step)
    l = loss.detach().reshape(1)
    if not (rank == R and step == S and MODE == "skip"):
        dist.all_reduce(l)
    out = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(out, torch.tensor([float(step), float(rank)]))
dist.destroy_process_group()
"""
HANG_RANK, HANG_STEP = 2, 3
_runs: dict = {}


def _hang_run(mode: str, reference_run, tmp_path_factory):
    """4 ranks, rank 2 hangs at step 3, under wrap --hang-timeout 10 --on-hang kill. The
    reference workload when it is present, else a small gloo script with the same faults."""
    if mode in _runs:
        return _runs[mode]
    wrap_args = ["--hang-timeout", "10", "--on-hang", "kill", "--profile-steps", "none"]
    t0 = time.monotonic()
    if HAVE_REFERENCE:
        out, proc = reference_run.run(
            f"hang-{mode}", nproc=4, check=False, wrap_args=wrap_args,
            args=["--dp", "4", "--pp", "1", "--tp", "1", "--steps", "8", "--inject",
                  f"hang:rank={HANG_RANK},step={HANG_STEP},mode={mode}"])
    else:
        root = tmp_path_factory.mktemp(f"hang-{mode}")
        script = write_script(root / "hangjob.py", HANG_SCRIPT)
        out = root / "run"
        proc = run_cli(["wrap", "--out", out, "--no-analyze", *wrap_args, "--", sys.executable,
                        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        script], env={"HANG_RANK": str(HANG_RANK), "HANG_STEP": str(HANG_STEP),
                                      "MODE": mode}, timeout=600)
    _runs[mode] = (Path(out), proc, time.monotonic() - t0)
    return _runs[mode]


def _analyze(run: Path, tmp_path: Path) -> dict:
    res = run_cli(["analyze", run, "--out", tmp_path / "analysis", "--no-report", "-q"])
    assert res.returncode == 0, res.stderr
    return json.loads((tmp_path / "analysis" / "summary.json").read_text())


def _last_progress_ns(run: Path) -> int:
    return max(h["t_ns"] for p in run.glob("ranks/*/heartbeat.jsonl")
               for h in RunDir(run).stream(int(p.parent.name[5:]), "heartbeat"))


@pytest.mark.multiproc
def test_sleep_hang_killed_and_culprit_named(reference_run, tmp_path_factory, tmp_path):
    run, proc, wall = _hang_run("sleep", reference_run, tmp_path_factory)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    man = json.loads((run / "manifest.json").read_text())
    assert man["status"] == "hung" and man["hangs"][0]["ranks_dumped"] == [0, 1, 2, 3]
    # The hang began at the last heartbeat at the latest (+1 s heartbeat lag).
    hang_to_end_s = (man["end_time"]["ns"] - _last_progress_ns(run)) / 1e9 + 1.0
    print(f"hang -> job ended: {hang_to_end_s:.1f} s (wall {wall:.0f} s)")
    assert hang_to_end_s < 30
    summary = _analyze(run, tmp_path)
    (f,) = [f for f in summary["findings"] if f["kind"] == "hang"]
    culprit = f["evidence"]["culprit"]
    assert f["ranks"] == [HANG_RANK] and culprit["reason"] == "never_arrived"
    assert "sleep" in culprit["code"] and "sleep" in f["message"]
    others = [r for r in range(4) if r != HANG_RANK]
    waits = f["evidence"]["waiting_in"]
    assert sorted(int(r) for r in waits) == others
    ops = {waits[str(r)]["op"] for r in others}
    assert len(ops) == 1 and ops.pop() in f["message"]
    groups = f["evidence"]["stack_groups"]
    assert groups[0]["ranks"] == others and groups[0]["majority"] and groups[0]["in_collective"]
    assert any(g["ranks"] == [HANG_RANK] and not g["in_collective"] for g in groups)
    # the standalone view says the same
    res = run_cli(["hang", run, "--json"])
    assert json.loads(res.stdout)["postmortem"]["culprit"]["ranks"] == [HANG_RANK]
    res = run_cli(["hang", run])
    assert res.returncode == 0 and f"rank {HANG_RANK}" in res.stdout


@pytest.mark.multiproc
def test_skip_names_desynchronization(reference_run, tmp_path_factory, tmp_path):
    run, proc, _ = _hang_run("skip", reference_run, tmp_path_factory)
    summary = _analyze(run, tmp_path)
    (f,) = [f for f in summary["findings"] if f["kind"] == "hang"]
    d = f["evidence"]["desync"][0]
    variants = {v["op"]: v["ranks"] for v in d["variants"]}
    others = [r for r in range(4) if r != HANG_RANK]
    assert variants["all_reduce"] == others and variants["all_gather"] == [HANG_RANK]
    assert f["ranks"] == [HANG_RANK] and f["evidence"]["culprit"]["reason"] == "desync"
    assert f"group {d['pg']}" in f["message"] and f"#{d['seq']}" in f["message"]
    assert "all_gather" in f["message"] and "all_reduce" in f["message"]


@pytest.mark.multiproc
def test_postmortem_after_sigkill_with_torn_heartbeat(reference_run, tmp_path_factory, tmp_path):
    """The same hang, as if an operator had SIGKILLed the job a minute in without any dump:
    no dumps, no flight recorder, no watchdog record, and one waiting rank's heartbeat torn."""
    src, _, _ = _hang_run("sleep", reference_run, tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(src, run)
    for p in list(run.glob("ranks/*/hang-dump.json")) + list(run.glob("ranks/*/flight-recorder.*")):
        p.unlink()
    (run / "hang-trigger.json").unlink()
    # the launcher's record: manifest.json and its node record (nodes/*.json, which wins on read)
    for rec_path in [run / "manifest.json", *sorted(run.glob("nodes/*.json"))]:
        man = json.loads(rec_path.read_text())
        for k in ("hangs", "job_exit_code", "job_signal"):
            man.pop(k, None)
        man.update(status="killed", exit_code=137, signal=9, signal_name="SIGKILL")
        man["end_time"]["ns"] = max(man["end_time"]["ns"], _last_progress_ns(run) + int(60e9))
        write_json_atomic(rec_path, man)
    torn = 0 if HANG_RANK != 0 else 1
    hb = run / f"ranks/rank-{torn:05d}/heartbeat.jsonl"
    data = hb.read_bytes()
    hb.write_bytes(data[:len(data) - 40])  # the last record cut mid-line
    (run / "ranks/rank-00003/collectives.jsonl").unlink(missing_ok=True)  # and a missing file

    summary = _analyze(run, tmp_path)
    (f,) = [f for f in summary["findings"] if f["kind"] == "hang"]
    assert f["ranks"] == [HANG_RANK] and f["severity"] == "critical"
    assert f["evidence"]["culprit"]["reason"] == "never_arrived"
    assert "no rank progressed" in f["evidence"]["detected_by"][0]
    waiting = {int(r) for r in f["evidence"]["waiting_in"]}
    others = {r for r in range(4) if r != HANG_RANK}
    assert others - {torn} <= waiting <= others  # the torn rank's older record may still say so
    assert any(f"rank-{torn:05d}/heartbeat.jsonl" in p and "torn" in p for p in summary["problems"])


@pytest.mark.multiproc
@pytest.mark.skipif(not HAVE_REFERENCE, reason="reference workload not in this build")
def test_clean_reference_run_has_no_hang(reference_run, tmp_path):
    summary = _analyze(reference_run("clean8"), tmp_path)
    assert [f for f in summary["findings"] if f["analyzer"] == "hang"] == []
    m = summary["metrics"]["hang"]
    assert m["hung"] is False and m["ranks_with_heartbeat"] == 8


# --------------------------------------------------------------------------- failures vs hangs


