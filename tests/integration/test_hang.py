"""Hangs: heartbeat, dump-on-trigger, the launcher's watchdog (--hang-timeout/--on-hang), and the
post-mortem (trainprof analyze / trainprof hang) on hung, desynchronized, SIGKILLed and clean runs."""

from __future__ import annotations

from synth import _write_run
import importlib.util
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import run_cli, wait_for, write_script, write_worker_exits
from trainprof.analyzers import hang as hang_analyzer
from trainprof.launch.launcher import HANG_EXIT_CODE
from trainprof.probes.ticker import Ticker
from trainprof.rundir.files import HANG_DUMP, HANG_TRIGGER, write_json_atomic
from trainprof.analysis.run import RunDir
from paths import FIXTURES

HAVE_REFERENCE = importlib.util.find_spec("trainprof.reference.__main__") is not None


# --------------------------------------------------------------------------- probes, in-process


class _Clock:
    step = 0
    start_ns = 0


class _Session:
    def __init__(self, root: Path, rank=0):
        self.run_dir = root
        self.rank = rank
        self.dir = root / "ranks" / f"rank-{rank:05d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.clock = _Clock()
        self.state: dict = {}
        self.closers = []
        self.ticker = Ticker()  # the probes' periodic thread, as in ProbeSession
        self.ticker.start()

    def on_close(self, fn):
        self.closers.append(fn)

    def close(self):
        for fn in self.closers:
            fn()
        self.ticker.stop()


