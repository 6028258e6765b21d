"""Problems found with their onset (and end): synthetic run directories whose ground truth is
the generator's parameters (the analyzers never see them)."""

from __future__ import annotations

import json
import warnings
from datetime import datetime

import numpy as np
import pytest

from trainprof.analysis.runner import analyze
from trainprof.analyzers import _changepoint as cp
from trainprof.analyzers import stragglers, whole_run
from trainprof.rundir.files import rank_dir
from trainprof.analysis.run import RunDir

T0 = 1_700_000_000_000_000_000
MS = 1_000_000


def make_run(root, steps=2000, nranks=2, step_ms=10.0, sd=0.6, slow=None, seed=0,
             memory=None, group_ms=None, profiled=(), first_step=0):
    """Synchronous job: each rank works busy(r, s) = 6 ms ± sd (+ slow[r](s) ms), then waits in
    one all_reduce for the last rank to arrive; the step lasts the slowest rank's work plus
    2 ms of communication (plus group_ms(s) for every rank: the whole job slowed).
    memory[r](s): rss_bytes per step."""
    rng = np.random.default_rng(seed)
    slow = slow or {}
    busy = 6.0 + rng.normal(0, sd, (nranks, steps))
    for r, f in slow.items():
        busy[r] += np.array([f(s) for s in range(steps)])
    busy = np.clip(busy, 0.5, None)
    extra = np.array([group_ms(s) if group_ms else 0.0 for s in range(steps)])
    dur = busy.max(axis=0) + 2.0 + extra
    start = T0 + np.concatenate([[0], np.cumsum(dur[:-1])]) * MS
    for r in range(nranks):
        d = rank_dir(root, r)
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"rank": r, "world_size": nranks, "host": f"h{r}"}))
        st, co, mem = [], [], []
        for s in range(steps):
            t = int(start[s])
            st.append({"step": first_step + s, "start_ns": t, "end_ns": t + int(dur[s] * MS),
                       "dur_ms": float(dur[s]), "source": "optimizer",
                       **({"profiled": True} if s in profiled else {})})
            enq = t + int((busy[r, s] + extra[s]) * MS)
            co.append({"step": first_step + s, "pg": "0", "seq": s, "op": "all_reduce", "bytes": 8,
                       "enqueue_ns": enq, "end_ns": t + int(dur[s] * MS),
                       "blocked_ms": float(dur[s] - busy[r, s] - extra[s])})
            if memory:
                mem.append({"step": s, "t_ns": t, "device": "cpu", "rss_bytes": int(memory[r](s))})
        files = {"steps": st, "collectives": co,
                 "groups": [{"pg": "0", "ranks": list(range(nranks)), "mesh_dim": None,
                             "backend": "gloo", "size": nranks}]}
        if mem:
            files["memory"] = mem
        for name, recs in files.items():
            (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    return RunDir(root)


def _kinds(findings, kind):
    return [f for f in findings if f.kind == kind]


def test_changepoint_finds_a_level_shift_exactly():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0, 1, 700), rng.normal(4, 1, 300)])
    x[100] += 40  # an isolated spike: removed by the running median, not a segment
    segs, _ = cp.segments(x, min_size=10)
    cuts = [a for a, _, _ in segs[1:]]
    assert len(segs) == 2 and cuts == [pytest.approx(700, abs=3)], segs
    # 100,000 points: block means first, the cut refined at full resolution
    y = np.concatenate([rng.normal(0, 1, 62_345), rng.normal(3, 1, 37_655)])
    segs, _ = cp.segments(y, min_size=100)
    assert [a for a, _, _ in segs[1:]] == [pytest.approx(62_345, abs=25)]


@pytest.mark.parametrize("onset,until", [(1000, None), (2400, None), (1000, 1600)])
def test_midrun_straggler_found_with_onset_and_waits(tmp_path, onset, until):
    steps = 4000 if onset == 2400 else 2000  # 50 % of 2,000 steps; 40 % of 4,000; a stretch
    run = make_run(tmp_path, steps=steps,
                   slow={1: lambda s: 6.0 if onset <= s < (until or 1 << 30) else 0.0})
    res = stragglers.analyze(run)
    (f,) = _kinds(res.findings, "straggler")
    assert f.ranks == [1]
    assert abs(f.onset["step"] - onset) <= 0.01 * steps, f.onset
    assert f.onset["time"] and datetime.fromisoformat(f.onset["time"])
    if until:
        assert f.end is not None and abs(f.end["step"] - until) <= 0.01 * steps, f.end
        assert "to step" in f.message
    else:
        assert f.end is None and "on:" in f.message
    # the waits of rank 0 in those steps are attributed to rank 1: ~6 ms per step of its stretch
    assert f.evidence["waiters"] == [0]
    assert f.evidence["waiters_wait_ms"] == pytest.approx(6.0, abs=1.0)
    assert f.evidence["episode"]["excess_ms"] == pytest.approx(6.0, abs=1.0)


