"""slow_steps analyzer: hand-built 2-rank runs (every rank's own work, then an all_reduce that
ends when the last rank arrives): periodic slow steps on one rank with the other waiting name
that rank and its own work; slow steps on every rank say so; slow steps of input wait say input;
one hiccup, a clean run, the warm-up and the profiler window stay silent; the throughput over
all analysed steps is stated next to the one at the median step. And a real 2-rank job under
wrap whose rank 0 sleeps every 5 steps before a barrier.

Cases that run multi-process jobs: tests/integration/test_slow_steps_jobs.py."""

from __future__ import annotations

import json

import pytest

from trainprof.analyzers import slow_steps, step_time
from trainprof.rundir.files import rank_dir
from trainprof.analysis.run import RunDir

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
COMM_MS = 5.0  # the all_reduce itself, after the last rank arrives


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def make_run(root, own, data=None, profiled=(), tokens=None):
    """own[rank][step] = ms of the rank's own work (data wait included: data[rank][step] of it),
    then an all_reduce that ends COMM_MS after the last rank arrives; the step ends there."""
    data = data or {}
    ranks = sorted(own)
    nsteps = len(own[ranks[0]])
    group = [{"pg": "0", "ranks": ranks, "mesh_dim": None, "backend": "gloo", "size": len(ranks)}]
    recs = {r: {"steps": [], "collectives": [], "data": []} for r in ranks}
    t = T0
    for s in range(nsteps):
        last = max(own[r][s] for r in ranks)
        dur = last + COMM_MS
        for r in ranks:
            enq = t + int(own[r][s] * MS)
            end = t + int(dur * MS)
            recs[r]["steps"].append({"step": s, "start_ns": t, "end_ns": end, "dur_ms": dur,
                                     "source": "optimizer",
                                     **({"profiled": True} if s in profiled else {})})
            recs[r]["collectives"].append({"step": s, "pg": "0", "seq": s, "op": "all_reduce",
                                           "bytes": 8, "enqueue_ns": enq, "end_ns": end,
                                           "blocked_ms": (end - enq) / MS})
            recs[r]["data"].append({"step": s, "wait_ms": data.get(r, {}).get(s, 0.0), "batches": 1})
        t += int(dur * MS)
    for r in ranks:
        d = rank_dir(root, r)
        d.mkdir(parents=True)
        meta = {"rank": r, "world_size": len(ranks), "host": "node0"}
        if tokens:
            meta["run_info"] = {"tokens_per_step": tokens}
        (d / "meta.json").write_text(json.dumps(meta))
        for name in ("steps", "collectives", "data"):
            _write(d / f"{name}.jsonl", recs[r][name])
        _write(d / "groups.jsonl", group)
    return RunDir(root)


def flat(nsteps, ms=100.0, ranks=2):
    """Every rank 100 ms of own work every step; step 0 (warm-up) 2 s."""
    return {r: [2000.0] + [ms] * (nsteps - 1) for r in range(ranks)}


def found(run):
    return [f for f in slow_steps.analyze(run).findings if f.kind == "slow_steps"]


def test_periodic_slow_steps_on_one_rank(tmp_path):
    own = flat(21)
    for s in (5, 10, 15, 20):
        own[0][s] += 150.0  # rank 0 checkpoints; rank 1 waits in the all_reduce
    run = make_run(tmp_path, own, tokens=1000)
    (f,) = found(run)
    ev = f.evidence
    # analysed steps 1..20 (0 is warm-up); typical 105 ms (100 + the all_reduce), slow 255 ms
    assert f.ranks == [0] and f.severity == "warning"
    assert ev["slow_steps"] == [5, 10, 15, 20] and ev["period"] == 5 and ev["phase"] == 0
    assert ev["median_ms"] == pytest.approx(105.0) and ev["analysed_steps"] == 20
    assert ev["excess_ms"] == pytest.approx(4 * 150.0)
    assert ev["total_ms"] == pytest.approx(16 * 105.0 + 4 * 255.0)  # 2700 ms
    assert ev["share"] == pytest.approx(600 / 2700)
    assert ev["slow_ranks"] == [0] and ev["waiting_ranks"] == [1]
    assert ev["own_extra_ms"]["0"] == pytest.approx(150.0, abs=1e-3)
    assert ev["own_extra_ms"]["1"] == pytest.approx(0.0, abs=1e-3)
    assert ev["wait_extra_ms"]["1"] == pytest.approx(150.0, abs=1e-3)
    assert ev["cause"] == "own_work" and ev["wait_ops"] == ["all_reduce"]
    # throughput: 1000 tokens per step, at the median step vs over the 20 analysed steps
    assert ev["tokens_per_s_median"] == pytest.approx(1000 / 0.105)
    assert ev["tokens_per_s_mean"] == pytest.approx(1000 * 20 / 2.7)
    m = f.message
    assert "steps 5, 10, 15, 20 (every 5 steps)" in m and "22 % of the analysed time" in m
    assert "slow on rank 0 only (its own work: +150 ms per slow step)" in m
    assert "rank 1 waits +150 ms per slow step in all_reduce" in m
    assert "7,407 tokens/s vs 9,524 tokens/s at the median step" in m
    job = step_time.analyze(run).metrics["job"]
    assert job["tokens_per_s_mean"] == pytest.approx(1000 * 20 / 2.7)
    assert job["tokens_per_s"] == pytest.approx(1000 / 0.105)