def _lines(path: Path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_heartbeat_appends_only_on_progress(tmp_path, monkeypatch):
    from trainprof.probes import heartbeat

    monkeypatch.setenv(heartbeat.ENV_INTERVAL, "0.05")
    s = _Session(tmp_path)
    heartbeat.attach(s)
    path = s.dir / "heartbeat.jsonl"
    time.sleep(0.4)  # no progress: no new records
    assert [r["event"] for r in _lines(path)] == ["start"]
    s.clock.step = 1
    assert wait_for(lambda: len(_lines(path)) == 2, timeout=5)
    rec = {"step": 1, "pg": "0", "seq": 7, "op": "all_reduce", "bytes": 4, "enqueue_ns": 5,
           "end_ns": None, "blocked_ms": 0}
    s.state["last_collective"] = rec
    s.state["inflight_collectives"] = {1: rec}
    assert wait_for(lambda: len(_lines(path)) == 3, timeout=5)
    last = _lines(path)[-1]
    assert last["step"] == 1 and last["last_collective"]["seq"] == 7
    assert last["inflight"][0]["op"] == "all_reduce" and last["inflight_count"] == 1
    time.sleep(0.3)
    assert len(_lines(path)) == 3  # stuck in that collective: the file stops growing
    s.close()
    assert _lines(path)[-1]["event"] == "close"


def parked_in_collective(ev):  # a frame the dump must show
    ev.wait(30)


def test_trigger_file_makes_every_thread_stack_dump(tmp_path, monkeypatch):
    from trainprof.probes import hang_watchdog, heartbeat

    monkeypatch.setenv(hang_watchdog.ENV_POLL, "0.05")
    trigger = tmp_path / HANG_TRIGGER
    write_json_atomic(trigger, {"id": "stale"})  # older than the rank: ignored
    s = _Session(tmp_path, rank=3)
    s.state["last_collective"] = {"pg": "1", "seq": 4, "op": "broadcast"}
    heartbeat.attach(s)
    hang_watchdog.attach(s)
    ev = threading.Event()
    t = threading.Thread(target=parked_in_collective, args=(ev,), name="worker")
    t.start()
    try:
        dump = s.dir / HANG_DUMP
        time.sleep(0.3)
        assert not dump.exists()
        write_json_atomic(trigger, {"id": "t1"})
        assert wait_for(lambda: dump.exists() and json.loads(dump.read_text())["complete"], 10)
        d = json.loads(dump.read_text())
        assert d["trigger_id"] == "t1" and d["rank"] == 3
        assert d["last_collective"]["op"] == "broadcast"
        worker = next(x for x in d["threads"] if x["name"] == "worker")
        own = [f for f in worker["frames"] if not f["lib"]]
        assert own[-1]["function"] == "parked_in_collective" and own[-1]["code"] == "ev.wait(30)"
        assert worker["frames"][-1]["lib"] is True  # threading.py: library, not the job
        assert any(x["main"] for x in d["threads"])
        assert not any(x["name"] == "trainprof-tick" for x in d["threads"])  # the dumping thread
        assert "file" in d["flight_recorder"] or "error" in d["flight_recorder"]
    finally:
        ev.set()
        t.join()
        s.close()


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


def _hb(t_s, step, event="progress", inflight=(), fr=None):
    return {"t_ns": int(t_s * 1e9), "event": event, "step": step, "inflight": list(inflight),
            "inflight_count": len(inflight), "fr": fr}


def test_clean_and_killed_while_healthy_runs_are_silent(tmp_path):
    clean = {r: [_hb(100, 0, "start"), _hb(101, 1), _hb(102, 2), _hb(102.5, 3, "close")]
             for r in range(2)}
    res = hang_analyzer.analyze(RunDir(_write_run(tmp_path / "clean", clean, end_ns=int(103e9))))
    assert res.findings == [] and res.metrics["hung"] is False
    # SIGKILL in the middle of healthy progress: heartbeats stop less than a second before the end
    killed = {r: [_hb(100, 0, "start"), _hb(101, 1), _hb(102, 2)] for r in range(2)}
    run = _write_run(tmp_path / "killed", killed, status="killed", end_ns=int(102.6e9))
    res = hang_analyzer.analyze(RunDir(run))
    assert res.findings == [] and res.metrics["stalled_s"] == pytest.approx(0.6)
    # no heartbeats at all (probes off): no metrics, no finding
    empty = tmp_path / "empty"
    (empty / "ranks").mkdir(parents=True)
    assert hang_analyzer.analyze(RunDir(empty)).metrics == {}


def test_stall_without_dumps_names_rank_behind_in_flight_counters(tmp_path):
    # Heartbeats only (flight-recorder counters): ranks 0,1,3 enqueued collective #9 of group 0
    # and never completed it; rank 2 is at #8 with nothing in flight. The job was killed 60 s on.
    def hbs(r):
        top = 8 if r == 2 else 9
        return [_hb(100, 0, "start", fr={"0": [0, 0]}), _hb(105, 4, fr={"0": [top, 8]})]

    run = _write_run(tmp_path / "r", {r: hbs(r) for r in range(4)}, status="killed",
                     end_ns=int(165e9))
    res = hang_analyzer.analyze(RunDir(run))
    (f,) = res.findings
    assert f.kind == "hang" and f.ranks == [2] and f.severity == "critical"
    assert f.evidence["culprit"]["reason"] == "never_arrived"
    assert f.evidence["never_arrived"][0]["waiting_ranks"] == [0, 1, 3]
    assert "no rank progressed during the last 60.0 s" in f.evidence["detected_by"][0]


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


def test_dumps_found_in_every_run_directory_analyzed_together(tmp_path):
    """`trainprof analyze node0 node1`: a rank's hang dump and flight recorder are read from the
    directory that holds that rank, the second one included."""
    hbs = [_hb(100, 0, "start"), _hb(101, 1)]
    d0 = _write_run(tmp_path / "node0", {0: hbs}, status="hung", end_ns=int(200e9))
    d1 = _write_run(tmp_path / "node1", {1: hbs}, status="hung", end_ns=int(200e9))
    for d, r in ((d0, 0), (d1, 1)):
        meta = d / "ranks" / f"rank-{r:05d}" / "meta.json"
        write_json_atomic(meta, {"rank": r, "world_size": 2})
        write_json_atomic(meta.parent / "hang-dump.json",
                          {"complete": True, "rank": r,
                           "threads": [{"name": "MainThread", "main": True, "stack": [
                               {"file": "train.py", "line": 10 + r, "function": f"step_{r}"}]}]})
    run = RunDir([d0, d1])
    assert run.rank_path(1).parent.parent == d1
    for r in (0, 1):
        dump = hang_analyzer._read_dump(run, r)
        assert dump is not None and dump["rank"] == r
        assert hang_analyzer.RankView(run, r).dump is not None


# --------------------------------------------------------------------------- failures vs hangs


BOOM = {"kind": "exception", "exc_type": "RuntimeError", "exc": "boom: corrupt batch at step 5",
        "t_ns": int(105.0e9), "thread": "MainThread"}
_COLL = {"pg": "0", "op": "all_reduce", "bytes": 4}


@pytest.mark.parametrize("failure, said", [
    (BOOM, "raised RuntimeError: boom: corrupt batch at step 5 (exited with code 1)"),
    ({"kind": "exit", "exit_code": 7, "t_ns": int(105.0e9)}, "called sys.exit with exit code 7"),
])
def test_crash_is_a_rank_failure_with_its_exception_never_a_hang(tmp_path, failure, said):
    # Rank 1 fails at 105 s while rank 0 waits in the collective rank 1 never issued. Rank 1's
    # heartbeat closed 5.5 s later (as when its probes waited on the dead peer at exit), and the
    # agent stopped rank 0 at 111 s: 6 s without progress, above the 5 s stall threshold, yet
    # the stall is the crash's, not a hang.
    code = failure.get("exit_code", 1)
    r0 = [_hb(100, 0, "start"), _hb(104, 5, inflight=[dict(_COLL, seq=6, step=5)])]
    r1 = [_hb(100, 0, "start"), dict(_hb(104, 5), last_collective=dict(_COLL, seq=5, step=4)),
          dict(_hb(105, 5, "failure"), failure=failure),
          dict(_hb(110.5, 5, "close"), failure=failure)]
    run = _write_run(tmp_path / "r", {0: r0, 1: r1}, status="failed", end_ns=int(111.5e9))
    write_worker_exits(run, 111, {1: code}, {0: -15, 1: code})
    res = hang_analyzer.analyze(RunDir(run))
    (f,) = res.findings
    assert f.kind == "rank_failure" and f.severity == "error" and f.ranks == [1]
    assert res.metrics["hung"] is False and res.metrics["detected_by"] == []
    assert f.message.startswith(f"Rank failure: rank 1 was the first to fail: {said}")
    assert "Hang" not in f.message and "hang" not in f.message.lower()
    assert f.evidence["failures"]["1"]["kind"] == failure["kind"]
    assert res.metrics["stalled_s"] == pytest.approx(1.0)  # until the failure, not the agent's stop


def test_a_real_hang_that_ends_in_a_crash_stays_a_hang(tmp_path):
    # Every rank stopped at 104 s; at 164 s rank 0's collective timed out and raised: 60 s of no
    # progress before the first failure is a hang, the crash its consequence.
    late = dict(BOOM, exc="Timed out waiting 60000ms for recv operation", t_ns=int(164e9))
    r0 = [_hb(100, 0, "start"), _hb(104, 5, inflight=[dict(_COLL, seq=6, step=5)]),
          dict(_hb(164, 5, "failure"), failure=late), dict(_hb(164.1, 5, "close"), failure=late)]
    r1 = [_hb(100, 0, "start"), dict(_hb(104, 5), last_collective=dict(_COLL, seq=5, step=4))]
    run = _write_run(tmp_path / "r", {0: r0, 1: r1}, status="failed", end_ns=int(165e9))
    write_worker_exits(run, 164.5, {0: 1}, {0: 1, 1: -15})
    (f,) = hang_analyzer.analyze(RunDir(run)).findings
    assert f.kind == "hang" and f.severity == "critical"
    assert "no rank progressed during the last 60.0 s" in f.evidence["detected_by"][0]


def test_rank_aborted_for_a_peers_missed_collective_is_the_victim(tmp_path):
    # Rank 1 skipped all_reduce #14 and went on; gloo aborted rank 0 (SIGABRT) while it waited
    # in #14. The culprit is rank 1, who never arrived; rank 0 died first but is the victim.
    r0 = [_hb(100, 0, "start"),
          dict(_hb(103, 7, inflight=[dict(_COLL, seq=14, step=7)]),
               last_collective=dict(_COLL, seq=13, step=6))]
    r1 = [_hb(100, 0, "start"), dict(_hb(103, 7), last_collective=dict(_COLL, seq=13, step=6))]
    run = _write_run(tmp_path / "r", {0: r0, 1: r1}, status="failed", end_ns=int(104e9))
    write_worker_exits(run, 103.5, {0: -6}, {0: -6, 1: -15})
    res = hang_analyzer.analyze(RunDir(run))
    (f,) = res.findings
    c = f.evidence["culprit"]
    assert f.kind == "desync" and f.ranks == [1] and c["reason"] == "never_arrived"
    assert [v["rank"] for v in c["victims"]] == [0]
    assert f.message.startswith("Collective desynchronization: rank 1 never reached collective "
                                "all_reduce #14 of group 0")
    assert "rank 0 was the first to end (killed by SIGABRT (signal 6) while it waited in " \
           "all_reduce #14 of group 0): a victim" in f.message
    assert "Rank failure" not in f.message


def test_rank_that_died_and_never_arrived_is_the_culprit_not_a_victim(tmp_path):
    # The same wait, but rank 1 is the one that died (SIGKILL) before #14: it is the cause.
    r0 = [_hb(100, 0, "start"), dict(_hb(103, 7, inflight=[dict(_COLL, seq=14, step=7)]))]
    r1 = [_hb(100, 0, "start"), dict(_hb(103, 7), last_collective=dict(_COLL, seq=13, step=6))]
    run = _write_run(tmp_path / "r", {0: r0, 1: r1}, status="failed", end_ns=int(104e9))
    write_worker_exits(run, 103.5, {1: -9}, {0: -15, 1: -9})
    (f,) = hang_analyzer.analyze(RunDir(run)).findings
    assert f.kind == "rank_failure" and f.ranks == [1]
    assert f.evidence["culprit"]["reason"] == "died" and "victims" not in f.evidence["culprit"]


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_launcher_killed_without_recording_the_exit_is_said(tmp_path):
    import socket

    hbs = {r: [_hb(100, 0, "start"), _hb(101, 1)] for r in range(2)}
    run = _write_run(tmp_path / "r", hbs, status="running")
    man = json.loads((run / "manifest.json").read_text())
    man.update(launcher_pid=_dead_pid(), host=socket.gethostname(), exit_code=None)
    write_json_atomic(run / "manifest.json", man)
    for r in range(2):  # hang dumps: a hang (the run `timeout -s KILL` ended, wrap included)
        write_json_atomic(run / f"ranks/rank-{r:05d}/hang-dump.json", {"complete": True, "rank": r})
    res = run_cli(["hang", run])
    out = " ".join(res.stdout.split())
    assert res.returncode == 0, res.stderr
    assert "ended without recording the job's exit" in out, out
    assert not [x for x in res.stdout.splitlines() if x.rstrip().endswith("exit code")], res.stdout
    res = run_cli(["analyze", run, "--json", "--no-report"])
    problems = json.loads(res.stdout)["problems"]
    assert [p for p in problems if "manifest.json" in p and "ended without recording" in p], problems


def test_hang_on_a_directory_without_hang_data_exits_3(tmp_path):
    traces = tmp_path / "tb"
    traces.mkdir()
    shutil.copy(FIXTURES / "hta/trace_filter/sampled_rank-0.json.gz",
                traces / "rank-0.pt.trace.json.gz")
    res = run_cli(["hang", traces])
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "profiler trace" in lines[0] and "expected" in lines[0], lines
    assert "heartbeat" in lines[0]
    bare = tmp_path / "bare"  # rank folders without any hang data
    (bare / "ranks/rank-00000").mkdir(parents=True)
    write_json_atomic(bare / "ranks/rank-00000/meta.json", {"rank": 0, "world_size": 1})
    res = run_cli(["hang", bare])
    assert res.returncode == 3 and "1 rank folder(s) without heartbeats" in res.stderr
