"""``hta_view`` (analyzers/_hta_numbers.py; comm_compute's per_rank[].hta_view) equals HTA's own
numbers on every real trace in tests/fixtures.

HTA's numbers below were obtained with HTA (traceinsight 0.6.1, pandas 3.1.1) in a separate venv,
each file loaded alone as rank 0:

    ta = TraceAnalysis(trace_files={0: path}, trace_dir="/")
    ta.get_temporal_breakdown(visualize=False)   # idle_time_pctg, compute_time_pctg, non_compute_time_pctg
    ta.get_comm_comp_overlap(visualize=False)    # comp_comm_overlap_pctg

which is what ``python benchmarks/hta_crosscheck.py`` runs and prints beside trainprof's numbers.
Order of each tuple: idle %, compute %, non-compute %, communication overlapped with compute %.
HTA's overlap is NaN (0 / 0) on a trace without communication kernels; trainprof gives 0.0 there.
The "derived" traces are fixtures changed by benchmarks/hta_crosscheck.py's DERIVED (one
HTA rule each: which ProfilerStep ends the window, no filter with one step, ops launched before
the first step, CUDA synchronization events, ops queued before recording started).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from trainprof.analyzers import _comm_breakdown
from trainprof.trace import load_trace
from paths import FIXTURES, REPO

FIX = FIXTURES
ROOT = REPO
NAN = float("nan")
TOLERANCE_PP = 0.5

REAL = {
    # TraceAnalysis + get_temporal_breakdown + get_comm_comp_overlap, HTA 0.6.1
    "hta/trace_filter/sampled_rank-0.json.gz": (53.56, 17.71, 28.74, 11.81),
    "hta/trace_filter/sampled_rank-1.json.gz": (54.72, 22.57, 22.72, 20.05),
    "hta/nccl_parser_config/nccl_data.json.gz": (77.78, 17.26, 4.97, 14.31),
    "hta/df_index_resolver/df_index_resolver.json.gz": (46.08, 35.55, 18.37, 0.00),
    # no ProfilerStep: HTA keeps every GPU op of the trace (cuda_sync events included)
    "hta/critical_path/alexnet/benchmark_result_2869224_1695835535_trace.json.gz": (99.49, 0.08, 0.43, NAN),
    # HTA cuts at the GPU timeline's ProfilerStep#5 annotation, after the CPU's ProfilerStep#5 start
    "gpu/h100_item_sync.pt.trace.json.gz": (47.96, 51.95, 0.08, NAN),
    # get_temporal_breakdown raises AssertionError here (non_compute_time = -23 µs: 29 sub-µs
    # memcpys/memsets rounded to negative lengths); idle and compute from its own steps:
    # BreakdownAnalysis._get_idle_time_for_kernels (window 663405, idle 662673 µs) and
    # merge_kernel_intervals of the COMPUTATION kernels (755 µs); overlap from get_comm_comp_overlap
    "gpu/h100_hang_run/profiler/rank-00000.pt.trace.json.gz": (99.89, 0.11, -0.00, NAN),
}

DERIVED = {
    # the same calls on the changed copy benchmarks/hta_crosscheck.py's DERIVED writes
    "h100_item_sync, no GPU ProfilerStep annotations": (47.22, 52.70, 0.09, NAN),
    "h100_item_sync, only ProfilerStep#2 (one step: no filter)": (46.91, 53.00, 0.10, NAN),
    "h100_item_sync, no ProfilerStep#2 (launches before the first step)": (47.96, 51.95, 0.08, NAN),
    "h100_item_sync + cuda_sync events": (46.65, 51.95, 1.40, NAN),
    "trace_filter rank 0 + 50 kernels queued before recording": (53.56, 17.71, 28.74, 11.81),
}


def _view(path: Path) -> dict:
    rows, view, kind = _comm_breakdown.rank_breakdown(load_trace(path))
    assert kind == "gpu" and view is not None
    return view


def _agree(view: dict, hta: tuple) -> None:
    got = (view["idle_pct"], view["compute_pct"], view["non_compute_pct"], view["overlap_pct"])
    for name, g, h in zip(("idle", "compute", "non-compute", "overlap"), got, hta):
        if math.isnan(h):  # HTA: no communication kernel (0 / 0)
            assert g == 0.0, (name, got, hta)
        else:
            assert abs(g - h) <= TOLERANCE_PP, (name, got, hta)
    assert all(0.0 <= g <= 100.0 for g in got), got
    assert sum(got[:3]) == pytest.approx(100.0, abs=0.02)


@pytest.mark.parametrize("rel", sorted(REAL))
def test_hta_view_equals_hta_on_real_trace(rel):
    _agree(_view(FIX / rel), REAL[rel])


def _derived_module():
    spec = importlib.util.spec_from_file_location("hta_crosscheck", ROOT / "benchmarks" / "hta_crosscheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_hta_view_equals_hta_on_derived_trace(name, tmp_path):
    mod = _derived_module()
    assert set(mod.DERIVED) == set(DERIVED)
    paths = dict(mod.write_derived(tmp_path, [name]))
    _agree(_view(paths[name]), DERIVED[name])


def test_cpu_trace_has_no_hta_view():
    # HTA 0.6.1 raises IndexError in get_temporal_breakdown on this trace (no GPU op);
    # trainprof analyzes it as a CPU trace and gives no HTA view
    _, view, kind = _comm_breakdown.rank_breakdown(
        load_trace(FIX / "hta" / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"))
    assert kind == "cpu" and view is None
