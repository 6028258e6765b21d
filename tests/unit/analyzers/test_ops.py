"""The ops analyzer (analyzers/ops.py): kernel and CPU-op breakdown of the profiled steps, checked
against hand-computed values, an independent pandas computation over the raw trace JSON, and
HTA's own kernel breakdown."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import run_cli
from trainprof.analyzers import ops
from trainprof.trace import load_trace
from paths import FIXTURES

FIX = FIXTURES
GPU_TRACE = FIX / "gpu" / "h100_item_sync.pt.trace.json.gz"
HTA = FIX / "hta"


# --------------------------------------------------------------------------- hand-made CPU trace
def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def cpu_trace(path: Path, rank: int = 0, extra: list | None = None) -> Path:
    """Two profiled steps of 1000 µs on thread 1, a communication thread 2; times in µs."""
    ev = [
        _x("ProfilerStep#1", 0, 1000, cat="user_annotation"),
        _x("outer", 100, 500),                 # children linear [150,300) and relu [300,500)
        _x("aten::linear", 150, 150),          # child addmm [200,250)
        _x("aten::addmm", 200, 50),
        _x("aten::relu", 300, 200),
        _x("Optimizer.step#SGD.step", 650, 250, cat="user_annotation"),  # child add [700,800)
        _x("aten::add", 700, 100),
        _x("gloo:all_reduce", 50, 900, tid=2, cat="user_annotation"),
        _x("ProfilerStep#2", 1000, 1000, cat="user_annotation"),
        _x("outer", 1100, 300),                # child add [1200,1300), mm [1350,1450) overflows
        _x("aten::add", 1200, 100),
        _x("aten::mm", 1350, 100),
        _x("aten::add", 2100, 100),            # after the last step: not counted
        *(extra or []),
    ]
    path.write_text(json.dumps({"distributedInfo": {"rank": rank, "world_size": 2, "backend": "gloo"},
                                "traceEvents": ev}))
    return path


# self time, total time (µs) and calls of each op over both steps, by hand from cpu_trace
HAND = {"outer": (150 + 150, 500 + 300, 2), "aten::linear": (100, 150, 1), "aten::addmm": (50, 50, 1),
        "aten::relu": (200, 200, 1), "Optimizer.step#SGD.step": (150, 250, 1),
        "aten::add": (200, 200, 2), "gloo:all_reduce": (900, 900, 1), "aten::mm": (100, 100, 1)}


def test_cpu_self_and_total_times_by_hand(tmp_path):
    tr = load_trace(cpu_trace(tmp_path / "rank-0.pt.trace.json"))
    d = ops.trace_digest(None, 0, tr)
    assert d["kind"] == "cpu" and d["n_steps"] == 2 and d["window_ns"] == 2_000_000
    rows = {r["name"]: r for r in d["cpu_ops"]["rows"]}
    assert set(rows) == set(HAND)  # ProfilerStep and the op after the last step left out
    for name, (self_us, total_us, calls) in HAND.items():
        assert (rows[name]["self_ns"], rows[name]["total_ns"], rows[name]["count"]) == \
            (self_us * 1000, total_us * 1000, calls), name
    assert d["cpu_ops"]["total"] == {"names": 8, "count": 10, "total_ns": 2_650_000, "self_ns": 2_000_000}
    assert sum(v[0] for v in HAND.values()) == 2000 and sum(v[1] for v in HAND.values()) == 2650
    assert d["kernels"]["rows"] == [] and d["kernel_groups"] == {}
    m = ops.combine({0: d})
    assert m["job"]["kind"] == "cpu" and m["kernels"] == []
    assert any("no GPU kernels" in n for n in m["notes"])
    outer = next(r for r in m["cpu_ops"] if r["name"] == "outer")
    assert outer["self_ms_per_step"] == pytest.approx(0.150) and outer["total_ms_per_step"] == pytest.approx(0.400)
    assert outer["self_share"] == pytest.approx(300 / 2000) and outer["calls_per_step"] == 1.0
    assert m["cpu_ops"][0]["name"] == "gloo:all_reduce"  # largest self time first


def test_across_ranks_sums_means_and_spread(tmp_path):
    """Rank 1 runs one more aten::mm of 300 µs: sums over ranks, means per step over ranks (a
    rank without an op counts 0), the slowest rank, and how many ranks have each op."""
    d0 = ops.trace_digest(None, 0, load_trace(cpu_trace(tmp_path / "a.json", 0)))
    d1 = ops.trace_digest(None, 1, load_trace(cpu_trace(tmp_path / "b.json", 1,
                                                         [_x("aten::mm", 1500, 300), _x("aten::cat", 1850, 40)])))
    m = ops.combine({0: d0, 1: d1})
    mm = next(r for r in m["cpu_ops"] if r["name"] == "aten::mm")
    assert mm["count"] == 3 and mm["ranks"] == 2
    assert mm["self_ms"] == pytest.approx(0.5)                     # 100 + 100 + 300 µs
    assert mm["self_ms_per_step"] == pytest.approx((0.1 / 2 + 0.4 / 2) / 2)
    assert (mm["max_rank"], mm["max_rank_self_ms_per_step"], mm["min_rank_self_ms_per_step"]) == \
        (1, pytest.approx(0.2), pytest.approx(0.05))
    cat = next(r for r in m["cpu_ops"] if r["name"] == "aten::cat")
    assert cat["ranks"] == 1 and cat["self_ms_per_step"] == pytest.approx(0.04 / 2 / 2)
    assert [r["rank"] for r in m["per_rank"]] == [0, 1]
    assert m["per_rank"][1]["cpu_self_ms_per_step"] == pytest.approx((2.0 + 0.34) / 2)


def test_top_n_keeps_an_other_remainder(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "TOP_DIGEST", 3)
    d = ops.trace_digest(None, 0, load_trace(cpu_trace(tmp_path / "t.json")))
    names = {r["name"] for r in d["cpu_ops"]["rows"]}
    # top 3 by self (aten::add and aten::relu tie at 200 µs: by name) ∪ top 3 by total
    assert names == {"gloo:all_reduce", "outer", "aten::add", "Optimizer.step#SGD.step"}
    shown = sum(r["self_ns"] for r in d["cpu_ops"]["rows"])
    assert shown + d["cpu_ops"]["other"]["self_ns"] == d["cpu_ops"]["total"]["self_ns"] == 2_000_000
    assert len(d["cpu_ops"]["name_sums"]) == 8  # every name, for the comparison's added/removed


def test_bare_cpu_traces_through_the_cli(tmp_path):
    """`trainprof analyze DIR` on a folder of traces: the ops metrics reach summary.json (through
    RunDir.trace_digests) and the report has the section."""
    d = tmp_path / "traces"
    d.mkdir()
    cpu_trace(d / "rank-0.pt.trace.json", 0)
    cpu_trace(d / "rank-1.pt.trace.json", 1)
    out = tmp_path / "out"
    r = run_cli(["analyze", d, "--out", out])
    assert r.returncode in (0, 1), r.stderr
    s = json.loads((out / "summary.json").read_text())
    m = s["metrics"]["ops"]
    assert m["job"]["ranks"] == 2 and m["job"]["kind"] == "cpu"
    outer = next(x for x in m["cpu_ops"] if x["name"] == "outer")
    assert outer["ranks"] == 2 and outer["self_ms"] == pytest.approx(0.6)
    html = (out / "report.html").read_text()
    assert "Ops and kernels" in html and "Top CPU ops by self time" in html and "no GPU kernels" in html
    assert "CPU time per step by role" in html


def roles_trace(path: Path, steps: bool = True) -> Path:
    """Two profiled steps of 1000 µs on thread 1 (the step's thread), backward on an autograd
    thread 3, gloo on thread 2, a data loader thread 4; an op crossing a step's end."""
    ev = [
        *([_x("ProfilerStep#1", 0, 1000, cat="user_annotation"),
           _x("ProfilerStep#2", 1000, 1000, cat="user_annotation")] if steps else []),
        _x("aten::mm", 100, 200),                       # compute
        _x("c10d::allreduce_", 300, 50),                # wait
        _x("outer", 800, 400),                          # crosses step 1's end: cut at 1000
        _x("aten::relu", 1100, 50),                     # in step 2: outer (cut) is not its parent
        _x("cudaStreamSynchronize", 1300, 100, cat="cuda_runtime"),  # wait
        _x("aten::copy_", 1500, 20),                    # compute
        _x("Optimizer.step#SGD.step", 1900, 400, cat="user_annotation"),  # cut at 2000
        _x("aten::add_", 1950, 30),
        _x("aten::zero_", 2100, 10),                    # after the last step
        _x("gloo:all_reduce", 350, 550, tid=2, cat="user_annotation"),   # communication
        _x("autograd::engine::evaluate_function: MmBackward0", 400, 100, tid=3),  # backward thread
        _x("aten::mm", 410, 70, tid=3),
        _x("aten::copy_", 100, 500, tid=4),             # other (a data loader worker)
    ]
    path.write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ev}))
    return path


