"""A rank that raised the same error as the first one, 0.14 s later, before the torchrun agent
stopped it, is said so, not "the launcher then ended" it; a rank that recorded no failure is
the launcher's."""

from __future__ import annotations

import json

from helpers import write_worker_exits
from trainprof.analyzers import hang as hang_analyzer
from trainprof.rundir.files import write_json_atomic
from trainprof.analysis.run import RunDir

BOOM = {"kind": "exception", "exc_type": "ValueError", "exc": "bad shape (4, 3)", "t_ns": int(105.0e9)}


def _hb(t_s, step, event="progress", **kw):
    return {"t_ns": int(t_s * 1e9), "event": event, "step": step, "inflight": [],
            "inflight_count": 0, "fr": None, **kw}


def _write(root, ranks: dict):
    write_json_atomic(root / "manifest.json", {"schema_version": 1, "status": "failed",
                                               "exit_code": 1, "end_time": {"ns": int(106e9)}})
    for r, hbs in ranks.items():
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        write_json_atomic(d / "meta.json", {"rank": r, "world_size": len(ranks)})
        (d / "heartbeat.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hbs))
    write_worker_exits(root, 105.5, {0: 1}, {0: 1, **{r: -15 for r in ranks if r}})
    return RunDir(root)


def _failing(t_s, f):
    return [_hb(100, 0, "start"), _hb(104, 5), _hb(t_s, 5, "failure", failure=dict(f, t_ns=int(t_s * 1e9)))]


def test_same_error_later_is_said_and_the_launchers_stop_only_for_the_others(tmp_path):
    other = dict(BOOM, exc_type="RuntimeError", exc="gloo: connection closed by peer")
    run = _write(tmp_path, {0: _failing(105.0, BOOM), 1: _failing(105.14, BOOM),
                            2: _failing(105.2, other), 3: [_hb(100, 0, "start"), _hb(104, 5)]})
    (f,) = hang_analyzer.analyze(run).findings
    assert f.kind == "rank_failure" and f.ranks == [0]
    assert "rank 1 raised the same error 0.14 s later, before the launcher stopped it" in f.message
    assert "rank 2 failed too 0.20 s later: raised RuntimeError: gloo: connection closed" in f.message
    assert "the launcher then ended rank 3" in f.message
    assert "ended rank 1" not in f.message and "ranks 1" not in f.message


def test_peers_progress_after_the_first_failure_is_no_negative_stall(tmp_path):
    # rank 1 finished its step 0.7 s after rank 0 raised (and before the launcher stopped it):
    # the job did not stall before it ended; the evidence says 0 s, never "-0.7 s"
    run = _write(tmp_path, {0: _failing(105.0, BOOM),
                            1: [_hb(100, 0, "start"), _hb(104, 5), _hb(105.7, 6)]})
    res = hang_analyzer.analyze(run)
    (f,) = res.findings
    assert f.kind == "rank_failure" and f.ranks == [0]
    assert f.evidence["stalled_s"] == 0.0
    assert res.metrics["stalled_s"] == 0.0
    assert {r["rank"]: r["stalled_s"] for r in res.metrics["ranks"]} == {0: 1.0, 1: 0.0}  # rank 0: 104 s -> 105 s
