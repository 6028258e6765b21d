"""analyzers/_cp_coarse.chain_paths computes the critical path of every step without a logged
op in one vectorized pass (one chain per rank: the longest window). It must give what the full
step graph gives (_cp_coarse.step_graph + _cp_graph.longest_path / attribute) for those steps:
checked on hand-built aligned inputs with and without logged collectives, step by step, and
against hand-computed values (ties, zero-length windows, data waits, an op logged by a rank
with no window in that step)."""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _cp_coarse, _cp_graph, critical_path

MS = 1_000_000
RANKS = 4
STEPS = 8
T0 = 10**15


def _windows(seed: int = 3) -> list[tuple]:
    """(rank, step, start, end, data wait ns) of RANKS x STEPS windows, with the cases that
    matter: step 1 a tie between ranks 1 and 3 (the lower wins), step 3 rank 0's window empty,
    step 6 rank 2's data wait longer than its window, random lengths elsewhere."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(STEPS):
        base = T0 + s * 100 * MS
        for r in range(RANKS):
            start = base + int(rng.integers(0, 3 * MS))
            dur = int(rng.integers(10 * MS, 60 * MS))
            if s == 1:
                dur = 70 * MS if r in (1, 3) else 20 * MS
            if s == 3 and r == 0:
                dur = 0
            data = int(rng.integers(0, 5 * MS)) if r % 2 == 0 else 0
            if s == 6 and r == 2:
                dur, data = 90 * MS, 200 * MS
            out.append((r, s, start, start + dur, data))
    return out


def _prep(windows, ops=None) -> dict:
    """The aligned inputs _cp_coarse.prepare would build (sorted by step)."""
    w = sorted(windows, key=lambda x: x[1])
    r, k, a, b, d = (np.array([x[i] for x in w], np.int64) for i in range(5))
    prep = {"win": {"rank": r, "step": k, "start": a, "end": np.maximum(b, a),
                    "dend": np.minimum(np.maximum(b, a), a + d)}, "ops": None, "inst_names": []}
    if ops:
        ops = sorted(ops, key=lambda x: x[1])
        cols = ("rank", "step", "enq", "wait", "end", "inst")
        prep["ops"] = {c: np.array([x[i] for x in ops], np.int64) for i, c in enumerate(cols)}
        prep["ops"]["op"] = np.array(["all_reduce"] * len(ops), object)
        prep["inst_names"] = [("c", "0", i) for i in range(max(x[5] for x in ops) + 1)]
    return prep


def _all_reduces(windows, steps, extra=()) -> list[tuple]:
    """An all_reduce mid-window on every rank in each of ``steps`` (one instance per step), and
    ``extra`` ops (rank, step) of their own instance."""
    ops, by = [], {(x[0], x[1]): x for x in windows}
    for i, s in enumerate(steps):
        for r in range(RANKS):
            _, _, a, b, _ = by[(r, s)]
            enq = a + (b - a) // 2
            ops.append((r, s, enq, enq, enq + MS, i))
    for j, (r, s) in enumerate(extra):
        t = T0 + s * 100 * MS + 5 * MS
        ops.append((r, s, t, t, t + MS, len(steps) + j))
    return ops


class _Run:
    def __init__(self, prep):
        self._cache = {"analyzers.critical_path.prep": prep}
        self.problems = []


def _full(prep, step) -> dict:
    """The full graph's answer for one step, in paths()'s form."""
    g = _cp_coarse.step_graph(prep, step)
    length, path = _cp_graph.longest_path(g)
    return {"length_ns": length, "path": path, "attr": _cp_graph.attribute(g, path),
            "rows": _cp_graph.path_rows(g, [path])[0]}


def _same(a: dict, b: dict) -> None:
    assert a["length_ns"] == b["length_ns"]
    assert a["path"].tolist() == b["path"].tolist()
    assert a["rows"] == b["rows"]
    assert a["attr"]["by_rank"] == b["attr"]["by_rank"]
    assert {k: v for k, v in a["attr"]["by_kind"].items() if v} == \
        {k: v for k, v in b["attr"]["by_kind"].items() if v}
    assert a["attr"]["by_rank_kind"] == b["attr"]["by_rank_kind"]


def _expected(windows, step) -> tuple:
    """Hand-computed: the longest window of the step (lowest rank on a tie), its data (the wait
    at its start, at most the window), the windows > 0 of lower ranks (edges before it)."""
    ws = sorted((x for x in windows if x[1] == step), key=lambda x: x[0])
    best = max(ws, key=lambda x: (x[3] - x[2], -x[0]))
    r, _, a, b, d = best
    before = sum(1 for x in ws if x[0] < r and x[3] > x[2])
    return (b - a, r, a, b, min(d, b - a), before)


def test_chain_paths_equal_the_full_graph_without_logged_collectives():
    windows = _windows()
    prep = _prep(windows)
    assert _cp_coarse.op_steps(prep) == set()
    chains = _cp_coarse.chain_paths(prep, set())
    assert sorted(chains) == list(range(STEPS))
    for s in range(STEPS):
        assert chains[s] == _expected(windows, s), s
        _same(critical_path._chain_path(*chains[s]), _full(prep, s))
    # the cases: a tie goes to the lower rank, an empty window is no edge, data ≤ the window
    assert chains[1][1] == 1 and chains[1][0] == 70 * MS
    assert chains[6][1] == 2 and chains[6][4] == chains[6][0] == 90 * MS
    assert chains[3][5] == _expected(windows, 3)[5]
    # paths() takes the chains for every step and gives the same
    run = _Run(prep)
    got = critical_path._paths(run)
    assert sorted(got) == list(range(STEPS)) and not run.problems
    for s in range(STEPS):
        _same(got[s], _full(prep, s))


def test_chain_paths_skip_the_steps_with_logged_collectives_and_agree_on_the_rest():
    windows = _windows(seed=11)
    # all_reduces in steps 2 and 5; rank 3 logs an op in step 7 but has no window there
    windows7 = [x for x in windows if not (x[0] == 3 and x[1] == 7)]
    ops = _all_reduces(windows7, [2, 5], extra=[(3, 7)])
    prep = _prep(windows7, ops)
    joined = _cp_coarse.op_steps(prep)
    assert joined == {2, 5}  # step 7's op has no window of its rank: that step is chains
    chains = _cp_coarse.chain_paths(prep, joined)
    assert sorted(chains) == [s for s in range(STEPS) if s not in joined]
    for s in chains:
        assert chains[s] == _expected(windows7, s), s
        _same(critical_path._chain_path(*chains[s]), _full(prep, s))
    # in a joined step the path runs through the collective: not a single chain
    g = _cp_coarse.step_graph(prep, 2)
    length, path = _cp_graph.longest_path(g)
    assert (g.etype[path] == _cp_graph.COLL).any()
    run = _Run(prep)
    got = critical_path._paths(run)
    assert sorted(got) == list(range(STEPS)) and not run.problems
    for s in range(STEPS):
        _same(got[s], _full(prep, s))