def test_slow_on_every_rank(tmp_path):
    own = flat(31)
    for s in (10, 20, 30):  # an evaluation every 10 steps, on both ranks
        own[0][s] += 800.0
        own[1][s] += 780.0
    (f,) = found(make_run(tmp_path, own))
    ev = f.evidence
    assert f.ranks == [0, 1] and ev["slow_steps"] == [10, 20, 30] and ev["period"] == 10
    # the step is the slower rank's: 100 + 800 + 5; the other rank waits 20 ms more
    assert ev["excess_ms"] == pytest.approx(3 * 800.0)
    assert ev["share"] == pytest.approx(2400 / (27 * 105.0 + 3 * 905.0))
    assert ev["slow_ranks"] == [0, 1] and ev["waiting_ranks"] == []
    assert ev["own_extra_ms"]["0"] == pytest.approx(800.0, abs=1e-3)
    assert ev["own_extra_ms"]["1"] == pytest.approx(780.0, abs=1e-3)
    assert "(every 10 steps)" in f.message and "slow on every rank" in f.message
    assert "evaluation or checkpointing on all ranks" in f.message
    assert "rank 1 only" not in f.message and "waits" not in f.message
    assert "take 905 ms vs a typical 105 ms" in f.message
    # no tokens_per_step: the mean step (5550 ms / 30) against the median one
    assert "the mean step is 185 ms (1.76× the median)" in f.message


def test_checkpoints_of_varied_cost_are_every_8_steps(tmp_path):
    """A checkpoint every 8 steps on both ranks, large at 8, 24, 40 and small at 16, 32, 48:
    the class of every 16th step has the larger mean excess, yet the period is 8."""
    own = flat(50)
    for s, extra in ((8, 500.0), (16, 40.0), (24, 120.0), (32, 35.0), (40, 150.0), (48, 220.0)):
        own[0][s] += extra
        own[1][s] += extra
    (f,) = found(make_run(tmp_path, own))
    ev = f.evidence
    assert ev["period"] == 8 and ev["phase"] == 0
    assert ev["slow_steps"] == [8, 16, 24, 32, 40, 48]
    assert ev["excess_ms"] == pytest.approx(500 + 40 + 120 + 35 + 150 + 220)
    assert f.message.startswith("steps 8, 16, 24, 32, 40, 48 (every 8 steps) take 140–605 ms")


def test_irregular_slow_steps_without_period(tmp_path):
    own = flat(30)
    for s in (7, 11, 23):  # three slow steps, no common period
        own[1][s] += 300.0
    (f,) = found(make_run(tmp_path, own))
    ev = f.evidence
    assert ev["slow_steps"] == [7, 11, 23] and ev["period"] is None and f.ranks == [1]
    assert "every" not in f.message.split(";")[0]
    assert "slow on rank 1 only" in f.message and "rank 0 waits +300 ms" in f.message


def test_input_wait_is_named(tmp_path):
    own, data = flat(21), {0: {}}
    for s in (5, 10, 15, 20):
        own[0][s] += 200.0
        data[0][s] = 190.0  # rank 0 waits for its batch
    (f,) = found(make_run(tmp_path, own, data=data))
    assert f.ranks == [0] and f.evidence["cause"] == "input"
    assert "waiting for input: data wait +190 ms per slow step" in f.message


def test_one_hiccup_is_silent(tmp_path):
    own = flat(21)
    own[1][12] = 3 * 105.0  # one step 3× the median, once
    run = make_run(tmp_path, own)
    assert found(run) == [] and slow_steps.analyze(run).metrics == {}


def test_two_hiccups_below_the_share_are_silent(tmp_path):
    own = flat(41)
    own[0][12] = own[1][31] = 250.0  # 2.4× the median, twice: 2 × 150 ms of 4.2 s (7 %)
    assert found(make_run(tmp_path, own)) == []


