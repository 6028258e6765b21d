"""Steps that overlap trainprof's own work or the job's profiler (meta.json ``overhead_spans``)
are left out of step statistics and slow-step judgement, each list with its reason: the trace
export trainprof runs on its own thread after the profiler window, a NaN replay on one rank
(whose peers wait for it in the next step), the job's own profiler and its exports. A run
directory without the field leaves out only the warm-up and the window, as before; real slow
steps outside the spans are still found.

Hand-built 2-rank runs: each step ends with an all_reduce that ends when the last rank arrives
(collectives.jsonl), so a rank's delay shows in the other's wait."""

from __future__ import annotations

import json

import pytest

from trainprof.analysis.run import RunDir
from trainprof.analyzers import critical_path, slow_steps, step_time, whole_run
from trainprof.rundir.files import rank_dir

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
COMM_MS = 5.0


def make_run(root, own, spans=None, profiled=(), stagger=None):
    """own[rank][step]: ms of the rank's own work, then an all_reduce ending COMM_MS after the
    last rank arrives. stagger[rank][step]: ms the rank's step record starts late (its previous
    step ended late, the collective still common). spans[rank]: meta.json overhead_spans."""
    ranks = sorted(own)
    n = len(own[ranks[0]])
    recs = {r: {"steps": [], "collectives": []} for r in ranks}
    t = T0
    for s in range(n):
        dur = max(own[r][s] for r in ranks) + COMM_MS
        end = t + int(dur * MS)
        for r in ranks:
            enq = t + int(own[r][s] * MS)
            recs[r]["steps"].append({"step": s, "start_ns": t, "end_ns": end, "dur_ms": dur,
                                     "source": "optimizer",
                                     **({"profiled": True} if s in profiled else {})})
            recs[r]["collectives"].append({"step": s, "pg": "0", "seq": s, "op": "all_reduce",
                                           "bytes": 8, "enqueue_ns": enq, "end_ns": end,
                                           "blocked_ms": (end - enq) / MS})
        t = end
    for r in ranks:
        d = rank_dir(root, r)
        d.mkdir(parents=True)
        meta = {"rank": r, "world_size": len(ranks), "host": "node0"}
        if spans and spans.get(r) is not None:
            meta["overhead_spans"] = spans[r]
        (d / "meta.json").write_text(json.dumps(meta))
        for name in ("steps", "collectives"):
            (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs[r][name]))
        (d / "groups.jsonl").write_text(json.dumps({"pg": "0", "ranks": ranks, "size": len(ranks),
                                                    "backend": "gloo"}) + "\n")
    return RunDir(root)


def step_bounds(run, rank, step):
    rec = next(x for x in run.stream(rank, "steps") if x["step"] == step)
    return rec["start_ns"], rec["end_ns"]


def flat(n, ms=30.0):
    return {r: [2000.0] + [ms] * (n - 1) for r in (0, 1)}


def found(run):
    return [f for f in slow_steps.analyze(run).findings if f.kind == "slow_steps"]


def _span(kind, a, b):
    return {"kind": kind, "start_ns": a, "end_ns": b}


def export_case(tmp_path, with_spans=True):
    """Window 3-4 (warm-up 2, collect 5); the trace export runs on beside steps 5-9 and slows
    steps 6-9 to 3-4× the typical step on both ranks (CPU shared with the export thread)."""
    own = flat(40)
    for r in (0, 1):
        own[r][2], own[r][3], own[r][4], own[r][5] = 60.0, 90.0, 90.0, 200.0
        for s, v in zip((6, 7, 8, 9), (120.0, 110.0, 100.0, 90.0)):
            own[r][s] = v
    # the spans' times come from the step records' own clock: build once to read them
    probe = make_run(tmp_path / "probe", own, profiled=(3, 4))
    a = step_bounds(probe, 0, 5)[0] + 20 * MS           # the export starts in step 5 ...
    b = step_bounds(probe, 0, 9)[0] + 40 * MS           # ... and ends inside step 9
    spans = {0: [_span("trace_export", a, b)], 1: [_span("trace_export", a + 2 * MS, b - 3 * MS)]}
    return make_run(tmp_path / "run", own, spans=spans if with_spans else None, profiled=(3, 4))