def test_roles_by_thread_and_name_by_hand(tmp_path):
    d = ops.trace_digest(None, 0, load_trace(roles_trace(tmp_path / "r.json")))
    assert d["thread_roles"] == {"main": 1, "backward": 1, "communication": 1, "other": 1}
    rows = {(r["name"], r["role"]): (r["self_ns"] // 1000, r["total_ns"] // 1000, r["count"])
            for r in d["cpu_ops"]["rows"]}
    assert rows == {
        ("aten::mm", "compute"): (200 + 70, 270, 2),          # the step's thread and backward
        ("autograd::engine::evaluate_function: MmBackward0", "compute"): (30, 100, 1),
        ("c10d::allreduce_", "wait"): (50, 50, 1), ("cudaStreamSynchronize", "wait"): (100, 100, 1),
        ("outer", "compute"): (200, 200, 1),                  # [800, 1000): cut at the step's end
        ("aten::relu", "compute"): (50, 50, 1),
        ("aten::copy_", "compute"): (20, 20, 1), ("aten::copy_", "other"): (500, 500, 1),
        ("Optimizer.step#SGD.step", "compute"): (100 - 30, 100, 1), ("aten::add_", "compute"): (30, 30, 1),
        ("gloo:all_reduce", "communication"): (550, 550, 1)}
    assert {k: v["self_ns"] // 1000 for k, v in d["cpu_roles"].items()} == \
        {"compute": 670, "wait": 150, "communication": 550, "other": 500}
    # the step's threads (main, backward) run ops for 820 µs of the 2000 µs window
    assert (d["step_threads_busy_ns"], d["outside_ops_ns"]) == (820_000, 1_180_000)
    assert len(d["cpu_ops"]["name_sums"]) == 11  # one per (name, role)
    m = ops.combine({0: d})
    j = m["job"]
    assert j["cpu_self_ms_per_step_by_role"] == {"compute": pytest.approx(0.335), "wait": pytest.approx(0.075),
                                                 "communication": pytest.approx(0.275), "other": pytest.approx(0.25)}
    assert j["outside_ops_ms_per_step"] == pytest.approx(0.59)
    copies = sorted((r["role"], r["self_ms_per_step"]) for r in m["cpu_ops"] if r["name"] == "aten::copy_")
    assert copies == [("compute", pytest.approx(0.01)), ("other", pytest.approx(0.25))]
    assert [x["name"] for x in m["per_rank"][0]["top_compute_ops_self"]] == ["aten::mm", "outer", "Optimizer.step#SGD.step"]


def test_without_profiler_steps_the_busiest_thread_is_the_steps(tmp_path):
    d = ops.trace_digest(None, 0, load_trace(roles_trace(tmp_path / "r.json", steps=False)))
    assert d["thread_roles"] == {"main": 1, "backward": 1, "communication": 1, "other": 1}
    roles = {(r["name"], r["role"]) for r in d["cpu_ops"]["rows"]}
    assert {("aten::copy_", "other"), ("aten::mm", "compute"), ("c10d::allreduce_", "wait"),
            ("gloo:all_reduce", "communication"), ("aten::zero_", "compute")} <= roles


def test_wait_names():
    waits = ["c10d::allreduce_", "_c10d_functional::wait_tensor", "record_param_comms", "nccl:all_reduce",
             "gloo:barrier", "cudaStreamSynchronize", "## KJTListAwaitable wait() ##", "All2All_Pooled_Wait"]
    not_waits = ["aten::mm", "cudaStreamWaitEvent", "cudaLaunchKernel", "torch.distributed.ddp.reducer::copy_bucket_to_grad",
                 "Optimizer.step#SGD.step"]
    assert [n for n in waits if not ops.is_wait(n)] == [] and [n for n in not_waits if ops.is_wait(n)] == []


# --------------------------------------------------------------------------- independent pandas
def _raw(path: Path) -> pd.DataFrame:
    data = json.loads(gzip.open(path).read() if str(path).endswith(".gz") else Path(path).read_text())
    rows = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    df = pd.DataFrame({"name": [e["name"] for e in rows], "cat": [e.get("cat") for e in rows],
                       "ts": [float(e["ts"]) for e in rows], "dur": [float(e.get("dur", 0)) for e in rows],
                       "tid": [e.get("tid") for e in rows], "pid": [e.get("pid") for e in rows],
                       "corr": [(e.get("args") or {}).get("correlation", -1) for e in rows]})
    return df


def _naive_self(h: pd.DataFrame) -> np.ndarray:
    """Self time by the definition, quadratically: an event's parent is the latest-starting
    (then longest) earlier event of its thread still running when it starts."""
    out = np.zeros(len(h))
    for _, g in h.groupby(["pid", "tid"]):
        g = g.sort_values(["ts", "dur"], ascending=[True, False], kind="stable")
        s, e, idx = g["ts"].to_numpy(), (g["ts"] + g["dur"]).to_numpy(), g.index.to_numpy()
        child = np.zeros(len(g))
        for j in range(len(g)):
            cand = np.flatnonzero(e[:j] > s[j])
            if len(cand):
                p = cand[-1]
                child[p] += min(e[j], e[p]) - s[j]
        out[h.index.get_indexer(idx)] = np.maximum(e - s - child, 0)
    return out


def test_self_times_equal_the_definition_on_random_nestings():
    """Random properly and improperly nested events on three threads, ties included."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 120))
        ts = rng.integers(0, 60, n)
        dur = rng.integers(0, 30, n)
        h = pd.DataFrame({"ts": ts.astype(float), "dur": dur.astype(float), "pid": 1,
                          "tid": rng.integers(0, 3, n)})
        got = ops.self_times(ts.astype(np.int64), (ts + dur).astype(np.int64), h["tid"].to_numpy())
        assert (got == _naive_self(h)).all()


def test_gpu_fixture_matches_an_independent_computation():
    """H100 trace: kernels launched in a profiled step (the launch's correlation id inside a
    ProfilerStep span), grouped and summed; CPU ops' total and self time; all from the raw JSON."""
    df = _raw(GPU_TRACE)
    steps = df[df["name"].str.startswith("ProfilerStep#") & (df["cat"] == "user_annotation")]
    spans = [(r.ts, r.ts + r.dur) for r in steps.itertuples()]
    in_step = lambda t: any(a <= t < b for a, b in spans)  # noqa: E731
    rt = df[df["cat"].isin(["cuda_runtime", "cuda_driver"])]
    launched_in_step = {c for c, t in zip(rt["corr"], rt["ts"]) if in_step(t)}
    k = df[df["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"]) & df["corr"].isin(launched_in_step)]
    k = k.assign(ns=(k["dur"] * 1000).round().astype(np.int64))
    want = k.groupby("name")["ns"].agg(["size", "sum"])

    tr = load_trace(GPU_TRACE)
    d = ops.trace_digest(None, 0, tr)
    got = {r["name"]: r for r in d["kernels"]["rows"]}
    assert set(got) == set(want.index) and len(got) == 15
    for name, w in want.iterrows():
        assert got[name]["count"] == w["size"]
        assert abs(got[name]["total_ns"] - w["sum"]) <= w["size"]  # ≤ 1 ns per call of µs rounding
    groups = {g: int(k["ns"][[ops.kernel_group(n, c) == g for n, c in zip(k["name"], k["cat"])]].sum())
              for g in ("compute", "memory")}
    assert set(d["kernel_groups"]) == {"compute", "memory"}  # one NCCL rank: no NCCL kernels
    for g, v in groups.items():
        assert abs(d["kernel_groups"][g]["total_ns"] - v) <= len(k)
    assert d["kernel_groups"]["memory"]["count"] == 20 and d["kernel_groups"]["compute"]["count"] == 144

    h = df[df["cat"].isin(ops.HOST_OP_CATS) & ~df["name"].str.startswith("ProfilerStep#")].reset_index(drop=True)
    h = h.assign(self_us=_naive_self(h))
    h = h[[in_step(t) for t in h["ts"]]]
    want = h.groupby("name").agg(count=("dur", "size"), total=("dur", "sum"), self_us=("self_us", "sum"))
    rows = {r["name"]: r for r in d["cpu_ops"]["rows"]}
    assert d["cpu_ops"]["total"]["names"] == len(want)
    for name, r in rows.items():
        w = want.loc[name]
        assert r["count"] == w["count"], name
        assert r["total_ns"] == pytest.approx(w["total"] * 1000, abs=r["count"] + 1), name
        assert r["self_ns"] == pytest.approx(w["self_us"] * 1000, abs=3 * r["count"] + 1), name
    m = ops.combine({0: d})
    window = sum(b - a for a, b in spans) * 1000
    top = m["kernels"][0]
    assert top["name"].startswith("sm80_xmma_gemm") and top["calls_per_step"] == 6.0
    assert top["total_share"] == pytest.approx(got[top["name"]]["total_ns"] / window, rel=1e-4)
    assert m["job"]["kernels_per_step"] == 41.0 and m["job"]["kind"] == "gpu" and not m["notes"]


# --------------------------------------------------------------------------- HTA's numbers
def _hta_window(tr):
    """HTA's view of a trace: every profiled iteration but the last, and (on ns-resolution
    traces) start rounded up and end down to whole µs of the trace's own time base."""
    steps, ev = tr.tables.steps, tr.tables.events
    last = int(steps["step"].max())
    ev["step"] = np.where(ev["step"] == last, -1, ev["step"])
    tr.tables.steps = steps[steps["step"] != last]
    base = tr.meta.get("baseTimeNanoseconds") or 0
    s = -((base - ev["ts_ns"]) // 1000) * 1000 + base
    e = ((ev["end_ns"] - base) // 1000) * 1000 + base
    ev["ts_ns"], ev["end_ns"], ev["dur_ns"] = s, e, e - s
    return tr


# HTA (traceinsight 0.6.1, in its own venv: python -m venv /tmp/htavenv; pip install traceinsight)
# on each fixture directory: TraceAnalysis(trace_dir=DIR).get_gpu_kernel_breakdown(
# visualize=False, num_kernels=100000, duration_ratio=1.0, include_memory_kernels=True):
# kernel_type_df "sum" (µs, all ranks) and per (rank, kernel) "sum (us)" of each rank's top 3.
HTA_TYPES = {
    "trace_filter": {"communication": 305584, "compute": 185023, "compute overlapping communication": 56747,
                     "memory": 2288, "communication overlapping memory": 1011, "compute overlapping memory": 18,
                     "compute overlapping communication overlapping memory": 12},
    "nccl_parser_config": {"compute": 71696, "communication": 20621, "compute overlapping communication": 3473,
                           "memory": 831, "communication overlapping memory": 184},
    "df_index_resolver": {"compute": 496485, "communication": 238274, "memory": 18298},
}
HTA_KERNELS = {  # (rank, kernel name checksum ops.name_sum, its first characters) -> (type, sum µs)
    "trace_filter": {
        (0, 862357276, 'ncclKernel_SendRecv_RING_SIMPLE_Sum_int8'): ('communication', 195327),
        (0, 4283115602, 'void split_embedding_backward_codegen_ro'): ('compute', 11773),
        (0, 4253272055, 'void split_embedding_codegen_forward_unw'): ('compute', 7366),
        (1, 862357276, 'ncclKernel_SendRecv_RING_SIMPLE_Sum_int8'): ('communication', 168027),
        (1, 4283115602, 'void split_embedding_backward_codegen_ro'): ('compute', 28836),
        (1, 4253272055, 'void split_embedding_codegen_forward_unw'): ('compute', 18349),
    },
    "nccl_parser_config": {
        (0, 791321385, 'ncclKernel_AllReduce_RING_LL_Sum_float(n'): ('communication', 24204),
        (0, 1467311101, 'void cudnn::ops::nchwToNhwcKernel<float,'): ('compute', 8063),
        (0, 1593748515, 'void cudnn::bn_bw_1C11_kernel_new<float,'): ('compute', 6375),
    },
    "df_index_resolver": {
        (1, 1691979844, 'ncclKernel_AllReduce_RING_LL_Sum_float(n'): ('communication', 238274),
        (1, 3134402401, 'void at::native::vectorized_elementwise_'): ('compute', 67774),
        (1, 1247796010, 'volta_sgemm_128x32_nt'): ('compute', 59097),
    },
}


@pytest.mark.parametrize("name", sorted(HTA_TYPES))
def test_kernel_breakdown_equals_htas(name, monkeypatch):
    monkeypatch.setattr(ops, "TOP_DIGEST", 100_000)
    types: dict[str, int] = {}
    digests = {}
    for f in sorted((HTA / name).glob("*.json.gz")):
        tr = _hta_window(load_trace(f))
        d = ops.trace_digest(None, tr.rank, tr)
        digests[tr.rank] = d
        for k, v in d["kernel_overlap"].items():
            types[k] = types.get(k, 0) + v
    assert {k: v // 1000 for k, v in types.items() if v} == HTA_TYPES[name]
    for (rank, crc, prefix), (group, sum_us) in HTA_KERNELS[name].items():
        row = next(r for r in digests[rank]["kernels"]["rows"] if ops.name_sum(r["name"]) == crc)
        assert row["name"].startswith(prefix)
        assert (row["group"], row["total_ns"] // 1000) == (group, sum_us)
    m = ops.combine(digests)
    pct = {r["kernel_type"]: r["pct"] for r in m["kernel_overlap"]}
    total = sum(HTA_TYPES[name].values())
    for k, v in HTA_TYPES[name].items():
        assert pct[k] == pytest.approx(100 * v / total, abs=0.01)
