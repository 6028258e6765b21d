"""Scale: a 1,024-rank run directory (128 hosts, 2 ranks with profiler traces) synthesized from
a real 4-rank run (benchmarks/synth_run.py, source tests/fixtures/scale/dp4-run.tar.gz) is
analyzed with bounded output: an injected straggler is named alone, and a clean run raises no
finding that the real source run does not raise itself.

The module takes ~35 s on 2 cores (TRAINPROF_SCALE_RANKS=512 halves it). Wall time and memory
against the number of ranks (8 … 4,096, 8 ranks with traces) are measured by
benchmarks/bench_scale.py.
"""

from __future__ import annotations

from paths import REPO
import json
import os
import sys
from pathlib import Path

import pytest

from trainprof.analysis.runner import analyze_and_write

sys.path.insert(0, str(REPO / "benchmarks"))
from synth_run import load_source, synthesize  # noqa: E402

RANKS = int(os.environ.get("TRAINPROF_SCALE_RANKS", "1024"))
TRACES = 2  # the benchmark keeps 8: here a trace's digest is fixed cost, not the subject
STRAGGLER = RANKS * 3 // 4 + 1  # 769 (node096) at 1,024 ranks
HOST = f"node{STRAGGLER // 8:03d}"  # 8 ranks per host
DELAY_MS = 300.0  # ~35 % of the source's median step (800-1000 ms)
STRAGGLER_KINDS = ("straggler", "data_starvation", "stage_imbalance", "hang", "rank_failure",
                   "desync")


def _analyze(run: Path, out: Path) -> tuple[dict, int]:
    summary, path, _ = analyze_and_write(run, out, report=False)
    return summary, path.stat().st_size


@pytest.fixture(scope="module")
def source_kinds(tmp_path_factory) -> set[str]:
    """Finding kinds of the real 4-rank source run itself: a synthesized copy may raise these."""
    summary, _ = _analyze(load_source(), tmp_path_factory.mktemp("source-summary"))
    assert not summary["errors"]
    assert not [f for f in summary["findings"] if f["kind"] in STRAGGLER_KINDS]
    return {f["kind"] for f in summary["findings"]}


def _check_bounded(summary: dict, size: int) -> None:
    assert not summary["errors"], summary["errors"]
    assert summary["run"]["world_size"] == RANKS and not summary["run"].get("partial")
    for f in summary["findings"]:  # messages name ranks as ranges, never 1,024 of them
        assert len(f["message"]) < 2000, f["message"][:300]
    for name in ("stragglers", "collectives", "step_time", "nan_origin"):
        m = json.dumps(summary["metrics"].get(name, {}))
        assert len(m) < 4 << 20, f"{name}: {len(m)} bytes of metrics"
    assert size < 8 << 20  # summary.json: ~4 MB at 1,024 ranks


def test_straggler_named_alone_among_many_ranks(tmp_path, source_kinds):
    run = synthesize(tmp_path / "run", RANKS, traces=TRACES, straggler=STRAGGLER, delay_ms=DELAY_MS)
    assert len(list((run / "profiler").iterdir())) == TRACES
    summary, size = _analyze(run, tmp_path / "out")
    _check_bounded(summary, size)
    (f,) = [f for f in summary["findings"] if f["kind"] in STRAGGLER_KINDS]
    assert f["kind"] == "straggler" and f["ranks"] == [STRAGGLER]
    assert f["message"].startswith(f"rank {STRAGGLER} (dp={STRAGGLER} pp=0 tp=0, host {HOST})")
    ev = f["evidence"]
    assert ev["signal"] == "own_time" and ev["cause"] == "compute"
    assert ev["excess_ms"] == pytest.approx(DELAY_MS, rel=0.15)
    # every other rank of its group waits for it, at least the delay per step (its source rank
    # arrived a little late at some collectives of the real run already)
    # (a list of over 1,000 ranks keeps its first 200, its total and its runs: summary_bound.py)
    assert ev.get("waiters_total", len(ev["waiters"])) == RANKS - 1
    assert ev["waiters_wait_ms"] >= 0.8 * DELAY_MS
    if RANKS > 1001:
        assert ev["waiters_ranges"] == [[0, STRAGGLER - 1], [STRAGGLER + 1, RANKS - 1]]
    # per-peer waits capped to the largest ones, with the count and median of all of them
    caused = ev["waits_caused_ms"]
    assert len(caused) == 32 and ev["waits_caused_count"] == RANKS - 1
    assert min(caused.values()) >= ev["waits_caused_median_ms"] >= 0.8 * DELAY_MS
    st = summary["metrics"]["stragglers"]
    assert st["chronic"] == [STRAGGLER] and len(st["per_rank"]) == RANKS
    others = {f["kind"] for f in summary["findings"]} - {"straggler"}
    assert others <= source_kinds, f"findings the source run does not raise: {others - source_kinds}"


def test_clean_many_ranks_raise_nothing_new(tmp_path, source_kinds):
    run = synthesize(tmp_path / "run", RANKS, traces=TRACES)
    summary, size = _analyze(run, tmp_path / "out")
    _check_bounded(summary, size)
    kinds = {f["kind"] for f in summary["findings"]}
    assert kinds <= source_kinds, f"findings the source run does not raise: {kinds - source_kinds}"
    st = summary["metrics"]["stragglers"]
    assert st["chronic"] == [] and len(st["per_rank"]) == RANKS
    assert summary["metrics"]["collectives"]["consistency"]["ok"]
