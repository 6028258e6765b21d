"""Arrival lateness and the waits it explains for steps the per-collective ring no longer holds,
from the compact per-step records (analyzers/_lateness.py compact_*), against hand-computed
values: two ranks on two hosts (rank 1's clock 7 ms behind, said by its clock probe), rank 1
arriving 4 ms late at every collective from step 100 on; the ring holds only the last steps."""

from __future__ import annotations

import json

import pytest

from trainprof.probes import compact

T0 = 10**18
STEP_NS = 30_000_000
LATE_NS = 4_000_000
ONSET = 100
N = 400
CLOCK_BEHIND_NS = 7_000_000  # rank 1's clock reads true − 7 ms


def _write_rank(root, rank, late_from=ONSET, ring_cap=20_000):
    d = root / "ranks" / f"rank-{rank:05d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"rank": rank, "world_size": 2,
                                             "host": "a" if rank == 0 else "b"}))
    (d / "groups.jsonl").write_text(json.dumps({"pg": "0", "ranks": [0, 1], "backend": "gloo",
                                                "size": 2, "mesh_dim": None}) + "\n")
    skew = -CLOCK_BEHIND_NS if rank == 1 else 0
    if rank == 1:  # the clock probe: aligned = local + offset
        (d / "clock.jsonl").write_text("".join(json.dumps(
            {"t_ns": T0 + t + skew, "offset_ns": CLOCK_BEHIND_NS, "uncertainty_ns": 20_000}) + "\n"
            for t in (0, N * STEP_NS)))
    store = compact.CompactStore(d, budget=64 * 2**20)
    sw = store.ring_writer(d / "steps.jsonl", "steps")
    cw = store.ring_writer(d / "collectives.jsonl", "collectives")
    cw.cap = ring_cap  # a small ring: the detail holds the last ~25 steps only
    for s in range(N):
        base = T0 + s * STEP_NS
        late = LATE_NS if s >= late_from else 0
        recs = []
        for i, op in enumerate(["all_reduce", "all_reduce", "broadcast"]):
            t = base + 1_000_000 * (i + 1)  # true arrival of rank 0
            enq = t + (late if rank == 1 else 0)
            end = t + late + 50_000  # every member leaves 50 µs after the last one arrived
            recs.append({"step": s, "pg": "0", "seq": 3 * s + i, "op": op, "bytes": 400,
                         "enqueue_ns": enq + skew, "end_ns": end + skew,
                         "blocked_ms": (end - enq) / 1e6, "device_ms": None})
        cw.write_records(recs)
        sw.write({"step": s, "start_ns": base + skew, "end_ns": base + STEP_NS + skew,
                  "source": "optimizer"})
        sw.flush()
        cw.flush()
        store.flush()
    store.close()
    sw.close()
    cw.close()


@pytest.fixture(scope="module")
def late_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("late")
    for r in (0, 1):
        _write_rank(root, r)
    return root


def test_compact_lateness_matches_hand_computed_values(late_run):
    from trainprof.analysis.run import RunDir
    from trainprof.analyzers import _align, _lateness

    run = RunDir(late_run)
    detail_first = int(run.collectives()["step"].min())
    assert detail_first > ONSET + 50  # the ring moved on: older steps only in the compact records
    cf = _lateness.compact_frame(run)
    assert cf["complete"].all() and set(cf["op"]) == {"all_reduce", "broadcast"}
    cf = cf.assign(late=_lateness.compact_lateness(cf))
    at = cf.set_index(["rank", "step", "op"])["late"]
    # the 7 ms clock skew is taken out by the alignment, which also moves rank 1 within its
    # probe's ±20 µs (here: by nothing, the bounds are no tighter): any shift is in the lateness
    info = _align.align(run).info[1]
    shift = info.get("shift_us", 0.0) / 1e3
    assert abs(shift) <= info["uncertainty_us"] / 1e3 + 1e-9 and info["uncertainty_us"] <= 20
    # before the onset nobody is late
    assert at[(1, 50, "all_reduce")] == pytest.approx(0.0 - shift, abs=1e-3)
    assert at[(0, 50, "broadcast")] == pytest.approx(0.0 + shift, abs=1e-3)
    # after it rank 1 is 4 ms late at each kind, rank 0 4 ms early (2 ranks: the plain gap)
    for op in ("all_reduce", "broadcast"):
        assert at[(1, 150, op)] == pytest.approx(4.0 - shift, abs=1e-3)
        assert at[(0, 150, op)] == pytest.approx(-4.0 + shift, abs=1e-3)
    # the waits rank 1 explains on rank 0: per collective min(4.05 ms blocked, 4 ms gap), 3 a step
    w = _lateness.compact_waits(cf, 1, [150])
    assert w.groupby("rank")["caused"].sum()[0] == pytest.approx(3 * (4.0 - shift), abs=1e-3)
    assert w.set_index("op")["caused"]["all_reduce"] == pytest.approx(2 * (4.0 - shift), abs=1e-3)
    assert len(w) == 2  # one row per (step, group, kind) of the waiter
    assert _lateness.compact_waits(cf, 1, [50])["caused"].sum() == pytest.approx(0.0, abs=1e-3)


def test_stragglers_use_compact_lateness_where_the_ring_has_moved_on(late_run):
    from trainprof.analysis.run import RunDir
    from trainprof.analyzers import stragglers

    run = RunDir(late_run)
    res = stragglers.analyze(run)
    late = res.metrics["late_ms_by_rank"]
    steps = res.metrics["steps"]
    col = {s: i for i, s in enumerate(steps)}
    # (within the alignment's residual, ±20 µs here; exact values: the test above)
    assert late["1"][col[150]] == pytest.approx(4.0, abs=0.02)  # compact (ring moved on)
    assert late["1"][col[50]] == pytest.approx(0.0, abs=0.02)
    assert late["1"][col[N - 2]] == pytest.approx(4.0, abs=0.02)  # detail (the ring)
    f = [x for x in res.findings if x.kind == "straggler"]
    assert len(f) == 1 and f[0].ranks == [1], [x.message for x in res.findings]
    ev = f[0].evidence
    assert ev["episode"]["first"] == pytest.approx(ONSET, abs=2)
    # its peer waits 12 ms a step for it (median over the episode: mostly compact-only steps)
    assert ev["waits_caused_ms"]["0"] == pytest.approx(12.0, abs=0.01)
    assert ev["waiters"] == [0]