@pytest.mark.parametrize("onset,profiled", [(15, (3, 4)), (11, ())])
def test_short_run_straggler_from_step_n_on(tmp_path, onset, profiled):
    """40 steps, rank 1 slow by 30 ms from step ``onset`` on: with the warm-up (and the profiled
    steps 2-5) excluded, the onset is the 11th analysed step, within the run's first min_len
    (10) analysed steps. The whole-run test alone calls it chronic; it started during the run:
    "from step N on", its excess and waits over the steps from N."""
    run = make_run(tmp_path, steps=40, profiled=profiled,
                   slow={1: lambda s: 30.0 if s >= onset else 0.0})
    (f,) = _kinds(stragglers.analyze(run).findings, "straggler")
    assert f.ranks == [1] and f.onset["step"] == onset and f.end is None
    assert f"is a straggler from step {onset} on: " in f.message
    assert "chronic" not in f.message
    assert f"in {40 - onset} of {40 - onset} analysed steps of that stretch" in f.message
    assert f.evidence["episode"]["first"] == onset
    assert f.evidence["excess_ms"] == pytest.approx(30.0, abs=2.0)
    assert f.evidence["waiters_wait_ms"] == pytest.approx(30.0, abs=2.0)


def test_short_run_straggler_from_the_start_is_chronic(tmp_path):
    run = make_run(tmp_path, steps=40, profiled=(3, 4), slow={1: lambda s: 30.0})
    (f,) = _kinds(stragglers.analyze(run).findings, "straggler")
    assert f.ranks == [1] and "is a chronic straggler: " in f.message
    assert f.onset["step"] == 1 and "from step" not in f.message


def test_midrun_straggler_waits_not_subtracted_outside_the_window(tmp_path):
    run = make_run(tmp_path, steps=2000, slow={1: lambda s: 6.0 if s >= 1000 else 0.0})
    w = stragglers.waits_for_stragglers(run)  # no profiler window: spread over the run
    assert w["late"] == [1]
    assert w["wait_ms"][0] == pytest.approx(6.0 * 1000 / 1999, abs=0.6)


@pytest.mark.parametrize("window,counted", [((1500, 1501), True), ((3, 4), False)])
def test_midrun_straggler_waits_counted_where_the_profiled_window_is(tmp_path, window, counted):
    # exposed_comm judges the profiled window: the straggler's waits count there only when the
    # window falls inside its stretch, at the stretch's rate per step
    run = make_run(tmp_path, steps=2000, slow={1: lambda s: 6.0 if s >= 1000 else 0.0},
                   profiled=window)
    w = stragglers.waits_for_stragglers(run)
    if counted:
        assert w["late"] == [1] and w["wait_ms"][0] == pytest.approx(6.0, abs=1.0)
    else:
        assert w == {"late": [], "wait_ms": {}}


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.long) for s in (1, 2))])
def test_clean_long_run_silent(tmp_path, seed):
    # 3,000 steps, noise 10 % of the work, occasional slow steps on either rank (a shared host)
    rng = np.random.default_rng(100 + seed)
    hiccups = {int(s): float(rng.uniform(3, 20)) for s in rng.choice(3000, 60, replace=False)}
    run = make_run(tmp_path, steps=3000, sd=0.6 + 0.2 * seed, seed=seed,
                   slow={seed % 2: lambda s: hiccups.get(s, 0.0)})
    s = analyze(run)
    bad = [f for f in s["findings"] if f["severity"] != "info"]
    assert not bad, [f["message"] for f in bad]
    assert not [f for f in s["findings"] if "onset" in f]


def test_throughput_drop_with_onset_and_end(tmp_path):
    run = make_run(tmp_path, steps=2000, group_ms=lambda s: 8.0 if 1200 <= s < 1700 else 0.0)
    res = whole_run.analyze(run)
    (f,) = _kinds(res.findings, "throughput_drop")
    assert abs(f.onset["step"] - 1200) <= 20 and abs(f.end["step"] - 1700) <= 20
    assert f.ranks == [] and f.severity == "info"  # every rank alike: no straggler to name
    assert f.evidence["step_ms"] == pytest.approx(f.evidence["baseline_ms"] + 8.0, abs=1.0)
    m = res.metrics
    assert len(m["bins"]) <= whole_run.MAX_BINS and m["bins"][0]["first"] == 1
    rates = [b["steps_per_s"] for b in m["bins"]]
    assert min(rates) < 0.7 * max(rates)


