"""run.state from what a run directory already holds (manifest, heartbeats), and the watch
snapshot built from the ends of the ranks' files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from trainprof.rundir import state as runstate
from trainprof.analyzers.live import snapshot
from trainprof.rundir.files import rank_dir


def _run(root, nranks=2, manifest=None, beat_age_s=1.0, last_event="progress", steps=50,
         torn=False, behind=None):
    behind = behind or {}
    if manifest is not None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "manifest.json").write_text(json.dumps(manifest))
    now = time.time_ns()
    for r in range(nranks):
        d = rank_dir(root, r)
        d.mkdir(parents=True)
        n = steps - behind.get(r, 0)
        t_end = now - int(beat_age_s * 1e9)
        st = [{"step": s, "start_ns": t_end - (n - s) * 10_000_000,
               "end_ns": t_end - (n - s - 1) * 10_000_000, "dur_ms": 10.0} for s in range(n)]
        (d / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in st))
        hb = [{"t_ns": t_end - 10**9, "event": "progress", "step": n - 2},
              {"t_ns": t_end, "event": last_event, "step": n}]
        text = "".join(json.dumps(x) + "\n" for x in hb)
        if torn:
            text += '{"t_ns": 1, "event": "prog'
        (d / "heartbeat.jsonl").write_text(text)
    return root


def _manifest(pid, **kw):
    return {"schema_version": 1, "kind": "trainprof-run", "status": "running",
            "launcher_pid": pid, "host": socket.gethostname(), **kw}


def test_running_while_the_launcher_lives(tmp_path):
    root = _run(tmp_path / "r", manifest=_manifest(os.getpid()), torn=True)
    st = runstate.state(root)
    assert st["state"] == "running" and st["last_step"] == 50 and "launcher" in st["why"]


def test_stopped_when_the_launcher_died_without_an_end(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that no longer runs
    st = runstate.state(_run(tmp_path / "r", manifest=_manifest(p.pid)))
    assert st["state"] == "stopped" and "gone" in st["why"]


@pytest.mark.parametrize("how", ["manifest", "close"])
def test_ended(tmp_path, how):
    m = _manifest(os.getpid(), status="ok", end_time={"iso": "x", "ns": 1}) if how == "manifest" \
        else None
    st = runstate.state(_run(tmp_path / "r", manifest=m, last_event="close", beat_age_s=500))
    assert st["state"] == "ended"


def test_other_host_judged_by_heartbeat_age(tmp_path):
    m = _manifest(12345, host="some-other-host")
    assert runstate.state(_run(tmp_path / "a", manifest=m, beat_age_s=3))["state"] == "running"
    st = runstate.state(_run(tmp_path / "b", manifest=m, beat_age_s=runstate.LIVE_S + 60))
    assert st["state"] == "stopped" and "no heartbeat" in st["why"]


def test_tail_records_skip_cut_and_torn_lines(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text("".join(json.dumps({"step": i, "pad": "x" * 50}) + "\n" for i in range(1000))
                 + '{"step": 10')
    recs = runstate.tail_records(p, max_bytes=4096)
    assert recs[-1]["step"] == 999 and all(r["step"] == recs[0]["step"] + i for i, r in enumerate(recs))
    assert 40 <= len(recs) < 80


def test_snapshot_worst_first_and_hang(tmp_path):
    root = _run(tmp_path / "r", nranks=40, manifest=_manifest(os.getpid()), beat_age_s=90,
                behind={17: 9, 3: 2})
    snap = snapshot(root, window_s=600)
    assert snap["state"] == "running" and snap["ranks"] == 40
    assert [v["rank"] for v in snap["worst"][:2]] == [17, 3] and snap["worst"][0]["lag"] == 9
    assert snap["step_ms"] == pytest.approx(10.0) and snap["steps_per_s"] == pytest.approx(100, rel=0.05)
    assert snap["hang"] and snap["hang"]["no_progress_s"] >= 89  # 90 s without progress > 60 s
    # the command offered must make the ranks dump (plain `trainprof hang` only reads the files)
    assert f"`trainprof hang {root} --dump`" in snap["hang"]["text"]
    from rich.console import Console

    from trainprof.reports.live import render_watch

    c = Console(record=True, width=100, file=open(os.devnull, "w"))
    c.print(render_watch(snap, rows=5))
    out = c.export_text()
    assert "hang suspected" in out and "35 more ranks" in out and "no analysis yet" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(("17 ", "3 "))]
    assert len(lines) == 2


def test_unknown_without_launcher_record_or_heartbeat(tmp_path):
    d = rank_dir(tmp_path / "r", 0)
    d.mkdir(parents=True)
    (d / "steps.jsonl").write_text(json.dumps({"step": 0, "dur_ms": 1.0}) + "\n")
    assert runstate.state(tmp_path / "r")["state"] == "unknown"


def test_last_step_read_from_the_rotated_file_between_rotation_and_the_next_beat(tmp_path):
    # the heartbeat writer renames heartbeat.jsonl to heartbeat.prev.jsonl past its cap and opens
    # a new file only at the next beat: a reader in between still sees each rank's last step
    root = _run(tmp_path / "r", manifest=_manifest(os.getpid()))
    for r in range(2):
        d = rank_dir(root, r)
        os.replace(d / "heartbeat.jsonl", d / "heartbeat.prev.jsonl")
    st = runstate.state(root)
    assert st["last_step"] == 50 and [x["step"] for x in st["ranks"]] == [50, 50]


def test_watch_piped_is_not_squeezed_and_says_when_no_step_finished(tmp_path):
    # `trainprof watch RUN > file`: the findings' text was folded to ~15 columns (80-column
    # console) and a run without a finished step read "running at step  ("
    from click.testing import CliRunner

    from trainprof.cli import main

    root = tmp_path / "r"
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps(_manifest(os.getpid())))
    (root / "ranks").mkdir()
    out = CliRunner().invoke(main, ["watch", str(root), "--once"]).output
    assert "running, no step finished yet (" in out and "at step  (" not in out
    long = _run(tmp_path / "s", manifest=_manifest(os.getpid()))
    (long / "summary.json").write_text(json.dumps({"findings": [
        {"severity": "warning", "kind": "straggler", "ranks": [1], "onset": {"step": 15},
         "message": "rank 1 is a straggler from step 15 on: its own work takes 6.9 ms a step "
                    "longer than its peers'"}]}))
    out = CliRunner().invoke(main, ["watch", str(long), "--once"]).output
    assert "rank 1 is a straggler from step 15 on: its own work takes 6.9 ms a step" in out, out
