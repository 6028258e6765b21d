"""Trace dialects (trainprof/trace/_dialects.py): traces written by PyTorch 1.8-1.10 (categories
Kernel, Runtime, Operator, Memcpy, Memset; "external id"), MTIA and CUPTI range-profiler
category names, and Chrome traces of complete ('X') events only read as the same GPU trace, with
the same numbers as today's trace — through the C scan, the typed decoder and the tolerant path
alike. The old-dialect traces are made here from today's fixtures."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from trainprof.analysis.run import RunDir
from trainprof.analysis.runner import analyze
from trainprof.analyzers import _comm_breakdown, gpu_overview, roofline
from trainprof.trace import _document, parse_trace

FIX = Path(__file__).resolve().parents[2] / "fixtures"
TRACES = ["gpu/h100_item_sync.pt.trace.json.gz", "hta/trace_filter/sampled_rank-0.json.gz"]
OLD = {"kernel": "Kernel", "cuda_runtime": "Runtime", "cpu_op": "Operator",
       "gpu_memcpy": "Memcpy", "gpu_memset": "Memset"}
LAUNCHED = ("kernel", "cuda_runtime", "gpu_memcpy", "gpu_memset")


def _doc(rel):
    return json.loads(gzip.open(FIX / rel).read())


def pytorch_18(doc):
    """Today's trace as PyTorch 1.8-1.10 wrote it: old category names, the launching op's id as
    "external id" on GPU ops and runtime calls, shapes as "Input dims"."""
    for e in doc["traceEvents"]:
        c = e.get("cat")
        if c in OLD:
            e["cat"] = OLD[c]
            a = e.get("args")
            if c in LAUNCHED and isinstance(a, dict) and "External id" in a:
                a["external id"] = a.pop("External id")
            if isinstance(a, dict) and "Input Dims" in a:
                a["Input dims"] = a.pop("Input Dims")
    return doc


def renamed(mapping):
    def f(doc):
        for e in doc["traceEvents"]:
            if e.get("cat") in mapping:
                e["cat"] = mapping[e["cat"]]
        return doc
    return f


def x_only(doc):
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    return doc


DIALECTS = {
    "pytorch-1.8": pytorch_18,
    "mtia": renamed({"cuda_runtime": "mtia_runtime", "kernel": "mtia_ccp_events"}),
    "cupti-range": renamed({"kernel": "cuda_profiler_range"}),
    "x-only": x_only,
}


def _write(tmp_path, doc, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc, indent=2))  # Kineto's layout (one event per block)
    return p


def _numbers(tr):
    _, view, kind = _comm_breakdown.rank_breakdown(tr)
    return kind, view, gpu_overview.trace_digest(None, tr.rank, tr)["job"], roofline.op_classes(tr)


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("rel", TRACES)
def test_dialect_reads_as_the_modern_trace(rel, dialect, tmp_path):
    today = parse_trace(FIX / rel)
    path = _write(tmp_path, DIALECTS[dialect](_doc(rel)))
    old = parse_trace(path)
    assert _numbers(old) == _numbers(today)
    ev, ev0 = old.tables.events, today.tables.events
    assert ev["cat"].values == ev0["cat"].values and np.array_equal(ev["cat"].codes, ev0["cat"].codes)
    for col in ("step", "correlation", "external_id", "ts_ns", "stream"):
        assert np.array_equal(ev[col], ev0[col]), col
    if dialect != "x-only":
        assert old.meta["dialect"] and today.meta["dialect"] == {}


@pytest.mark.parametrize("rel", TRACES)
def test_old_dialect_same_columns_on_every_decoder_path(rel, tmp_path):
    data = json.dumps(pytorch_18(_doc(rel)), indent=2).encode()
    scanned = _document._from_scan(data)
    assert scanned is not None  # the C scan takes the old dialect itself
    typed = _document._from_structs(_document._DECODER.decode(data))
    tolerant = _document._from_dicts(data)
    for c in (typed, tolerant):
        assert np.array_equal(c.ext, scanned.ext)
        assert c.dims == scanned.dims
        assert set(c.launch) == set(scanned.launch)
        for k, v in scanned.launch.items():
            assert np.array_equal(c.launch[k], v, equal_nan=True), k
    assert (scanned.ext >= 0).sum() > 0


def test_launch_figures_read():
    tr = parse_trace(FIX / "gpu/h100_item_sync.pt.trace.json.gz")
    lt, ev = tr.tables.launch, tr.tables.events
    assert len(lt) == int(ev["cat"].eq("kernel").sum())  # every kernel has its figures
    doc = _doc("gpu/h100_item_sync.pt.trace.json.gz")
    k = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "grid" in e["args"])
    a = k["args"]
    row = int(np.flatnonzero((ev["correlation"] == a["correlation"])
                             & ev["cat"].eq("kernel"))[0])  # the kernel's events row
    i = int(np.flatnonzero(lt["row"] == row)[0])
    assert lt["grid_blocks"][i] == np.prod(a["grid"]) and lt["block_threads"][i] == np.prod(a["block"])
    assert lt["regs_per_thread"][i] == a["registers per thread"]
    assert lt["shared_mem"][i] == a["shared memory"] and lt["blocks_per_sm"][i] == a["blocks per SM"]
    assert lt["est_occupancy_pct"][i] == a["est. achieved occupancy %"]


def test_unknown_device_dialect_is_said(tmp_path):
    """A device trace under category names trainprof does not know is not a clean CPU run: the
    coverage (what the terminal and report lead with when nothing is found) and the problems say
    its device events were not read."""
    doc = renamed({"kernel": "gpu_kernel_v9", "cuda_runtime": "rt_v9"})(_doc(TRACES[0]))
    path = _write(tmp_path, doc, "rank-0.pt.trace.json")
    d = gpu_overview.trace_digest(None, 0, parse_trace(path))
    assert d["kind"] == "cpu" and d["device_hint"] == ["gpu_kernel_v9", "rt_v9"]
    s = analyze(RunDir(path))
    assert s["metrics"]["gpu_overview"]["job"]["unread_device_categories"] == ["gpu_kernel_v9", "rt_v9"]
    text = s["coverage"]["text"]
    assert text.startswith("device events not read: events of 'gpu_kernel_v9', 'rt_v9' look like")
    assert "GPU overview" not in text.split("analyzed: ")[-1]
    assert any("look like device work" in p and "rank(s) 0" in p for p in s["problems"])


def test_cpu_trace_is_no_unread_device_trace():
    path = FIX / "hta/cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
    assert gpu_overview.trace_digest(None, 0, parse_trace(path))["device_hint"] == []
    s = analyze(RunDir(path))
    assert "gpu_overview" not in s["metrics"]
    assert "device events not read" not in (s.get("coverage") or {}).get("text", "")
