"""expert_balance on hand-built collective logs: routed all_to_all (sizes differ across ranks)
told from equal ones, per-call load, tokens from run_info's hidden size, factor by hand."""

from __future__ import annotations

import json

import pytest

from trainprof.analyzers import expert_balance
from trainprof.rundir.files import rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir

H = 64


def _write(root, tokens: dict, steps=4):
    """Per step: a count exchange (16 B), an equal dispatch, a combine carrying each rank's
    received tokens (``tokens[r]``), rank 0 blocked 30 ms in the combine."""
    for r, n in tokens.items():
        d = rank_dir(root, r)
        write_json_atomic(d / "meta.json", {"rank": r, "world_size": 2, "run_info": {"hidden": H}})
        recs, seq = [], 0
        for s in range(steps):
            for nbytes, blocked in ((16, 0.1), (512 * H * 4, 1.0), (n * H * 4, 30.0 if r == 0 else 2.0)):
                recs.append({"step": s, "pg": "0", "seq": seq, "op": "all_to_all", "bytes": nbytes,
                             "dtype": "float32", "numel": nbytes // 4, "enqueue_ns": 10**18 + seq,
                             "end_ns": 10**18 + seq + 1, "blocked_ms": blocked, "async": False})
                seq += 1
        (d / "collectives.jsonl").write_text("".join(json.dumps(c) + "\n" for c in recs))


def test_skewed_routing_by_hand(tmp_path):
    _write(tmp_path, {0: 64, 1: 960})
    res = expert_balance.analyze(RunDir(tmp_path))
    (f,) = res.findings
    ev = f.evidence
    assert f.kind == "expert_imbalance" and f.ranks == [1]
    assert ev["tokens_per_call"] == {"0": 64, "1": 960} and ev["routed_calls_per_step"] == 1
    assert ev["imbalance_factor"] == pytest.approx(960 / 512) and ev["max_over_min"] == 15.0
    assert ev["busiest_share_cut"] == pytest.approx(1 - 512 / 960, abs=1e-3)
    assert ev["estimate"]["saving_ms_per_step_up_to"] == 30.0
    assert "rank 0 64 tokens, rank 1 960 tokens" in f.message


def test_balanced_routing_and_equal_calls_are_silent(tmp_path):
    _write(tmp_path / "a", {0: 250, 1: 262})
    res = expert_balance.analyze(RunDir(tmp_path / "a"))
    assert res.findings == [] and res.metrics["groups"]["0"]["imbalance_factor"] < 1.05
    _write(tmp_path / "b", {0: 256, 1: 256})  # every call equal: nothing routed unevenly
    assert expert_balance.analyze(RunDir(tmp_path / "b")).metrics == {}
