"""Multi-node launchers seen from one process: gone launchers on other hosts, the surviving node's
decision, heartbeats of node records."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multinode_shared import HOST


def _node_record(out: Path, node: str, host: str, job: str, pid: int = 4242, creator=False,
                 old: bool = True, **extra) -> Path:
    """A node record as a launcher writes it (and manifest.json when it created the run); old:
    last touched an hour ago (a launcher killed then)."""
    import os

    (out / "nodes").mkdir(parents=True, exist_ok=True)
    base = {"host": host, "launcher_pid": pid, "status": "running", "job_id": job,
            "start_time": {"iso": "2026-01-01T00:00:00+00:00", "ns": 1}, "heartbeat_s": 5.0}
    if creator:
        (out / "manifest.json").write_text(json.dumps(
            {"schema_version": 1, "kind": "trainprof-run", "node": node, **base}))
    p = out / "nodes" / f"{node}.json"
    p.write_text(json.dumps({"kind": "trainprof-node", "node": node, **base, **extra}))
    if old:
        t = time.time() - 3600
        os.utime(p, (t, t))
    return p


class _Touching:
    """Another host's live launcher: its heartbeat touches its record."""

    def __init__(self, path: Path, every: float = 0.05):
        import threading

        self.path, self.every = path, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import os

        while not self.stop.wait(self.every):
            os.utime(self.path)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


