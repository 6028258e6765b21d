"""The hang analyzer on written run directories: stalls, crashes, victims and culprits, dumps
across directories, launchers gone."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from helpers import run_cli, write_worker_exits
from paths import FIXTURES
from synth import _write_run
from trainprof.analysis.run import RunDir
from trainprof.analyzers import hang as hang_analyzer
from trainprof.rundir.files import write_json_atomic


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
