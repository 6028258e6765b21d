"""Detail windows around anomalies (probes/detail_windows.py): the probe driven in-process on two
synchronous ranks whose ring moves on; a slow step, a step-time jump and a NaN each keep the
collective detail of WINDOW_STEPS steps before and after them, which the analysis reads as
detail for those steps (collectives matched across ranks, run.resolution); the number of
windows and their bytes stay within the budget, the oldest dropped and counted."""

from __future__ import annotations

import json

import pytest

from trainprof.probes import compact
from trainprof.probes import detail_windows as dw
from trainprof.rundir import compact as fmt

T0 = 10**18
N_STEPS = 600


def _feed(root, rank, durs_ms, nan_steps=(), budget=64 * 2**20, ring_cap=20_000,
          ops=("all_reduce", "barrier")):
    d = root / "ranks" / f"rank-{rank:05d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"rank": rank, "world_size": 2, "host": "a"}))
    (d / "groups.jsonl").write_text(json.dumps({"pg": "0", "ranks": [0, 1], "backend": "gloo",
                                                "size": 2}) + "\n")
    store = compact.CompactStore(d, budget=budget)
    sw = store.ring_writer(d / "steps.jsonl", "steps")
    cw = store.ring_writer(d / "collectives.jsonl", "collectives")
    nw = store.ring_writer(d / "nan.jsonl", "nan")
    cw.cap = ring_cap  # the ring holds the last ~25 steps
    t = T0
    for s, dur in enumerate(durs_ms):
        start, t = t, t + int(dur * 1e6)
        cw.write_records([{"step": s, "pg": "0", "seq": len(ops) * s + i, "op": op, "bytes": 64,
                           "enqueue_ns": start + 100_000 * (i + 1),
                           "end_ns": start + 100_000 * (i + 1) + 20_000, "blocked_ms": 0.02,
                           "device_ms": None} for i, op in enumerate(ops)])
        if s in nan_steps:
            nw.write({"kind": "nonfinite", "step": s, "phase": "backward"}, urgent=True)
        sw.write({"step": s, "start_ns": start, "end_ns": t, "source": "optimizer"}, urgent=True)
        cw.flush()
        store.flush()
    store.close()
    for w in (sw, cw, nw):
        w.close()
    return d, store


def _state(d):
    return json.loads((d / "compact" / "state.json").read_text())["detail_windows"]


@pytest.fixture(scope="module")
def anomalies(tmp_path_factory):
    """Steps of 2 ms; step 150 takes 50 ms (slow step); from step 300 on 5 ms (a jump);
    a NaN detected at step 450."""
    root = tmp_path_factory.mktemp("win")
    durs = [50.0 if s == 150 else 5.0 if s >= 300 else 2.0 for s in range(N_STEPS)]
    ds = [_feed(root, r, durs, nan_steps=(450,))[0] for r in (0, 1)]
    return root, ds


def test_windows_around_each_anomaly_are_kept_after_the_ring_moved_on(anomalies):
    root, ds = anomalies
    W = dw.WINDOW_STEPS
    for d in ds:
        st = _state(d)
        got = [(w["first"], w["last"], [a["kind"] for a in w["anomalies"]]) for w in st["windows"]]
        # slow step at 150; the jump is judged at 304 (5 of the last 8 steps at 5 ms), anchored
        # at its first 5 ms step, 300; the NaN at 450
        assert got == [(150 - W, 150 + W, ["slow_step"]), (300 - W, 304 + W, ["step_time_jump"]),
                       (450 - W, 450 + W, ["nan"])], got
        assert all(w["closed"] and not w["truncated"] for w in st["windows"])
        assert st["dropped"] == 0
        for w in st["windows"]:
            steps = {json.loads(x)["step"] for x in (d / "compact" / w["file"]).read_text().splitlines()}
            assert set(range(w["first"], w["last"] + 1)) <= steps
        ring = [json.loads(x)["step"] for p in ("collectives.prev.jsonl", "collectives.jsonl")
                for x in (d / p).read_text().splitlines()]
        assert min(ring) > 450 + W  # the ring moved on: only the windows hold those steps