def test_clean_run_is_silent(tmp_path):
    own = {r: [2000.0] + [100.0 + ((7 * s + 3 * r) % 11) for s in range(1, 30)] for r in range(2)}
    assert found(make_run(tmp_path, own)) == []


def test_warmup_and_profiler_window_are_silent(tmp_path):
    own = flat(21)
    for r in (0, 1):
        own[r][1] = 900.0  # the first step after the warm-up (DDP's bucket rebuild)
        for s in (3, 4):  # the profiled steps, their warm-up step 2, the export step 5 ...
            own[r][s] = 1500.0
        own[r][2] = own[r][5] = 700.0
        own[r][6] = 600.0  # ... and the step after them: never counted as slow
    run = make_run(tmp_path, own, profiled=(3, 4))
    assert step_time.analyze(run).metrics["excluded_steps"] == {"warmup": [0], "profiler": [2, 3, 4, 5]}
    assert found(run) == []


def test_tiny_steps_jitter_is_silent(tmp_path):
    own = flat(30, ms=2.0)
    for s in (8, 16, 24):  # 15 ms vs a 7 ms step every 8 steps: scheduler jitter
        own[0][s] = 10.0
    assert found(make_run(tmp_path, own)) == []


# ------------------------------------------------------------------- a real job under wrap




def _every_class(steps, x, edges, m, lo, min_n, max_period):
    """Every class of every period in turn: the search as first written, the reference the
    pruned search (analyzers/_periodic.py) must equal, ties and all."""
    import numpy as np
    keep = np.array([s not in edges for s in steps], dtype=bool)
    st, v = np.asarray(steps, dtype=np.int64)[keep], np.asarray(x, dtype=float)[keep]
    if st.size < min_n:
        return None
    high, low, ex = (v >= lo).astype(float), (v <= m).astype(float), v - m
    best = None
    for p in range(2, min(int(steps[-1] - steps[0] + 1) // min_n, max_period) + 1):
        cls = st % p
        n = np.bincount(cls, minlength=p)
        h = np.bincount(cls, weights=high, minlength=p)
        ok = (n >= min_n) & (h >= min_n) & (2 * h >= n) & (np.bincount(cls, weights=low, minlength=p) == 0)
        if ok.any():
            mean = np.bincount(cls, weights=ex, minlength=p) / np.maximum(n, 1)
            phi = int(np.flatnonzero(ok)[np.argmax(mean[ok])])
            if best is None or mean[phi] > best[0]:
                best = (float(mean[phi]), p, phi, [int(s) for s in st[cls == phi]])
    return None if best is None else best[1:]


def test_pruned_period_search_equals_every_class():
    """Random series of every shape the search prunes differently (periodic, a slow stretch at
    the end or the start, random slow steps, ties at the median, a gap, edge steps): the pruned
    search finds the same class as trying every class of every period."""
    import numpy as np

    from trainprof.analyzers import _periodic

    rng = np.random.default_rng(7)
    found_some = 0
    for i in range(120):
        kind = i % 6
        n = int(rng.integers(3, 700))
        steps = np.arange(1, n + 1)
        x = 100 + rng.normal(0, 3, n)
        if kind == 0:
            per = int(rng.integers(2, max(3, n // 4)))
            x[(steps % per) == int(rng.integers(0, per))] += rng.uniform(50, 200)
        elif kind in (1, 2):
            a = int(rng.integers(0, n))
            x[a:] += 60 if kind == 1 else 0
            x[:a] += 60 if kind == 2 else 0
        elif kind == 3:
            x[rng.random(n) < rng.uniform(0.1, 0.5)] += 150
        elif kind == 4:
            x[rng.choice(n, 5)] += 300
        else:
            x = np.round(x / 10) * 10
            x[rng.random(n) < 0.3] += 100
        if n > 10 and rng.random() < 0.3:
            g = int(rng.integers(0, n - 5))
            sel = np.ones(n, bool)
            sel[g:g + 4] = False
            steps, x = steps[sel], x[sel]
        edges = {int(s) for s in rng.choice(steps, int(rng.integers(0, 4)))}
        m = float(np.median(x))
        lo = m + max(2 * 1.4826 * float(np.median(np.abs(x - m))), 0.5 * m, 10.0)
        cap = int(rng.choice([10**9, 40]))
        want = _every_class(steps, x, edges, m, lo, 3, cap)
        assert _periodic._fast(steps, x, edges, m, lo, 3, cap) == want, (i, kind, n)
        found_some += want is not None
    assert found_some > 20