def test_trace_export_steps_left_out_with_their_reason(tmp_path):
    run = export_case(tmp_path)
    m = step_time.analyze(run).metrics
    assert m["excluded_steps"] == {"warmup": [0], "profiler": [2, 3, 4, 5],
                                   "trace_export": [5, 6, 7, 8, 9]}
    assert "profiler window's trace" in m["excluded_reasons"]["trace_export"]
    # rank 0's span is the longest: from 20 ms into step 5 to 40 ms into step 9
    lens = [(s["end_ns"] - s["start_ns"]) / MS for s in run.rank_meta(0)["overhead_spans"]]
    assert f"; longest {lens[0]:,.0f} ms" in m["excluded_reasons"]["trace_export"]
    assert [p["step"] for p in m["per_step"]] == [1] + list(range(10, 40))
    assert m["job"]["median_ms"] == pytest.approx(35.0)
    assert found(run) == []
    # the analyses over step_time's steps leave them out too
    assert whole_run.analyze(run).metrics["steps"] == 31  # steps 1 and 10-39


def test_trace_export_without_spans_is_the_old_analysis(tmp_path):
    """The same run from an older trainprof (no overhead_spans): only the warm-up and the
    window are left out, and steps 7-9 read as slow steps (what the spans now prevent)."""
    run = export_case(tmp_path, with_spans=False)
    assert step_time.analyze(run).metrics["excluded_steps"] == {"warmup": [0], "profiler": [2, 3, 4, 5]}
    assert "excluded_reasons" in step_time.analyze(run).metrics
    (f,) = found(run)
    assert set(f.evidence["slow_steps"]) >= {7, 8, 9}


def test_nan_replay_on_one_rank_leaves_out_its_step_and_the_peers_wait(tmp_path):
    """Rank 0 replays 300 ms inside step 20 before its optimizer step; rank 1, done with step
    20's collective earlier in this hand-built run, waits for it in step 21's: both steps are
    the replay's, judged by wall clock against every rank's records."""
    own = flat(30)
    own[0][20] = 330.0   # the replay inside rank 0's step 20
    own[1][21] = 30.0
    own[0][21] = 30.0
    probe = make_run(tmp_path / "probe", own)
    a = step_bounds(probe, 0, 20)[0] + 20 * MS
    spans = {0: [_span("nan_replay", a, a + 300 * MS)]}
    # rank 1's step 21 record: starts before the replay ends (its step 20 ended early)
    run = make_run(tmp_path / "run", own, spans=spans)
    rk1 = [json.loads(x) for x in (rank_dir(tmp_path / "run", 1) / "steps.jsonl").read_text().splitlines()]
    s20, s21 = rk1[20], rk1[21]
    s20["end_ns"] = s20["start_ns"] + 40 * MS
    s20["dur_ms"] = 40.0
    s21["start_ns"] = s20["end_ns"]
    s21["dur_ms"] = (s21["end_ns"] - s21["start_ns"]) / MS
    (rank_dir(tmp_path / "run", 1) / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rk1))
    run = RunDir(tmp_path / "run")
    m = step_time.analyze(run).metrics
    assert m["excluded_steps"]["nan_replay"] == [20, 21]
    assert m["excluded_reasons"]["nan_replay"].startswith("trainprof was replaying a step")
    assert "; longest 300 ms" in m["excluded_reasons"]["nan_replay"]
    assert 20 not in [p["step"] for p in m["per_step"]] and found(run) == []
    # without the span (an older run directory) the replay's steps are slow steps
    (rank_dir(tmp_path / "run", 0) / "meta.json").write_text(json.dumps({"rank": 0, "world_size": 2}))
    run = RunDir(tmp_path / "run")
    assert "nan_replay" not in step_time.analyze(run).metrics["excluded_steps"]
    assert [f.evidence["slow_steps"] for f in found(run)] == [[20, 21]]


def test_job_profiler_cycles_and_exports_left_out(tmp_path):
    """The job's scheduled profiler: two cycles, each from its prepare (warm-up) to its stop,
    then the export; a third, still running when the files were last written (end null)."""
    own = flat(40)
    for s in (1, 5, 6, 10):  # prepares and exports: 90-125 ms, as the user's run showed
        own[0][s] = own[1][s] = 110.0
    own[0][36] = own[1][36] = 120.0
    probe = make_run(tmp_path / "probe", own)
    b = {s: step_bounds(probe, 0, s) for s in range(40)}
    spans = {r: [_span("job_profiler", b[1][0] + 10 * MS, b[5][0] + 5 * MS),
                 _span("job_trace_export", b[5][0] + 6 * MS, b[5][0] + 80 * MS),
                 _span("job_profiler", b[6][0] + 10 * MS, b[10][0] + 5 * MS),
                 _span("job_trace_export", b[10][0] + 6 * MS, b[10][0] + 90 * MS),
                 _span("job_profiler", b[36][0] + 10 * MS, None)] for r in (0, 1)}
    run = make_run(tmp_path / "run", own, spans=spans)
    m = step_time.analyze(run).metrics
    assert m["excluded_steps"]["job_profiler"] == list(range(1, 11)) + [36, 37, 38, 39]
    assert m["excluded_reasons"]["job_profiler"].startswith("the job's own profiler")
    assert [p["step"] for p in m["per_step"]] == list(range(11, 36))
    assert found(run) == []
    assert set(critical_path._kept(run, range(40))).isdisjoint({1, 5, 6, 10, 36})