def test_rerun_never_joins_a_run_whose_launcher_on_another_host_was_killed(tmp_path,
                                                                           monkeypatch):
    """A rerun with the same job id (shared --out) after the first run's launcher on another
    host was SIGKILLed: its record says "running" forever, and the rerun joined that dead run.
    A launcher touches its record every HEARTBEAT_S; a record of another host that does not
    change while watched for STALE_AFTER_S (this host's clock only) is a gone launcher: refused,
    saying what to do. A live one (its record touched) is joined as before, and --force removes
    only what trainprof wrote."""
    from trainprof.rundir import nodes
    from trainprof.launch import outdir
    from trainprof.launch.launcher import prepare_run_dir

    monkeypatch.setattr(nodes, "STALE_AFTER_S", 0.8)
    out = tmp_path / "run"
    _node_record(out, "gpu7-123-abcdef", "gpu7", "jobk", creator=True)
    (out / "notes.txt").write_text("mine\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    t0 = time.monotonic()
    with pytest.raises(outdir.OutDirError) as err:
        prepare_run_dir(out, False, job_id="jobk")
    assert 0.8 <= time.monotonic() - t0 < 20
    msg = str(err.value)
    assert "job 'jobk' whose launcher is gone: node gpu7-123-abcdef (host gpu7)" in msg, msg
    assert "Use --out NEW_DIR, or --force to remove" in msg
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # a launcher of this host whose process is gone: known at once, without watching
    here = tmp_path / "here"
    _node_record(here, "me-9-abcdef", HOST, "jobk", pid=_dead_pid(), creator=True, old=False)
    monkeypatch.setattr(nodes, "STALE_AFTER_S", 30.0)
    t0 = time.monotonic()
    with pytest.raises(outdir.OutDirError, match="already finished on me-9-abcdef .*--force"):
        prepare_run_dir(here, False, job_id="jobk")
    assert time.monotonic() - t0 < 10
    # the same job on a live launcher of another host: joined, without waiting the full window
    live = tmp_path / "live"
    rec = _node_record(live, "gpu8-5-abcdef", "gpu8", "jobk", creator=True)
    monkeypatch.setattr(nodes, "STALE_AFTER_S", 30.0)
    with _Touching(rec):
        t0 = time.monotonic()
        joined = prepare_run_dir(live, False, job_id="jobk")
    assert joined.joined and time.monotonic() - t0 < 10
    assert len(list((live / "nodes").glob("*.json"))) == 2
    # --force replaces the dead run: its records go, the user's file stays
    monkeypatch.setattr(nodes, "STALE_AFTER_S", 0.8)
    forced = prepare_run_dir(out, True, job_id="jobk")
    assert not forced.joined
    assert (out / "notes.txt").read_text() == "mine\n"
    assert not (out / "nodes" / "gpu7-123-abcdef.json").exists()


def _decide(out: Path, node: str, capsys) -> tuple[bool, str]:
    from types import SimpleNamespace

    from trainprof.cli.wrap import analyzes_here
    from trainprof.launch.launcher import JobResult

    capsys.readouterr()
    res = analyzes_here(out, JobResult(0, None, record=SimpleNamespace(node=node)))
    return res, capsys.readouterr().err


def test_last_surviving_node_analyzes_when_the_other_launchers_are_gone(tmp_path, monkeypatch,
                                                                        capsys):
    """A node's launcher killed: the surviving node said "1 other node(s) still running" and
    nobody analyzed. Now the survivor watches the others' records: all gone (this host: the
    process is gone; another host: the record stopped changing) -> it analyzes, naming them; one
    alive -> that one analyzes when it finishes, and the message names it and the command. A
    node taken for gone that finishes after all analyzes again."""
    from trainprof.rundir import nodes

    monkeypatch.setattr(nodes, "STALE_AFTER_S", 0.8)
    out = tmp_path / "run"
    _node_record(out, "me-1-aaaaaa", HOST, "j", pid=_dead_pid(), creator=True, finished_ns=5,
                 old=False)
    other = _node_record(out, "gpu9-2-bbbbbb", "gpu9", "j")
    # another host's launcher that still heartbeats: it is the last, it analyzes
    with _Touching(other):
        ok, err = _decide(out, "me-1-aaaaaa", capsys)
    assert not ok
    assert "1 other node(s) of this job still running (node gpu9-2-bbbbbb (host gpu9))" in err
    assert f"run `trainprof analyze {out}`" in err
    assert not (out / "nodes" / ".analysis-claim").exists()
    # its launcher killed: its record stops changing; this node is the last one left
    t0 = time.monotonic()
    ok, err = _decide(out, "me-1-aaaaaa", capsys)
    assert ok and 0.8 <= time.monotonic() - t0 < 20
    assert "the launcher of node gpu9-2-bbbbbb (host gpu9) is gone" in err
    claim = json.loads((out / "nodes" / ".analysis-claim").read_text())
    assert claim["node"] == "me-1-aaaaaa" and claim["presumed_dead"] == ["gpu9-2-bbbbbb"]
    # it was alive after all (a stalled file server) and finishes: it analyzes again
    ok, err = _decide(out, "gpu9-2-bbbbbb", capsys)
    assert ok and "taking this node for gone; analyzing again" in err
    # a node not taken for gone does not
    _node_record(out, "gpu10-3-cccccc", "gpu10", "j", finished_ns=7)
    ok, err = _decide(out, "gpu10-3-cccccc", capsys)
    assert not ok and "another node of this job analyzes" in err


def test_surviving_node_of_this_host_decides_at_once(tmp_path, monkeypatch, capsys):
    """A launcher of this host whose process is gone (SIGKILL) is known dead without watching."""
    from trainprof.rundir import nodes

    monkeypatch.setattr(nodes, "STALE_AFTER_S", 30.0)
    out = tmp_path / "run"
    _node_record(out, "me-1-aaaaaa", HOST, "j", pid=_dead_pid(), creator=True, finished_ns=5)
    _node_record(out, "me-2-bbbbbb", HOST, "j", pid=_dead_pid())
    t0 = time.monotonic()
    ok, err = _decide(out, "me-1-aaaaaa", capsys)
    assert ok and time.monotonic() - t0 < 5
    assert f"the launcher of node me-2-bbbbbb (host {HOST}) is gone" in err
    # a live launcher of this host (this process): still running, named, with the command
    (out / "nodes" / ".analysis-claim").unlink()
    _node_record(out, "me-2-bbbbbb", HOST, "j", pid=__import__("os").getpid())
    ok, err = _decide(out, "me-1-aaaaaa", capsys)
    assert not ok and f"node me-2-bbbbbb (host {HOST})" in err and "trainprof analyze" in err


def test_launcher_heartbeat_keeps_its_record_alive_to_other_hosts(tmp_path, monkeypatch):
    """A launcher's Heartbeat touches its node record (never through a symlink): watched from
    another host it is alive; once it stops (the launcher killed), it is dead after
    STALE_AFTER_S."""
    import os

    from trainprof.rundir import nodes

    monkeypatch.setattr(nodes, "STALE_AFTER_S", 0.6)
    out = tmp_path / "run"
    rec = _node_record(out, "gpu3-1-abcdef", "gpu3", "j")
    recs = nodes.read_records(out)
    beat = nodes.Heartbeat(rec, interval=0.05).start()
    try:
        (seen,) = nodes.watch(out, recs).values()
        assert seen["state"] == "alive" and seen["seen_s"] < 0.6
    finally:
        beat.stop.set()
        beat.thread.join()
    (seen,) = nodes.watch(out, recs).values()
    assert seen["state"] == "dead" and seen["seen_s"] >= 0.6
    # a symlink in its place: the file it points to is never touched
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("x")
    t = time.time() - 3600
    os.utime(theirs, (t, t))
    rec.unlink()
    rec.symlink_to(theirs)
    beat = nodes.Heartbeat(rec, interval=0.02).start()
    time.sleep(0.2)
    beat.stop.set()
    beat.thread.join()
    assert abs(theirs.stat().st_mtime - t) < 1
