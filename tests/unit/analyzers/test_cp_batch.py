"""analyzers/_cp_batch builds the step graphs of many steps at once (their disjoint union) and
walks their longest paths in one frontier pass. Each step's answer must be what the graph of
that step alone gives (_cp_coarse.step_graph + _cp_graph.longest_path / attribute), including
the data waits' placement: checked on random aligned inputs with the awkward cases (several
collectives a step in different orders, async waits, ops outside their window, an op of a
rank without a window, empty windows, data waits, steps cut into several chunks), a step whose
ops cannot be ordered (a cycle: left to the per-step path, which reports it) and deep graphs."""

from __future__ import annotations

import numpy as np
import pytest

from trainprof.analyzers import _cp_batch, _cp_coarse, _cp_graph, critical_path

MS = 1_000_000
T0 = 10**15


def _prep(seed: int, ranks: int = 5, steps: int = 40, cycle_step: int | None = None,
          grid: int = 1) -> dict:
    """Aligned inputs as _cp_coarse.prepare builds them (windows and ops sorted by step); times
    on a ``grid`` (ns): a coarse one makes ties between paths."""
    rng = np.random.default_rng(seed)
    win, ops, inst = [], [], 0
    for s in range(steps):
        base = T0 + s * 100 * MS
        present = [r for r in range(ranks) if rng.random() > 0.1 or r == 0]
        at = {}
        for r in present:
            a = base + int(rng.integers(0, 3 * MS))
            dur = 0 if rng.random() < 0.05 else int(rng.integers(5 * MS, 60 * MS))
            data = int(rng.integers(0, 8 * MS)) if rng.random() < 0.5 else 0
            win.append((r, s, a, a + dur, data))
            at[r] = (a, dur)
        if rng.random() < 0.2:  # a step without ops: a chain step
            continue
        n_coll = int(rng.integers(1, 4))
        ids = list(range(inst, inst + n_coll))
        inst += n_coll
        for r in present + ([ranks] if rng.random() < 0.2 else []):  # rank `ranks`: no window
            a, dur = at.get(r, (base, 50 * MS))
            if not dur:
                continue  # (an op in an empty window is its own cycle: tested below)
            pts = np.sort(rng.random(2 * n_coll + 1))
            order = ids if not (s == cycle_step and r == 1) else ids[::-1]
            for j, i in enumerate(order):
                if s != cycle_step and rng.random() < 0.1:
                    continue  # this rank did not log it
                t = a + int(pts[2 * j] * dur)
                # async: ends after the next op's launch now and then; rarely past the window
                end = a + int(pts[2 * j + (2 if rng.random() < 0.2 else 1)] * dur)
                if rng.random() < 0.03:
                    end = a + dur + 5 * MS
                wait = max(t, end - int(rng.integers(0, 3 * MS))) if rng.random() < 0.5 else t
                ops.append((r, s, t, wait, end, i))
    win = [(r, k, a // grid * grid, b // grid * grid, d // grid * grid) for r, k, a, b, d in win]
    ops = [(r, k, a // grid * grid, b // grid * grid, max(c // grid * grid, a // grid * grid + grid), i)
           for r, k, a, b, c, i in ops]  # (an op lasting 0 on the grid would be a cycle)
    win.sort(key=lambda x: x[1])
    ops.sort(key=lambda x: x[1])
    r, k, a, b, d = (np.array([x[i] for x in win], np.int64) for i in range(5))
    prep = {"win": {"rank": r, "step": k, "start": a, "end": np.maximum(b, a),
                    "dend": np.minimum(np.maximum(b, a), a + d)}, "inst_names": []}
    cols = ("rank", "step", "enq", "wait", "end", "inst")
    prep["ops"] = {c: np.array([x[i] for x in ops], np.int64) for i, c in enumerate(cols)}
    prep["ops"]["op"] = np.array([("all_reduce", "broadcast", None)[x[5] % 3] for x in ops], object)
    prep["inst_names"] = [("c", "0", i) for i in range(inst)]
    return prep


def _one(prep, s):
    g = _cp_coarse.step_graph(prep, s)
    length, path = _cp_graph.longest_path(g)
    return g, length, path


def _one_or_cycle(prep, s):
    g = _cp_coarse.step_graph(prep, s)
    try:
        length, path = _cp_graph.longest_path(g)
    except ValueError:
        return g, None, None
    return g, length, path


@pytest.mark.parametrize("seed,chunk,grid", [(1, 250_000, 1), (2, 37, 1), (3, 1, 1),
                                             (4, 250_000, MS // 2), (5, 250_000, 2 * MS)])
def test_union_of_step_graphs_gives_each_steps_own_path(seed, chunk, grid, monkeypatch):
    monkeypatch.setattr(_cp_batch, "CHUNK_ITEMS", chunk)
    prep = _prep(seed, grid=grid)
    joined = _cp_coarse.op_steps(prep)
    assert len(joined) > 20
    chunks = _cp_batch.chunks(prep, joined)
    assert [int(x) for c in chunks for x in c] == sorted(joined)
    if chunk < 100:
        assert len(chunks) > 5
    batched_at: dict = {}
    seen = cycles = 0
    for c in chunks:
        prep["data_at"] = batched_at
        g, st, node_lo, edge_lo = _cp_batch.step_graphs(prep, c)
        res = _cp_batch.longest_paths(g, node_lo, edge_lo)
        for i, s in enumerate(st.tolist()):
            alone = {"ops": prep["ops"], "win": prep["win"], "inst_names": prep["inst_names"]}
            one, length, path = _one_or_cycle(alone, s)
            # the block is the step's graph, shifted
            nl, nh, el, eh = node_lo[i], node_lo[i + 1], edge_lo[i], edge_lo[i + 1]
            assert g.node_ts[nl:nh].tolist() == one.node_ts.tolist()
            assert g.node_rank[nl:nh].tolist() == one.node_rank.tolist()
            assert (g.src[el:eh] - nl).tolist() == one.src.tolist()
            assert (g.dst[el:eh] - nl).tolist() == one.dst.tolist()
            for col in ("weight", "rank", "parts", "etype", "inst"):
                assert getattr(g, col)[el:eh].tolist() == getattr(one, col).tolist(), col
            assert g.label[el:eh].tolist() == one.label.tolist()
            assert alone.get("data_at", {}) == {k: v for k, v in batched_at.items() if k[1] == s}
            # the path
            if length is None:  # the step's ops cannot be ordered: left to the per-step path
                assert res[i] is None
                cycles += 1
                continue
            got_len, got_path = res[i]
            assert got_len == length and got_path.tolist() == path.tolist(), s
            gp = got_path + el
            assert _cp_graph.path_rows(g, [gp])[0] == _cp_graph.path_rows(one, [path])[0]
            assert _cp_graph.attribute(g, gp) == _cp_graph.attribute(one, path)
            seen += 1
    assert seen + cycles == len(joined) and seen > 20


def test_paths_take_the_batch_and_leave_a_cycle_to_the_per_step_graph():
    prep = _prep(7, ranks=3, steps=30, cycle_step=12)
    with pytest.raises(ValueError):
        _one(prep, 12)
    g, st, node_lo, edge_lo = _cp_batch.step_graphs(prep, _cp_batch.chunks(prep, _cp_coarse.op_steps(prep))[0])
    res = _cp_batch.longest_paths(g, node_lo, edge_lo)
    i = st.tolist().index(12)
    assert res[i] is None and sum(r is None for r in res) == 1

    class _Run:
        def __init__(self, prep):
            self._cache = {"analyzers.critical_path.prep": prep}
            self.problems = []

    run = _Run(prep)
    got = critical_path._paths(run)
    assert 12 not in got and len(run.problems) == 1 and "step 12" in run.problems[0]
    for s in sorted(got):
        if s in _cp_coarse.op_steps(prep):
            one, length, path = _one(prep, s)
            assert got[s]["length_ns"] == length and got[s]["path"].tolist() == path.tolist()
            assert got[s]["rows"] == _cp_graph.path_rows(one, [path])[0]


def test_deep_graphs_are_left_to_the_per_step_path(monkeypatch):
    prep = _prep(5, ranks=2, steps=10)
    c = _cp_batch.chunks(prep, _cp_coarse.op_steps(prep))[0]
    g, st, node_lo, edge_lo = _cp_batch.step_graphs(prep, c)
    sizes = np.diff(node_lo)
    monkeypatch.setattr(_cp_batch, "DEEP", float(np.median(sizes)) / 3)
    res = _cp_batch.longest_paths(g, node_lo, edge_lo)
    rk = [len(set(g.node_rank[node_lo[i]:node_lo[i + 1]].tolist())) for i in range(len(st))]
    for i in range(len(st)):
        assert (res[i] is None) == (sizes[i] / rk[i] > _cp_batch.DEEP)
    assert any(r is None for r in res) and any(r is not None for r in res)


class _Run:
    def __init__(self, prep):
        self._cache = {"analyzers.critical_path.prep": prep}
        self.problems = []


CHANGES = [{"remove_excess": 0}, {"remove_excess": 1}, {"remove_excess": 4},
           {"scale": {"rank": 2, "kind": None, "factor": 0.5}},
           {"scale": {"rank": [0, 3], "kind": "data", "factor": 0.0}},
           {"scale": {"rank": None, "kind": "compute", "factor": 0.3}},
           {"scale": {"rank": 1, "kind": "communication", "factor": 0.0}},
           {"hide_collective": {}}, {"hide_collective": {"op": "all_reduce"}},
           {"hide_collective": {"group": "0", "op": "broadcast"}}]


@pytest.mark.parametrize("chunk", [250_000, 40])
def test_replay_of_the_union_gives_each_steps_own_replay(chunk, monkeypatch):
    monkeypatch.setattr(_cp_batch, "CHUNK_ITEMS", chunk)
    prep = _prep(9, ranks=5, steps=40, grid=MS // 2)
    run = _Run(prep)
    per = critical_path._paths(run)
    joined = _cp_coarse.op_steps(prep)
    assert len(joined) > 20
    for change in CHANGES:
        got = critical_path.replay(run, change, steps=sorted(per))
        want = []
        for s in sorted(per):
            g = _cp_coarse.step_graph(prep, s)
            after, _ = _cp_graph.longest_path(g, critical_path._changed(g, change))
            want.append(round(float(after) / 1e6, 3))
        assert [x["after_ms"] for x in got["steps"]] == want, change
        assert [x["step"] for x in got["steps"]] == sorted(per)
        if "remove_excess" in change or change.get("scale", {}).get("factor") == 0.0:
            assert got["saving_ms"] > 0, change  # the change does something in these steps


@pytest.mark.parametrize("seed,grid", [(11, 1), (12, MS // 2)])
def test_batched_paths_entries_are_the_per_step_ones_value_and_type(seed, grid, monkeypatch):
    monkeypatch.setattr(_cp_batch, "CHUNK_ITEMS", 300)
    prep = _prep(seed, grid=grid)
    joined = _cp_coarse.op_steps(prep)
    got = critical_path._batched_paths(prep, joined)
    assert len(got) > 20
    for s in sorted(joined):
        one, length, path = _one_or_cycle(prep, s)
        if length is None:
            assert s not in got
            continue
        want = {"length_ns": length, "path": path, "attr": _cp_graph.attribute(one, path),
                "rows": _cp_graph.path_rows(one, [path])[0]}
        assert repr(got[s]["attr"]) == repr(want["attr"]), s  # (floats stay floats)
        assert repr(got[s]["rows"]) == repr(want["rows"]), s
        assert got[s]["length_ns"] == length and got[s]["path"].tolist() == path.tolist()


def test_summaries_of_paths_with_idle_edges_zero_ranks_and_no_edges():
    """A hand-built graph: a weighted edge without parts (idle), a rank whose path edges carry
    nothing (left out of by_rank), an empty path; summaries gives attribute and the path's rows."""
    K = len(_cp_graph.KINDS)
    parts = np.zeros((5, K), np.int64)
    parts[0, _cp_graph.KIND_INDEX["compute"]] = 7
    parts[0, _cp_graph.KIND_INDEX["data"]] = 3
    parts[3, _cp_graph.KIND_INDEX["communication"]] = 4
    g = _cp_graph.Arrays(node_ts=[0, 10, 10, 15, 19, 30], node_rank=[0, 0, -1, 1, 1, 2],
                         src=[0, 1, 2, 2, 4], dst=[1, 2, 3, 4, 5], weight=[10, 0, 5, 4, 11],
                         rank=[0, 3, 1, 1, 2], parts=parts,
                         etype=[_cp_graph.WORK, _cp_graph.DEP, _cp_graph.WORK, _cp_graph.COLL,
                                _cp_graph.WORK], inst=[-1, -1, -1, 0, -1],
                         label=np.array([None, None, None, "all_reduce", None], object))
    paths = [np.array([0, 1, 2]), np.zeros(0, np.int64), np.array([0, 1, 3, 4]), np.array([4])]
    got = _cp_batch.summaries(g, paths)
    # (rank, largest part or idle, end - weight, end = the dst node's time, label), weight > 0
    e0, e2 = (0, "compute", 0, 10, None), (1, "idle", 10, 15, None)
    e3, e4 = (1, "communication", 15, 19, "all_reduce"), (2, "idle", 19, 30, None)
    want_rows = [[e0, e2], [], [e0, e3, e4], [e4]]
    for p, (attr, rows), want in zip(paths, got, want_rows):
        assert repr(attr) == repr(_cp_graph.attribute(g, p))
        assert rows == want and rows == _cp_graph.path_rows(g, [p])[0]
    assert 3 not in got[0][0]["by_rank"] and got[0][1][1][1] == "idle"
    assert got[1] == ({"by_rank": {}, "by_kind": {}, "by_rank_kind": {}}, [])
