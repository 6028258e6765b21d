"""The micro-batch cost model (analyzers/_mb_cost.py) on a hand-built profiled window: per op
kind time = fixed + per-unit × work, each span predicted at half the micro-batch size, and the
pipeline estimate built on it (analyzers/estimates.more_micro_batches)."""

from __future__ import annotations

import numpy as np
import pytest

from trainprof.analyzers import _mb_cost as mb, estimates as est
from trainprof.trace._table import Cat, Table

F = "float"
# micro-batch 4 × seq 8, hidden 16: two projections (16→32, 16→64: 32768 and 65536 FLOPs)
LIN_A = ("aten::linear", [[4, 8, 16], [32, 16], [32]], [F, F, F], 32768)
LIN_B = ("aten::linear", [[4, 8, 16], [64, 16], [64]], [F, F, F], 65536)
GELU = ("aten::gelu", [[4, 8, 32], []], [F, ""], None)             # one size only
ACC = ("aten::add_", [[24, 16], [24, 16], []], [F, F, "Scalar"], None)  # a weight's gradient


def _us(op):
    """10 µs fixed + 1 ns per FLOP for the projections; 20 µs gelu; 7 µs the weight add."""
    return 10 + op[3] / 1000 if op[0] == "aten::linear" else {"aten::gelu": 20.0, "aten::add_": 7.0}[op[0]]


def _objects(items):
    out = np.empty(len(items), object)
    for i, x in enumerate(items):
        out[i] = x
    return out


def _window(n_mb=3, gap_us=5.0):
    rows, spans, t = [], [], 1_000_000
    for i in range(n_mb):
        for kind, ops in (("F", [LIN_A, LIN_B, GELU]), ("B", [ACC])):
            start = t
            for op in ops:
                t += int(gap_us * 1000)
                d = int(_us(op) * 1000)
                rows.append((op[0], t, d, op[1], op[2]))
                t += d
            t += int(gap_us * 1000)
            spans.append({"step": 3, "stage": 0, "microbatch": i, "kind": kind,
                          "start_ns": start, "end_ns": t})
    ev = Table({"name": Cat.from_strings([r[0] for r in rows]),
                "cat": Cat.from_strings(["cpu_op"] * len(rows)),
                "ts_ns": np.array([r[1] for r in rows], np.int64),
                "dur_ns": np.array([r[2] for r in rows], np.int64),
                "end_ns": np.array([r[1] + r[2] for r in rows], np.int64),
                "tid": np.ones(len(rows), np.int64), "is_gpu": np.zeros(len(rows), bool),
                "input_dims": _objects([r[3] for r in rows]),
                "input_types": _objects([r[4] for r in rows])})
    return ev, spans


def test_fit_line_splits_fixed_from_per_unit_and_refuses_one_size():
    assert mb.fit_line([(100.0, 30.0, 2), (300.0, 70.0, 1)]) == pytest.approx((10.0, 0.2))
    assert mb.fit_line([(100.0, 30.0, 2), (120.0, 33.0, 2)]) is None  # < 1.5× apart
    assert mb.fit_line([(100.0, 50.0, 1), (300.0, 30.0, 1)]) == pytest.approx((40.0, 0.0))


def test_window_digest_predicts_each_span_at_half_the_micro_batch():
    ev, spans = _window()
    d = mb.window_digest(ev, spans)
    assert d["batch_dims"] == [4, 32]
    fits = {f["op"]: f for f in d["fits"]}
    assert fits["aten::linear"]["fixed_us"] == pytest.approx(10.0, abs=1e-6)
    assert fits["aten::linear"]["per_unit_ns"] == pytest.approx(1.0)
    assert fits["aten::gelu"]["single_size"] and fits["aten::gelu"]["fixed_us"] == 0
    by = {s["kind"]: s for s in d["spans"]}
    # F: 42.768 + 75.536 + 20 µs of ops, 4 gaps of 5 µs; at half size the projections' FLOPs
    # halve (10 + 16.384, 10 + 32.768), gelu is taken as proportional (10)
    assert by["F"]["fitted_ms"] == pytest.approx((42.768 + 75.536 + 20) / 1e3, rel=1e-6)
    assert by["F"]["fitted_half_ms"] == pytest.approx((26.384 + 42.768 + 10) / 1e3, rel=1e-6)
    assert by["F"]["between_ops_ms"] == pytest.approx(0.02)
    # B: the weight's gradient does not carry the batch: kept
    assert by["B"]["fitted_half_ms"] == pytest.approx(by["B"]["fitted_ms"]) == pytest.approx(0.007)
    c = mb.combine({0: d})
    f_span, b_span = by["F"]["span_ms"], by["B"]["span_ms"]
    want = (f_span * (0.02 + 0.079152) / (0.02 + 0.138304) + b_span) / (f_span + b_span)
    assert c["ratio"] == pytest.approx(want, rel=1e-6)
    # gelu and the weight add ran at one size each
    assert c["single_size_share"] == pytest.approx((20 + 7) / (42.768 + 75.536 + 20 + 7))


def test_more_micro_batches_uses_the_per_op_ratio():
    pipe = {"bubble_fraction": 0.4, "decomposition": {"handovers": 0.1},
            "config": {"micro_batches": 4}, "per_stage": [{"window_ms": 100.0}, {"window_ms": 100.0}]}
    # a micro-batch of half the size at 0.8 of the time: busy 60 × 2 × 0.8 = 96, fill/drain
    # 30 × 0.8 = 24, hand-overs 10 × 2 = 20: window 140, the step 120 + 40 (longer: no saving)
    e = est.more_micro_batches({**pipe, "micro_batch_cost": {"ratio": 0.8, "single_size_share": 0.4}}, 120.0)
    assert e["step_ms_after"] == 120.0 and e["saving_ms"] == 0
    assert e["step_ms_predicted"] == pytest.approx(160.0)
    assert "0.80×" in e["model"] and any("40%" in a for a in e["assumptions"])
    # 0.4 of the time: busy 48, fill/drain 12, hand-overs 20 → window 80, step 100
    e = est.more_micro_batches({**pipe, "micro_batch_cost": {"ratio": 0.4}}, 120.0)
    assert e["step_ms_after"] == pytest.approx(100.0) and "step_ms_predicted" not in e
