"""A job whose work ended (exit 0, every rank at the same step, nothing in flight) but whose
workers were ended without closing their heartbeat — Ray Train's shutdown takes 8-11 s after
the work — is no hang; the same silence with a rank behind, a collective in flight or a failed
exit still is."""

from __future__ import annotations

import json
from pathlib import Path

from trainprof.analyzers import hang as hang_analyzer
from trainprof.rundir.files import write_json_atomic
from trainprof.analysis.run import RunDir


def _hb(t_s, step, event="progress", inflight=()):
    return {"t_ns": int(t_s * 1e9), "event": event, "step": step, "inflight": list(inflight),
            "inflight_count": len(inflight), "fr": None}


def _run(root: Path, steps: dict, status="ok", exit_code=0, inflight=None, end_s=112.0) -> RunDir:
    write_json_atomic(root / "manifest.json", {"schema_version": 1, "status": status,
                                               "exit_code": exit_code,
                                               "end_time": {"ns": int(end_s * 1e9)}})
    for r, last in steps.items():
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        write_json_atomic(d / "meta.json", {"rank": r, "world_size": len(steps)})
        hbs = [_hb(100, 0, "start")] + [_hb(100 + 0.1 * s, s) for s in range(1, last + 1)]
        if inflight and r in inflight:
            hbs.append(_hb(101.3, last, inflight=[inflight[r]]))
        (d / "heartbeat.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hbs))
    return RunDir(root)


def test_workers_ended_after_their_work_is_no_hang(tmp_path):
    # 12 steps on both ranks, then 10.7 s of silence (Ray's shutdown) and exit 0
    res = hang_analyzer.analyze(_run(tmp_path / "ray", {0: 12, 1: 12}))
    assert res.findings == []
    assert res.metrics["hung"] is False and res.metrics["stalled_s"] > 5
    assert "every rank reached step 12" in res.metrics["quiet_end"]


def test_the_same_silence_is_a_hang_when_the_work_did_not_end(tmp_path):
    coll = {"pg": "0", "seq": 40, "op": "all_reduce", "bytes": 4, "enqueue_ns": int(101.3e9)}
    cases = {"behind": dict(steps={0: 12, 1: 9}),                   # rank 1 stopped at step 9
             "in_flight": dict(steps={0: 12, 1: 12}, inflight={0: coll}),
             "failed_exit": dict(steps={0: 12, 1: 12}, status="failed", exit_code=1)}
    for name, kw in cases.items():
        res = hang_analyzer.analyze(_run(tmp_path / name, **kw))
        assert [f.kind for f in res.findings] in (["hang"], ["rank_failure"]), name
        assert res.metrics["hung"] is True and not res.metrics.get("quiet_end"), name