def test_real_slow_steps_outside_the_spans_still_found(tmp_path):
    own = flat(40)
    for s in (20, 30):  # a checkpoint on rank 0, twice, far from the export
        own[0][s] += 300.0
    probe = make_run(tmp_path / "probe", own, profiled=(3, 4))
    a = step_bounds(probe, 0, 5)[0] + 20 * MS
    b = step_bounds(probe, 0, 8)[0] + 10 * MS
    run = make_run(tmp_path / "run", own, spans={0: [_span("trace_export", a, b)],
                                                 1: [_span("trace_export", a, b)]}, profiled=(3, 4))
    assert step_time.analyze(run).metrics["excluded_steps"]["trace_export"] == [5, 6, 7, 8]
    (f,) = found(run)
    assert f.evidence["slow_steps"] == [20, 30] and f.ranks == [0]


def test_malformed_spans_are_problems_and_ignored(tmp_path):
    own = flat(12)
    probe = make_run(tmp_path / "probe", own)
    a, b = step_bounds(probe, 0, 5)
    spans = {0: [{"kind": "nan_replay", "start_ns": "soon", "end_ns": b},   # wrong type
                 {"kind": "nan_replay", "start_ns": b, "end_ns": a},         # ends before it starts
                 {"kind": "someday", "start_ns": a, "end_ns": b}],            # a kind not known
             1: {"kind": "nan_replay"}}                                      # not a list
    run = make_run(tmp_path / "run", own, spans=spans)
    m = step_time.analyze(run).metrics
    assert m["excluded_steps"] == {"warmup": [0], "profiler": []}
    text = "\n".join(run.problems)
    assert '"start_ns" is a string' in text and "overhead_spans" in text
    assert "rank-00001/meta.json" in text and '"overhead_spans" is an object' in text


def test_stragglers_leave_out_the_steps_of_a_ranks_own_trace_export(tmp_path):
    """Rank 1's trace export (its own thread, after its window) slows only rank 1's steps 5-24
    by 25 ms: without the spans that is a straggler episode of rank 1; with them those steps
    are not analysed, as in step_time."""
    from trainprof.analyzers import stragglers

    own = flat(80)
    for s in range(5, 25):
        own[1][s] += 25.0
    probe = make_run(tmp_path / "probe", own)
    a, b = step_bounds(probe, 1, 5)[0] + MS, step_bounds(probe, 1, 24)[1] - MS
    spans = {1: [_span("trace_export", a, b)]}

    def strag(run):
        return [f for f in stragglers.analyze(run).findings if f.kind == "straggler"]

    old = strag(make_run(tmp_path / "old", own))
    assert [f.ranks[0] for f in old] == [1]                    # what the spans now prevent
    run = make_run(tmp_path / "new", own, spans=spans)
    assert strag(run) == []
    kept = stragglers.analyze(run).metrics["steps_analysed"]
    assert not set(range(5, 25)) & set(kept) and {1, 4, 25, 79} <= set(kept)


def test_a_short_run_keeps_the_export_steps_for_its_stragglers(tmp_path):
    """12 steps, window 3-4, the export beside steps 5-9: leaving those out would leave 4 steps;
    a rank slow in every step (here 40 ms) is as slow beside the export, and is still found."""
    from trainprof.analyzers import stragglers

    own = {r: [2000.0] + [30.0 + (40.0 if r == 1 else 0.0)] * 11 for r in (0, 1)}
    probe = make_run(tmp_path / "probe", own, profiled=(3, 4))
    a, b = step_bounds(probe, 0, 5)[0] + MS, step_bounds(probe, 0, 9)[1] - MS
    run = make_run(tmp_path / "run", own, spans={r: [_span("trace_export", a, b)] for r in (0, 1)},
                   profiled=(3, 4))
    res = stragglers.analyze(run)
    assert [f.ranks[0] for f in res.findings if f.kind == "straggler"] == [1]
    assert set(range(6, 10)) <= set(res.metrics["steps_analysed"])  # (5: the window's collect step)
