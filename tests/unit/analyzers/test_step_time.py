"""step_time on hand-built step streams: statistics match hand computation, warm-up and
profiler-window steps are excluded and listed."""

from __future__ import annotations

import pytest

from trainprof.analyzers import step_time
from trainprof.rundir.files import JsonlWriter, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir


def make_run(tmp_path, durations_by_rank, profiled=(), tokens=None):
    for rank, durs in durations_by_rank.items():
        d = rank_dir(tmp_path, rank)
        meta = {"rank": rank, "world_size": len(durations_by_rank)}
        if tokens:
            meta["run_info"] = {"tokens_per_step": tokens}
        write_json_atomic(d / "meta.json", meta)
        w = JsonlWriter(d / "steps.jsonl")
        t = 0
        for i, ms in enumerate(durs):
            rec = {"step": i, "start_ns": t, "end_ns": t + int(ms * 1e6), "dur_ms": ms, "source": "optimizer"}
            if i in profiled:
                rec["profiled"] = True
            w.write(rec)
            t += int(ms * 1e6)
        w.close()
    return RunDir(tmp_path)


def test_statistics_by_hand(tmp_path):
    # step 0 (set-up) is huge and must not count; steps 1..5 are the sample
    run = make_run(tmp_path, {0: [5000, 100, 110, 120, 130, 140], 1: [5000, 100, 100, 125, 130, 150]},
                   tokens=1000)
    m = step_time.analyze(run).metrics
    r0 = next(r for r in m["per_rank"] if r["rank"] == 0)
    assert r0["steps"] == 5 and r0["median_ms"] == 120 and r0["min_ms"] == 100 and r0["max_ms"] == 140
    assert r0["p90_ms"] == pytest.approx(136.0)  # numpy linear interpolation: 130 + 0.6 * 10
    assert r0["spread_pct"] == pytest.approx(100 * 16 / 120)
    # the job's step time is the slowest rank's: [100, 110, 125, 130, 150]
    assert [s["max_ms"] for s in m["per_step"]] == [100, 110, 125, 130, 150]
    assert m["job"]["median_ms"] == 125
    assert m["job"]["tokens_per_s"] == pytest.approx(1000 / 0.125)
    assert m["excluded_steps"] == {"warmup": [0], "profiler": []}
    assert m["step_ms_by_rank"]["1"][0] == 5000  # the heatmap keeps every step


def test_profiler_window_steps_excluded(tmp_path):
    durs = [900, 100, 300, 400, 400, 350, 100, 100, 100]
    run = make_run(tmp_path, {0: durs}, profiled=(3, 4))
    m = step_time.analyze(run).metrics
    assert m["excluded_steps"]["profiler"] == [2, 3, 4, 5]
    assert [s["step"] for s in m["per_step"]] == [1, 6, 7, 8]
    assert m["job"]["median_ms"] == 100


def test_no_steps_no_metrics(tmp_path):
    (tmp_path / "ranks").mkdir()
    assert step_time.analyze(RunDir(tmp_path)).metrics == {}
