"""Bounded always-on capture (probes/compact.py, trainprof/rundir/compact.py): the ring's
rotation, the compact tables within the budget with every step accounted for, folding into
blocks against hand-computed sums, a table torn by kill -9 mid-record, and the budget setting."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from trainprof.rundir import compact as fmt
from trainprof.probes import compact


def _steps(n, t0=10**18, dur_ns=2_000_000):
    return [{"step": s, "start_ns": t0 + s * dur_ns, "end_ns": t0 + (s + 1) * dur_ns,
             "dur_ms": dur_ns / 1e6 + 0 * s, "source": "optimizer", "cpu_ms": 1.0 + s % 3}
            for s in range(n)]


def _colls(step, t0=10**18, dur_ns=2_000_000, seq0=0):
    base = t0 + step * dur_ns
    return [{"step": step, "pg": "0", "seq": seq0 + i, "op": op, "bytes": 400,
             "enqueue_ns": base + 100_000 * i, "end_ns": base + 100_000 * i + 50_000,
             "blocked_ms": 0.05, "device_ms": None}
            for i, op in enumerate(["all_reduce", "all_reduce", "broadcast"])]


def _feed(store, steps, rank_dir):
    sw = store.ring_writer(rank_dir / "steps.jsonl", "steps")
    cw = store.ring_writer(rank_dir / "collectives.jsonl", "collectives")
    for rec in steps:
        cw.write_records(_colls(rec["step"], seq0=3 * rec["step"]))
        sw.write(rec)
        sw.flush()
        cw.flush()
        store.flush()
    return sw, cw


def test_ring_rotates_within_its_cap_and_keeps_the_latest_records(tmp_path):
    w = compact.RingWriter(tmp_path / "collectives.jsonl", cap=8192)
    for i in range(2000):
        w.write_records([{"step": i, "op": "all_reduce", "pad": "x" * 40}])
        w.flush()
    w.close()
    cur, prev = tmp_path / "collectives.jsonl", tmp_path / "collectives.prev.jsonl"
    assert cur.stat().st_size <= 8192 and prev.stat().st_size <= 8192
    recs = [json.loads(x) for p in (prev, cur) for x in p.read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == list(range(steps[0], 2000)) and steps[0] > 1000  # contiguous, the latest


def test_compact_tables_stay_in_budget_and_account_for_every_step(tmp_path):
    from trainprof.analysis.run import RunDir

    rank_dir = tmp_path / "ranks" / "rank-00000"
    rank_dir.mkdir(parents=True)
    store = compact.CompactStore(rank_dir, budget=int(1 * 2**20))
    n = 6000
    _feed(store, _steps(n), rank_dir)
    store.close()
    sizes = {p.name: p.stat().st_size for p in (rank_dir / "compact").iterdir()}
    full = sum(v - fmt.HEADER_SIZE for k, v in sizes.items() if k.endswith(".bin") and "blocks" not in k)
    assert full <= 2**20 * compact.COMPACT_SHARE
    assert store.folds >= 1
    total = sum(p.stat().st_size for p in rank_dir.rglob("*") if p.is_file())
    assert total <= 2**20, total
    rows, blocks = fmt.read_table(fmt.table_path(rank_dir, "steps"))[0], \
        fmt.read_table(fmt.table_path(rank_dir, "steps", blocks=True))[0]
    covered = set(rows["step"].tolist())
    for b in blocks:
        covered |= set(range(int(b["step_first"]), int(b["step_last"]) + 1))
    assert covered == set(range(n))  # never a silent stop, no hole
    assert int(blocks["n"].sum()) + len(rows) == n
    # block sums against the hand-computed per-step values: dur 2 ms, cpu 1 + s % 3
    for b in blocks[:5]:
        s = np.arange(b["step_first"], b["step_last"] + 1)
        assert b["dur_ms_sum"] == pytest.approx(2.0 * len(s))
        assert b["cpu_ms_sum"] == pytest.approx(float((1.0 + s % 3).sum()))
        assert b["cpu_ms_min"] == pytest.approx(float((1.0 + s % 3).min()))
        assert b["cpu_ms_max"] == pytest.approx(float((1.0 + s % 3).max()))
    # collectives: 3 a step in two keys, the sums per step
    c = fmt.read_table(fmt.table_path(rank_dir, "collectives"))[0]
    keys = fmt.read_keys(rank_dir / "compact" / fmt.KEYS)
    ar = c[[keys[int(k)] == ("0", "all_reduce") for k in c["key"]]]
    assert set(ar["count"].tolist()) == {2} and set(ar["bytes"].tolist()) == {800}
    assert ar["blocked_ms"] == pytest.approx(0.1, abs=1e-6)
    assert ar["enqueue_mean_ms"] == pytest.approx(0.05, abs=1e-6)  # (0 + 0.1 ms) / 2
    # through the reader: steps frame = the full-resolution steps, resolution says the rest
    (tmp_path / "ranks" / "rank-00000" / "meta.json").write_text(json.dumps(
        {"rank": 0, "world_size": 1}))
    run = RunDir(tmp_path)
    st = run.steps()
    assert st["step"].tolist() == sorted(rows["step"].tolist())
    assert st["dur_ms"].to_numpy() == pytest.approx(2.0)
    res = run.resolution()
    assert res["blocks"]["steps"][0] == 0 and res["full"]["steps"][1] == n - 1
    cs = run.collective_steps()
    assert set(cs["op"]) == {"all_reduce", "broadcast"}
    assert not run.problems


def test_torn_table_loses_only_its_last_record(tmp_path):
    rank_dir = tmp_path / "r"
    rank_dir.mkdir()
    store = compact.CompactStore(rank_dir, budget=64 * 2**20)
    _feed(store, _steps(50), rank_dir)
    store.close()
    p = fmt.table_path(rank_dir, "steps")
    with open(p, "ab") as f:  # kill -9 in the middle of the next record
        f.write(fmt.STEPS.pack([(50, 1, 2, 0.0, 0.0, 0.0, 0, 0, 0)])[:17])
    rows, torn = fmt.read_table(p)
    assert torn and rows["step"].tolist() == list(range(50))
    with open(p, "r+b") as f:  # and a header that is not a table's is refused, named
        f.write(b"garbage")
    with pytest.raises(fmt.CompactError, match=str(p)):
        fmt.read_table(p)


def test_merge_blocks_keeps_sums_and_extremes():
    rows = np.zeros(64, fmt._dtype(fmt.STEPS.fields))
    rows["step"] = np.arange(64)
    rows["start_ns"] = 0
    rows["end_ns"] = (np.arange(64) + 1) * 1_000_000
    rows["cpu_ms"] = np.arange(64, dtype=float)
    b = fmt.fold(fmt.STEPS, rows, 8)
    m = fmt.merge_blocks(fmt.STEPS, b, 16)
    assert len(b) == 8 and len(m) == 4
    assert m["n"].tolist() == [16] * 4
    assert m["dur_ms_sum"].sum() == pytest.approx(((np.arange(64) + 1)).sum())
    assert m["cpu_ms_min"].tolist() == [0, 16, 32, 48] and m["cpu_ms_max"].tolist() == [15, 31, 47, 63]


@pytest.mark.parametrize("value,ok", [("256", True), ("1", True), ("0.5", False), ("0", False),
                                      ("abc", False), ("inf", False)])
def test_budget_setting_is_validated(value, ok):
    from trainprof.settings import check

    _, problems = check({"TRAINPROF_BUDGET_MB": value})
    assert (not problems) == ok
    if not ok:
        assert len(problems) == 1 and problems[0].startswith("TRAINPROF_BUDGET_MB=")
        assert ">= 1" in problems[0]


def test_budget_from_environment(monkeypatch):
    assert compact.budget_bytes({}) == 256 * 2**20
    assert compact.budget_bytes({"TRAINPROF_BUDGET_MB": "4"}) == 4 * 2**20
    assert compact.budget_bytes({"TRAINPROF_BUDGET_MB": "0.1"}) == 256 * 2**20  # not accepted: the default


def test_wrap_refuses_a_budget_too_small_with_one_line(tmp_path):
    import subprocess
    import sys

    for args, env, name in ((["--budget-mb", "0.5"], {}, "--budget-mb"),
                            ([], {"TRAINPROF_BUDGET_MB": "0.01"}, "TRAINPROF_BUDGET_MB")):
        res = subprocess.run([sys.executable, "-m", "trainprof", "wrap", "--out",
                              str(tmp_path / "run"), *args, "--", sys.executable, "-c", "print(1)"],
                             capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
        assert res.returncode == 2, res.stderr
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and name in lines[0] and ">= 1" in lines[0], res.stderr
        assert "1\n" not in res.stdout  # the job never started