def test_memory_growth_with_onset(tmp_path):
    base = 500 << 20
    run = make_run(tmp_path, steps=1000, memory={
        0: lambda s: base, 1: lambda s: base + max(0, s - 400) * (512 << 10)})
    res = whole_run.analyze(run)
    (f,) = _kinds(res.findings, "memory_growth")
    assert f.ranks == [1] and abs(f.onset["step"] - 400) <= 20
    assert f.evidence["bytes_per_step"] == pytest.approx(512 << 10, rel=0.35)


def _rss_after_warmup(tail):
    """RSS as a CPU rank records it: 300 MiB, +8 MiB over the first 800 steps (warm-up), page
    noise of ±64 KiB, then tail(s) bytes more."""
    noise = np.random.default_rng(7).integers(-16, 17, 3000) * 4096
    return lambda s: (300 << 20) + min(s, 800) * (8 << 20) // 800 + int(noise[s]) + tail(s)


@pytest.mark.parametrize("leak_from", [2000, 1000])
def test_memory_growth_starting_late_after_a_warmup_rise(tmp_path, leak_from):
    # the 2-rank gloo job of 30,000 steps leaking 16 KiB per step from step 20,000 on rank 0
    # (+140 MiB) was missed: its first change point was the warm-up's rise
    run = make_run(tmp_path, steps=3000, memory={
        0: _rss_after_warmup(lambda s: max(0, s - leak_from) * (96 << 10)),
        1: _rss_after_warmup(lambda s: 0)})
    res = whole_run.analyze(run)
    (f,) = _kinds(res.findings, "memory_growth")
    assert f.ranks == [0] and abs(f.onset["step"] - leak_from) <= 60
    assert f.evidence["bytes_per_step"] == pytest.approx(96 << 10, rel=0.35)


def test_memory_of_a_cache_filled_once_after_a_warmup_rise_is_no_growth(tmp_path):
    run = make_run(tmp_path, steps=3000, memory={
        0: _rss_after_warmup(lambda s: min(max(0, s - 1500), 200) * (500 << 10)),  # +100 MiB
        1: _rss_after_warmup(lambda s: 0)})
    assert not _kinds(whole_run.analyze(run).findings, "memory_growth")


def test_heatmap_bounded_at_many_ranks(tmp_path):
    run = make_run(tmp_path, steps=300, nranks=130, slow={77: lambda s: 5.0})
    h = whole_run.analyze(run).metrics["heatmap"]
    assert len(h["rows"]) <= whole_run.MAX_ROWS and h["ranks_per_row"] == 3
    assert len(h["bins"]) <= whole_run.MAX_BINS
    row = next(i for i, lab in enumerate(h["rows"]) if "–" in lab and
               int(lab.split("–")[0]) <= 77 <= int(lab.split("–")[1]))
    assert np.nanmedian(h["ms"][row]) > np.nanmedian(h["ms"][0]) + 3  # the block's worst rank


def test_slow_step_and_loss_spike_onsets_from_their_steps(tmp_path):
    from trainprof.analyzers._onset import stamp_findings
    from trainprof.findings import Finding

    run = make_run(tmp_path, steps=400)
    burst = Finding("slow_steps", "warning", [], "x", evidence={"slow_steps": [100, 104, 108]})
    spike = Finding("loss_spike", "warning", [], "y", evidence={"steps": [390]})
    stamp_findings(run, [burst, spike])
    assert burst.onset["step"] == 100 and burst.end["step"] == 109
    assert spike.onset["step"] == 390 and spike.end is None  # the run ends right after it
    assert burst.to_dict()["onset"] == burst.onset and "end" not in spike.to_dict()


@pytest.mark.parametrize("cpu_ms,severity", [(-0.1, "info"), (0.5, "info"), (2.5, "warning"),
                                             (None, "info")])
def test_host_contention_stretch_is_info_unless_its_own_work_grew(cpu_ms, severity):
    from trainprof.analyzers import _straggler_episodes as ep
    from trainprof.findings import Finding

    f = Finding("straggler", "warning", [0], "x")
    p = {"episodes": [{"first": 10, "last": 90}]}
    ep.judge_cause(f, p, {"first": 10, "excess_ms": 8.0},
                   {"cause": "host_contention", "parts": {"cpu_ms": cpu_ms}})
    assert f.severity == severity and p["episodes"][0]["external"] is (severity == "info")
    f2 = Finding("straggler", "warning", [0], "x")
    ep.judge_cause(f2, p, {"first": 10, "excess_ms": 8.0}, {"cause": "compute", "parts": {}})
    assert f2.severity == "warning"


