"""FLOPs and bytes per op from recorded shapes, against torch's FlopCounterMode."""

from __future__ import annotations

import collections
import gzip
import json

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile
from torch.utils.flop_counter import FlopCounterMode

from trainprof.analyzers._opcost import causal_fraction, op_cost, select_ops
from trainprof.trace import load_trace
from paths import FIXTURES


def _profiled_ops(fn, tmp_path, with_concrete=True):
    """Run fn under the profiler (record_shapes) and cost the trace's ops; without_concrete drops
    the parsed "Concrete Inputs" (stride/padding, is_causal), as in traces that lack them."""
    with profile(record_shapes=True) as p:
        fn()
    path = tmp_path / "t.json"
    p.export_chrome_trace(str(path))
    tr = load_trace(path)
    ev = tr.tables.events
    assert "concrete_inputs" in ev
    if not with_concrete:
        ev = ev[[c for c in ev.columns if c != "concrete_inputs"]]
    flops = collections.Counter()
    by = collections.Counter()
    for row, c in select_ops(ev):
        flops[c.op_class] += c.flops
        by[c.op_class] += c.bytes
    return flops, by, ev


def _counter_flops(fn) -> dict:
    fc = FlopCounterMode(display=False)
    with fc:
        fn()
    return {str(k): v for k, v in fc.get_flop_counts().get("Global", {}).items()}