def test_the_analysis_reads_the_windows_as_detail_for_those_steps(anomalies):
    from trainprof.analysis.run import RunDir
    from trainprof.analyzers import collectives as coll

    root, _ = anomalies
    run = RunDir(root)
    W = dw.WINDOW_STEPS
    c = run.collectives()
    windows = [(150 - W, 150 + W), (300 - W, 304 + W), (450 - W, 450 + W)]
    held = set(c["step"].astype(int))
    for a, b in windows:
        assert set(range(a, b + 1)) <= held
    ring_first = min(s for s in held if s > 450 + W)
    assert held == {s for a, b in windows for s in range(a, b + 1)} | set(range(ring_first, N_STEPS))
    # every rank holds the same steps: each collective of a window step matched on both ranks
    inst = coll._instances(coll._frame(run))
    w = inst[inst["step"] < ring_first]
    assert len(w) == 2 * sum(b - a + 1 for a, b in windows) and (w["members"] == 2).all()
    res = run.resolution()
    assert res["windows"]["steps"] == [list(x) for x in windows]
    assert {(x["kind"], x["step"]) for x in res["windows"]["anomalies"]} == {
        ("slow_step", 150), ("step_time_jump", 304), ("nan", 450)}
    assert "around anomalies for steps 142-158, 292-312, 442-458" in res["text"]
    # the ring's own detail, as before (its first step may be partial: a rotation mid-step)
    assert ring_first - 1 <= res["detail"]["steps"][0] <= ring_first
    assert not run.problems


def test_windows_stay_within_their_budget_oldest_dropped(tmp_path):
    """A slow step every 40 steps: 14 anomalies, MAX_WINDOWS kept (the first, the onset of
    its kind, and the newest), the rest dropped and counted; every window within its bytes and
    all within WINDOWS_SHARE."""
    budget = 2 * 2**20
    durs = [40.0 if s % 40 == 39 else 2.0 for s in range(N_STEPS)]
    d, store = _feed(tmp_path, 0, durs, budget=budget)
    st = _state(d)
    slow = [s for s in range(N_STEPS) if s % 40 == 39]
    assert len(st["windows"]) == dw.MAX_WINDOWS
    assert st["dropped"] == len(slow) - dw.MAX_WINDOWS
    assert st["dropped_by_kind"] == {"slow_step": len(slow) - dw.MAX_WINDOWS}
    kept = slow[:1] + slow[-(dw.MAX_WINDOWS - 1):]
    assert [w["anomalies"][0]["step"] for w in st["windows"]] == kept
    assert [w["onset"] for w in st["windows"]] == [True] + [False] * (dw.MAX_WINDOWS - 1)
    files = sorted(p.name for p in (d / "compact").iterdir() if fmt.WINDOW_RE.fullmatch(p.name))
    assert files == sorted(w["file"] for w in st["windows"])
    sizes = [(d / "compact" / f).stat().st_size for f in files]
    assert max(sizes) <= st["window_bytes"]
    assert sum(sizes) <= budget * compact.WINDOWS_SHARE