def make_async_run(root, steps=1200, onset=700, late_ms=6.0, seed=0):
    """NCCL-like: collectives never block the host (0.1 ms), every step lasts 20 ms on every
    rank; from ``onset`` rank 1 issues its all_reduce ``late_ms`` after rank 0."""
    rng = np.random.default_rng(seed)
    for r in range(2):
        d = rank_dir(root, r)
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"rank": r, "world_size": 2, "host": f"h{r}"}))
        st, co = [], []
        for s in range(steps):
            t = T0 + s * 20 * MS
            st.append({"step": s, "start_ns": t, "end_ns": t + 20 * MS, "dur_ms": 20.0,
                       "source": "optimizer"})
            enq = t + int((8.0 + rng.normal(0, 0.3) + (late_ms if r == 1 and s >= onset else 0)) * MS)
            co.append({"step": s, "pg": "0", "seq": s, "op": "all_reduce", "bytes": 8,
                       "enqueue_ns": enq, "end_ns": enq + MS, "blocked_ms": 0.1, "async": True})
        for name, recs in (("steps", st), ("collectives", co),
                           ("groups", [{"pg": "0", "ranks": [0, 1], "mesh_dim": None,
                                        "backend": "nccl", "size": 2}])):
            (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    return RunDir(root)


def test_midrun_late_arrivals_found_with_onset(tmp_path):
    res = stragglers.analyze(make_async_run(tmp_path / "late"))
    (f,) = _kinds(res.findings, "straggler")
    assert f.ranks == [1] and f.evidence["signal"] == "lateness"
    assert abs(f.onset["step"] - 700) <= 12 and f.end is None
    assert f.evidence["late_ms"] == pytest.approx(6.0, abs=1.0)
    clean = stragglers.analyze(make_async_run(tmp_path / "clean", late_ms=0.0))
    assert not clean.findings, [x.message for x in clean.findings]


def test_heatmap_of_a_rank_that_stopped_early_warns_nothing():
    # a crashed or hung rank has no own time for the last steps: its bins are empty (no value),
    # and the analysis prints no numpy "All-NaN slice" warning on the user's terminal
    sm = {"steps": list(range(1, 11)),
          "busy_ms_by_rank": {"0": [10.0] * 10, "1": [11.0] * 5 + [None] * 5}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = whole_run._heatmap(sm, list(range(1, 11)))
    assert h["ms"][0] == [10.0] * len(h["bins"])
    assert h["ms"][1][0] == 11.0 and h["ms"][1][-1] is None


def test_throughput_drop_not_blamed_on_a_straggler_that_began_later_inside_it(tmp_path):
    # the whole job slows from step 600 (other load on the hosts); rank 1 turns slow only from
    # step 1400: the drop's start is no straggler's, and rank 1 is named as coming later
    run = make_run(tmp_path, steps=2000, group_ms=lambda s: 8.0 if s >= 600 else 0.0,
                   slow={1: lambda s: 6.0 if s >= 1400 else 0.0})
    (f,) = _kinds(whole_run.analyze(run).findings, "throughput_drop")
    assert abs(f.onset["step"] - 600) <= 20
    assert f.ranks == [] and f.evidence["stragglers"] == []
    assert abs(f.evidence["later_stragglers"]["1"] - 1400) <= 20
    assert "every rank slowed alike" in f.message and "later in it rank 1 turned slow from step 14" \
        in f.message


def test_chronic_straggler_of_a_late_detail_window_is_not_called_chronic(tmp_path):
    # a long run whose bounded capture kept the per-step detail of its last 600 steps only
    # (2000-2599): a rank slow in all of them is slow in what was analysed, not "chronic"
    slow = {1: lambda s: 5.0}
    late = stragglers.analyze(make_run(tmp_path / "late", steps=600, slow=slow, first_step=2000))
    (f,) = _kinds(late.findings, "straggler")
    assert "a straggler in every stretch of the analysed steps 20" in f.message
    assert "–2599 (the run's per-step detail starts at step 20" in f.message
    assert "chronic" not in f.message
    whole = stragglers.analyze(make_run(tmp_path / "whole", steps=600, slow=slow))
    (f,) = _kinds(whole.findings, "straggler")
    assert "is a chronic straggler" in f.message