def test_matmul_linear_conv_agree_with_flop_counter(tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(4, 32, 64, requires_grad=True)
    conv_w = torch.randn(8, 3, 3, 3, requires_grad=True)

    def work():
        y = lin(x)                                                     # linear on a 3-D input
        torch.bmm(torch.randn(8, 16, 24), torch.randn(8, 24, 40))
        torch.baddbmm(torch.randn(8, 16, 40), torch.randn(8, 16, 24), torch.randn(8, 24, 40))
        torch.addmm(torch.randn(40), torch.randn(30, 20), torch.randn(20, 40))
        torch.randn(50, 60) @ torch.randn(60, 70)                     # matmul -> mm
        torch.matmul(torch.randn(3, 5, 6), torch.randn(6, 7))         # broadcast matmul
        c = F.conv2d(torch.randn(2, 3, 16, 16), conv_w, stride=2, padding=1)
        (y.sum() + c.sum()).backward()                                 # mm / conv backward

    ref = _counter_flops(work)
    flops, by, _ = _profiled_ops(work, tmp_path)
    matmul_ref = sum(v for k, v in ref.items() if k in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"))
    assert flops["matmul"] == matmul_ref > 0
    conv_ref = sum(v for k, v in ref.items() if "convolution" in k)
    assert flops["conv"] == conv_ref > 0
    assert by["matmul"] > 0 and by["conv"] > 0


def test_attention_counted_on_cpu_where_flop_counter_counts_zero(tmp_path):
    b, h, s, d = 2, 4, 32, 16
    q = torch.randn(b, h, s, d, requires_grad=True)

    def work(causal):
        return lambda: F.scaled_dot_product_attention(q, q, q, is_causal=causal).sum().backward()

    assert sum(v for k, v in _counter_flops(work(False)).items() if "attention" in k) == 0  # torch 2.13 CPU
    full = 4 * b * h * s * s * d                        # 2·BHSS·D (QKᵀ) + 2·BHSS·D (PV)
    flops, by, _ = _profiled_ops(work(False), tmp_path)
    assert flops["attention"] == full * 3              # forward + backward (2× forward)
    flops, _, _ = _profiled_ops(work(True), tmp_path)
    assert flops["attention"] == pytest.approx(full * 3 * (s + 1) / (2 * s))  # causal: 528 of 1024 scores
    flops, _, _ = _profiled_ops(work(True), tmp_path, with_concrete=False)
    assert flops["attention"] == full * 3              # is_causal not recorded: full count, said so
    unit = b * h * s * d * 4  # one fp32 (B, H, S, D) tensor
    assert by["attention"] == 4 * unit + 8 * unit  # fwd: q,k,v,out; bwd: dout,q,k,v,out + dq,dk,dv


def test_nested_ops_count_once(tmp_path):
    x = torch.randn(8, 64)
    w = torch.randn(32, 64)
    flops, _, ev = _profiled_ops(lambda: F.linear(x, w, torch.randn(32)), tmp_path)
    assert flops["matmul"] == 2 * 8 * 64 * 32
    assert "memory" not in flops or flops["memory"] == 0   # addmm's bias copy is part of addmm


def test_elementwise_norm_softmax_embedding_by_hand():
    f4 = "float"
    c = op_cost("aten::add", [[4, 8], [8], []], [f4, f4, "Scalar"])
    assert (c.op_class, c.flops, c.bytes) == ("elementwise", 32, (32 + 8 + 32) * 4)
    c = op_cost("aten::mul_", [[4, 8], [4, 8]], [f4, f4])
    assert (c.flops, c.bytes) == (32, (32 + 32 + 32) * 4)  # in place: read both, write self
    c = op_cost("aten::native_layer_norm", [[4, 32, 64], [], [64], [64], []],
                [f4, "ScalarList", f4, f4, "Scalar"])
    assert (c.op_class, c.flops, c.bytes) == ("norm", 5 * 8192, 2 * 8192 * 4 + 2 * 64 * 4)
    c = op_cost("aten::_softmax", [[128, 256], [], []], ["c10::BFloat16", "Scalar", "Scalar"])
    assert (c.op_class, c.flops, c.bytes) == ("softmax", 5 * 32768, 2 * 32768 * 2)
    c = op_cost("aten::embedding", [[256, 64], [4, 32], [], [], []], [f4, "long int", "Scalar", "Scalar", "Scalar"])
    assert (c.op_class, c.flops, c.bytes) == ("embedding", 0, 2 * 128 * 64 * 4 + 128 * 8)
    c = op_cost("aten::_foreach_add_", [[[10, 3], [5]], [[10, 3], [5]], []], ["TensorList", "TensorList", "Scalar"])
    assert (c.flops, c.bytes) == (35, 2 * 35 * 4)
    assert op_cost("aten::mm", None, None) is None and op_cost("aten::view", [[1]], [f4]) is None
    assert causal_fraction(4, 4) == 10 / 16 and causal_fraction(2, 4) == 3 / 8


def test_real_h100_trace_causal_attention_from_concrete_inputs():
    """The parser carries "Concrete Inputs": the reference's cuDNN attention (is_causal=True,
    recorded as the string "True") is counted over the unmasked scores only."""

    trace = FIXTURES / "gpu/h100_hang_run/profiler/rank-00000.pt.trace.json.gz"
    ev = load_trace(trace).tables.events
    raw = [e for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
           if e.get("name") == "aten::_scaled_dot_product_cudnn_attention_backward"]
    assert raw and raw[0]["args"]["Concrete Inputs"][14] == "True"  # is_causal, independently read
    costs = [(ev["name"][row], c) for row, c in select_ops(ev) if c.op_class == "attention"]
    bwd = [c for n, c in costs if n == "aten::_scaled_dot_product_cudnn_attention_backward"]
    assert costs and bwd and all(c.note == "causal mask: unmasked scores only" for _, c in costs)
    b, h, s, d = raw[0]["args"]["Input Dims"][1]
    dense_bwd = 2 * (2 * b * h * s * s * d + 2 * b * h * s * s * d)
    assert bwd[0].flops == pytest.approx(dense_bwd * causal_fraction(s, s))


def _events(rows):
    """An events Table from (name, cat, tid, ts, dur, input_dims, input_types) rows."""
    import numpy as np

    from trainprof.trace._table import Cat, Table, objects

    name, cat, tid, ts, dur, dims, types = zip(*rows)
    ts, dur = np.array(ts, np.int64), np.array(dur, np.int64)
    return Table({"name": Cat.from_strings(list(name)), "cat": Cat.from_strings(list(cat)),
                  "ts_ns": ts, "dur_ns": dur, "end_ns": ts + dur, "tid": np.array(tid, np.int64),
                  "input_dims": objects(list(dims)), "input_types": objects(list(types)),
                  "concrete_inputs": objects([None] * len(rows))})


def test_select_ops_nesting_on_an_events_table():
    """Rows are positions in the events Table: a wrapper with a costed op inside, a kernel's
    helper of another class, a tensor subclass's global-shape op around its local one, and ops
    on another thread, the GPU side or without shapes."""
    f4 = "float"
    mm_g, mm_l = [[64, 32], [32, 16]], [[32, 32], [32, 16]]
    ev = _events([
        ("aten::linear", "cpu_op", 1, 0, 100, [[8, 64], [32, 64], [32]], [f4] * 3),   # 0 wrapper
        ("aten::addmm", "cpu_op", 1, 10, 80, [[32], [8, 64], [64, 32]], [f4] * 3),    # 1 kernel
        ("aten::copy_", "cpu_op", 1, 20, 10, [[8, 32], [32]], [f4] * 2),               # 2 helper
        ("aten::mm", "cpu_op", 1, 200, 100, mm_g, [f4] * 2),                          # 3 global
        ("aten::mm", "cpu_op", 1, 210, 80, mm_l, [f4] * 2),                           # 4 local
        ("aten::mul", "cpu_op", 2, 0, 10, [[4, 8], [4, 8]], [f4] * 2),                # 5
        ("aten::mul", "cpu_op", 2, 20, 10, [[4, 8], [4, 8]], [f4] * 2),               # 6 same shapes
        ("aten::add", "cpu_op", 2, 40, 10, None, None),                                # 7 no shapes
        ("aten::mm", "kernel", 2, 60, 10, mm_l, [f4] * 2),                            # 8 GPU side
    ])
    ops = select_ops(ev)
    assert [r for r, _ in ops] == [1, 4, 5, 6]
    assert ops[0][1] == op_cost("aten::addmm", [[32], [8, 64], [64, 32]], [f4] * 3)
    assert ops[1][1].flops == 2 * 32 * 32 * 16
    assert ops[2][1] is ops[3][1]  # one signature, costed once
    assert select_ops(ev[[c for c in ev.columns if c not in ("input_dims", "input_types")]]) == []


def test_a_double_scalar_does_not_widen_an_elementwise_output():
    """`x * 0.125` of a bf16 tensor, as the profiler records it (timesformer on H100/MI300: the
    Python scalar as a 0-dim `double`): the output is bf16, as type promotion makes it; the
    8-byte scalar counted as the output's element size made the op 2.5x the bytes it moves."""
    n = 8 * 12 * 64 * 64
    c = op_cost("aten::mul", [[8, 12, 64, 64], []], ["c10::BFloat16", "double"])
    assert (c.flops, c.bytes) == (n, n * 2 + 8 + n * 2)
    # two dimensioned inputs still promote: bf16 * fp32 writes fp32
    c = op_cost("aten::mul", [[4, 8], [4, 8]], ["c10::BFloat16", "float"])
    assert c.bytes == 32 * 2 + 32 * 4 + 32 * 4
    # only 0-dim inputs: their size is the output's
    c = op_cost("aten::add", [[], []], ["double", "double"])
    assert c.bytes == 8 + 8 + 8