def test_the_onset_window_survives_later_noise(tmp_path):
    """A rank whose step time jumps at step 100 (a straggler's onset), then a noisy host: a
    slow step every 30 steps from 160 on, far more windows than MAX_WINDOWS. The window around
    the jump is kept (its steps' detail still on disk), the slow steps' first one too, the
    other slow steps' oldest windows dropped and counted by kind."""
    durs = [(4.0 if s >= 100 else 2.0) * (10 if s >= 160 and s % 30 == 0 else 1)
            for s in range(N_STEPS)]
    d, _ = _feed(tmp_path, 0, durs)
    st = _state(d)
    ws = st["windows"]
    assert len(ws) == dw.MAX_WINDOWS
    jump = [w for w in ws if w["anomalies"][0]["kind"] == "step_time_jump"]
    assert len(jump) == 1 and jump[0]["onset"]
    assert jump[0]["first"] <= 100 <= jump[0]["last"]
    recs = [json.loads(x) for x in (d / "compact" / jump[0]["file"]).read_text().splitlines()]
    assert {r["step"] for r in recs} >= set(range(100 - dw.WINDOW_STEPS + 1, 100 + dw.WINDOW_STEPS))
    slow = [w["anomalies"][0]["step"] for w in ws if w["anomalies"][0]["kind"] == "slow_step"]
    noisy = [s for s in range(160, N_STEPS) if s % 30 == 0]
    assert slow == noisy[:1] + noisy[-(dw.MAX_WINDOWS - 2):]
    assert st["dropped"] == st["dropped_by_kind"]["slow_step"] == len(noisy) - (dw.MAX_WINDOWS - 1)
    assert sum(w["onset"] for w in ws) == 2


def test_a_window_past_its_bytes_is_cut_and_said(tmp_path):
    """A budget whose window share holds a few steps only (1 MB: 7.7 KB a window; 12
    collectives a step, ~1.3 KB): the window is truncated (said in state.json) and the reader
    takes its whole steps only."""
    from trainprof.analysis.run import RunDir

    durs = [60.0 if s == 200 else 2.0 for s in range(300)]
    d, _ = _feed(tmp_path, 0, durs, budget=2**20, ops=("all_reduce",) * 12)
    (d / "meta.json").write_text(json.dumps({"rank": 0, "world_size": 1, "host": "a"}))
    st = _state(d)
    (w,) = st["windows"]
    assert w["truncated"] and w["closed"] and w["bytes"] <= st["window_bytes"]
    recs = [json.loads(x) for x in (d / "compact" / w["file"]).read_text().splitlines()]
    top = max(r["step"] for r in recs)
    assert top < w["last"]
    run = RunDir(tmp_path)
    held = set(run.collectives()["step"].astype(int))
    assert set(range(w["first"], top)) <= held and top not in held  # its last step may be cut


def test_the_timeline_shows_the_windows_steps_with_their_collectives(anomalies):
    from trainprof.analysis.run import RunDir
    from trainprof.analyzers import _timeline

    root, _ = anomalies
    m = _timeline.build(RunDir(root), profiler=False, critical=False)
    meta = m["meta"]
    for s in (150, 304, 450):  # around each anomaly (±2), with no finding to point there
        assert set(range(s - 2, s + 3)) <= set(meta["steps"]), meta["steps_selection"]
    assert "detail windows" in meta["steps_selection"]
    # the collectives of those steps are on the timeline (2 a step on each of the 2 ranks; the
    # first analysed step, also shown, has no detail left)
    W = dw.WINDOW_STEPS
    detail = [s for s in meta["steps"] if any(a <= s <= b for a, b in (
        (150 - W, 150 + W), (300 - W, 304 + W), (450 - W, 450 + W)))]
    assert len(detail) == len(meta["steps"]) - 1
    pg = [x for x in m["slices"] if str(x[1]).startswith("pg ")]
    assert len(pg) == 2 * 2 * len(detail), (len(pg), meta["steps"])


def test_wrap_force_counts_window_files_as_trainprofs_own(anomalies):
    """`wrap --force` removes a previous run's files that follow trainprof's layout: the detail
    windows too (trainprof/launch/outdir.py); a stranger's file beside them is not ours."""
    from trainprof.launch.outdir import layout_files

    root, ds = anomalies
    (ds[0] / "compact" / "notes.txt").write_text("mine")
    try:
        ours, other = layout_files(root)
    finally:
        (ds[0] / "compact" / "notes.txt").unlink()
    wins = [p for p in ours if fmt.WINDOW_RE.fullmatch(p.rsplit("/", 1)[-1])]
    assert len(wins) == 6  # 3 windows on each of the 2 ranks
    assert [p for p in other if p.endswith("notes.txt")]
