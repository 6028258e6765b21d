"""A job whose end nobody recorded: the launcher still runs (a hang in progress: `trainprof hang`
while it hangs) or was killed with the job by kill -9 (its node record, touched every few
seconds while it lived, dates its death). Ranks stuck long before that point are a hang; a
healthy job killed the same way is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainprof.analyzers import hang as hang_analyzer, live
from trainprof.analysis.run import RunDir
from trainprof.rundir import nodes
from trainprof.rundir.files import write_json_atomic

NODE = "host-1234-abcdef"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _run(root: Path, last_progress_s: float, node_touched_s: float | None, pid: int) -> RunDir:
    """2 ranks that progressed until ``last_progress_s`` (epoch seconds), rank 0 then blocked in
    all_reduce #40 that rank 1 never issued; a launcher record without the job's end (status
    running, pid ``pid`` on this host) and its node record touched at ``node_touched_s``."""
    man = {"schema_version": 2, "kind": "trainprof-run", "node": NODE, "host": nodes._this_host(),
           "launcher_pid": pid, "status": "running", "heartbeat_s": 5.0,
           "start_time": {"ns": int((last_progress_s - 20) * 1e9)}}
    write_json_atomic(root / "manifest.json", man)
    if node_touched_s is not None:
        rec = nodes.node_path(root, NODE)
        rec.parent.mkdir(parents=True)
        write_json_atomic(rec, {k: man[k] for k in ("node", "host", "launcher_pid")})
        os.utime(rec, ns=(int(node_touched_s * 1e9),) * 2)
    t0 = last_progress_s - 2.0
    coll = {"pg": "0", "seq": 40, "op": "all_reduce", "bytes": 4,
            "enqueue_ns": int(last_progress_s * 1e9)}
    for r in (0, 1):
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        write_json_atomic(d / "meta.json", {"rank": r, "world_size": 2})
        hbs = [{"t_ns": int(t0 * 1e9), "event": "start", "step": 0}]
        hbs += [{"t_ns": int((t0 + 0.1 * s) * 1e9), "event": "progress", "step": s,
                 "last_collective": {**coll, "seq": 2 * s - 1, "end_ns": int((t0 + 0.1 * s) * 1e9)}}
                for s in range(1, 20)]
        last = {"t_ns": int(last_progress_s * 1e9), "event": "progress", "step": 20}
        if r == 0:
            last.update(last_collective=coll, inflight=[coll], inflight_count=1)
        hbs.append(last)
        (d / "heartbeat.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hbs))
    return RunDir(root)


def test_killed_with_the_job_long_after_the_ranks_stopped_is_a_hang(tmp_path):
    now = time.time()
    run = _run(tmp_path, last_progress_s=now - 100, node_touched_s=now - 55, pid=_dead_pid())
    res = hang_analyzer.analyze(run)
    assert [f.kind for f in res.findings] == ["hang"]
    m = res.metrics
    assert m["hung"] is True and abs(m["stalled_s"] - 45.0) < 0.01
    assert "the launcher's last sign of life" in m["detected_by"][0]
    assert [(r["rank"], r["state"], r["stalled_s"]) for r in m["ranks"]] == \
        [(0, "in_collective", 45.0), (1, "outside_collective", 45.0)]
    assert "rank 0 waits in all_reduce #40 of group 0" in m["message"]


def test_healthy_job_killed_with_its_launcher_is_no_hang(tmp_path):
    now = time.time()
    run = _run(tmp_path, last_progress_s=now - 100, node_touched_s=now - 99, pid=_dead_pid())
    res = hang_analyzer.analyze(run)
    assert res.findings == [] and res.metrics["hung"] is False
    assert abs(res.metrics["stalled_s"] - 1.0) < 0.01


def test_without_a_node_record_nothing_is_made_up(tmp_path):
    # a killed launcher whose node record is gone: the stall cannot be measured, no hang claimed
    now = time.time()
    res = hang_analyzer.analyze(_run(tmp_path, now - 100, None, pid=_dead_pid()))
    assert res.metrics["hung"] is False and res.metrics["stalled_s"] is None


def test_a_hang_in_progress_while_the_launcher_runs(tmp_path):
    # the launcher is this process: alive; the ranks stopped 90 s ago
    now = time.time()
    pm = hang_analyzer.postmortem(_run(tmp_path, now - 90, now - 1, pid=os.getpid()))
    assert pm["hung"] is True and pm["job"]["running"] is True
    assert 89 < pm["stalled_s"] < 100 and pm["stall_threshold_s"] == live.HANG_MIN_S
    assert "now (the job is still running)" in pm["detected_by"][0]
    assert pm["message"].startswith("Hang in progress (no rank progressed for 9")
    # a running job judged as `trainprof watch` does: 30 s of silence (a checkpoint, an
    # evaluation) is not a hang yet, nor 1 s
    for ago in (30, 1):
        pm = hang_analyzer.postmortem(_run(tmp_path / f"s{ago}", time.time() - ago, None,
                                           pid=os.getpid()))
        assert pm["hung"] is False and pm["stalled_s"] >= ago - 1
