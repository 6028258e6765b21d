"""trainprof's ``hta_view`` against HTA's own numbers on every trace at hand.

    python benchmarks/hta_crosscheck.py [--hta-python /tmp/htavenv/bin/python] [TRACE_OR_DIR ...]

For every trace (default: tests/fixtures/hta, tests/fixtures/gpu and, when present,
../shared/fixtures/hta; one Chrome-trace file each, ``*.json`` or ``*.json.gz``), runs
HTA's ``TraceAnalysis(trace_files={rank: path})`` then ``get_temporal_breakdown()`` and
``get_comm_comp_overlap()`` in HTA's own venv (a subprocess: HTA is never imported into
trainprof's environment; install it with ``python -m venv /tmp/htavenv &&
/tmp/htavenv/bin/pip install traceinsight``), and trainprof's ``comm_compute`` on the same file
(``rank_breakdown(load_trace(path))``, the function ``trainprof analyze`` digests each rank
with). Prints one row per trace with both sets of numbers — idle / compute / non-compute % of
HTA's window and the share of communication time overlapped with compute — and the largest
difference in percentage points. Exit 1 when any trace differs by more than --tolerance pp.

Each file is loaded alone, as rank 0; HTA's numbers for a file do not depend on the other
files of its set (its per-rank window and filter; the only shared input, the set of
ProfilerStep names, is the same on every rank of a job).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIRS = [ROOT / "tests" / "fixtures" / "hta", ROOT / "tests" / "fixtures" / "gpu",
                ROOT.parent / "shared" / "fixtures" / "hta"]
KEYS = ("idle_pct", "compute_pct", "non_compute_pct", "overlap_pct")

HTA_WORKER = r"""
import json, logging, sys, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
out = {}
def parts(ta):
    # get_temporal_breakdown's own steps, without its final assertions
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.utils.utils import get_kernel_type, merge_kernel_intervals
    sym = ta.t.symbol_table.get_sym_table()
    g = ta.t.traces[0]
    g = g[g["stream"].ne(-1)].copy()
    idle, total = BreakdownAnalysis._get_idle_time_for_kernels(g)
    g["kernel_type"] = [get_kernel_type(sym[n]) for n in g["name"]]
    comp = merge_kernel_intervals(g[g["kernel_type"].eq("COMPUTATION")].copy())
    compute = comp.end.sum() - comp.ts.sum()
    pct = lambda x: round(100 * float(x / total), 2)
    return {"idle_pct": pct(idle), "compute_pct": pct(compute),
            "non_compute_pct": pct(total - compute - idle)}
try:
    ta = TraceAnalysis(trace_files={0: sys.argv[1]}, trace_dir="/")
    try:
        b = ta.get_temporal_breakdown(visualize=False).set_index("rank").loc[0]
        out = {"idle_pct": float(b["idle_time_pctg"]), "compute_pct": float(b["compute_time_pctg"]),
               "non_compute_pct": float(b["non_compute_time_pctg"])}
    except AssertionError:
        out = {**parts(ta), "note": "get_temporal_breakdown: AssertionError (non-compute < 0); "
                                    "its parts computed by its own functions"}
    o = ta.get_comm_comp_overlap(visualize=False).set_index("rank").loc[0]
    out["overlap_pct"] = float(o["comp_comm_overlap_pctg"])
except BaseException as e:
    out = {"error": f"{type(e).__name__}: {e}"[:200]}
print("HTA-RESULT " + json.dumps(out))
"""


# Real traces changed the way other real traces differ, each exercising one of HTA's rules
# (tests/unit/analyzers/test_hta_numbers.py builds the same ones): name -> (fixture, change)
def _drop(doc, pred):
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not pred(e)]
    return doc


def _queued(doc):
    """50 kernels with no launching runtime call in the trace, inside the first step."""
    step = min(e["ts"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
    doc["traceEvents"] += [{"ph": "X", "cat": "kernel", "name": "queued_kernel", "pid": 0, "tid": 7,
                            "ts": step + 100 + 40 * i, "dur": 20.0,
                            "args": {"stream": 7, "correlation": 10**12 + i, "External id": 10**12 + i}}
                           for i in range(50)]
    return doc


def _syncs(doc):
    """A cuda_sync event (as Kineto records with CUDA sync tracking) for every synchronize call,
    spanning the call."""
    add = []
    for e in doc["traceEvents"]:
        if e.get("cat") == "cuda_runtime" and e.get("name") in ("cudaStreamSynchronize", "cudaDeviceSynchronize"):
            ctx = e["name"] == "cudaDeviceSynchronize"
            c = e["args"]["correlation"]
            add.append({"ph": "X", "cat": "cuda_sync", "name": "Context Sync" if ctx else "Stream Sync",
                        "pid": 0, "tid": 7, "ts": e["ts"], "dur": e["dur"],
                        "args": {"stream": 4294967295 if ctx else 7, "correlation": c, "External id": c}})
    doc["traceEvents"] += add
    return doc


_STEP = lambda *n: lambda e: e.get("name") in {f"ProfilerStep#{i}" for i in n}  # noqa: E731
GPU_FIX = ROOT / "tests" / "fixtures" / "gpu" / "h100_item_sync.pt.trace.json.gz"
TF0 = ROOT / "tests" / "fixtures" / "hta" / "trace_filter" / "sampled_rank-0.json.gz"
DERIVED = {
    "h100_item_sync, no GPU ProfilerStep annotations": (
        GPU_FIX, lambda d: _drop(d, lambda e: e.get("cat") == "gpu_user_annotation")),
    "h100_item_sync, only ProfilerStep#2 (one step: no filter)": (GPU_FIX, lambda d: _drop(d, _STEP(3, 4, 5))),
    "h100_item_sync, no ProfilerStep#2 (launches before the first step)": (GPU_FIX, lambda d: _drop(d, _STEP(2))),
    "h100_item_sync + cuda_sync events": (GPU_FIX, _syncs),
    "trace_filter rank 0 + 50 kernels queued before recording": (TF0, _queued),
}


def write_derived(folder: Path, names=None) -> list[tuple[str, Path]]:
    import gzip

    out = []
    for i, (name, (src, change)) in enumerate(DERIVED.items()):
        if names is not None and name not in names:
            continue
        doc = change(json.loads(gzip.decompress(src.read_bytes())))
        p = folder / f"derived{i}.json.gz"
        p.write_bytes(gzip.compress(json.dumps(doc).encode(), 1))
        out.append((name, p))
    return out


def find_traces(args: list[str]) -> list[Path]:
    roots = [Path(a).resolve() for a in args] or [d for d in DEFAULT_DIRS if d.is_dir()]
    out, seen = [], set()
    for r in roots:
        files = [r] if r.is_file() else sorted(p for p in r.rglob("*") if p.is_file()
                                               and p.name.endswith((".json", ".json.gz"))
                                               and is_trace(p))
        for p in files:
            key = (p.name, p.stat().st_size)  # the shared copies equal the tests/ ones
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def is_trace(path: Path) -> bool:
    """A Chrome trace: "traceEvents" in its first 64 KiB (run-directory JSON files are not)."""
    import gzip

    try:
        with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as fh:
            return b'"traceEvents"' in fh.read(1 << 16)
    except OSError:
        return False


def same(a: float, b: float) -> bool:
    """HTA's NaN overlap (no communication kernel: 0/0) is trainprof's 0.0."""
    return a != a and b == 0.0


def run_hta(python: str, path: Path) -> dict:
    try:
        r = subprocess.run([python, "-c", HTA_WORKER, str(path)], capture_output=True, text=True,
                           timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    for line in r.stdout.splitlines():
        if line.startswith("HTA-RESULT "):
            return json.loads(line[len("HTA-RESULT "):])
    return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]}


def run_trainprof(path: Path) -> dict:
    from trainprof.analyzers import _comm_breakdown
    from trainprof.trace import load_trace

    try:
        _, view, kind = _comm_breakdown.rank_breakdown(load_trace(path))
    except Exception as e:  # noqa: BLE001 - a row saying why, not a crash
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    return view if view else {"error": f"no hta_view ({kind} trace)"}


def fmt(d: dict) -> str:
    return ("  ".join(f"{d[k]:6.2f}" for k in KEYS) if "error" not in d else d["error"][:60])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="trace files or folders (default: the fixtures)")
    ap.add_argument("--hta-python", default="/tmp/htavenv/bin/python")
    ap.add_argument("--tolerance", type=float, default=0.5, help="pp (default 0.5)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--no-derived", action="store_true", help="leave out the changed copies of fixtures")
    a = ap.parse_args()
    rows, bad = [], 0
    print(f"{'trace':58} {'':9} {'idle':>6}  {'comp':>6}  {'non-c':>6}  {'ovlp':>6}   max |Δ| pp")
    tmp = tempfile.TemporaryDirectory()
    items = [(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p), p) for p in find_traces(a.traces)]
    if not a.traces and not a.no_derived:
        items += write_derived(Path(tmp.name))
    for name, p in items:
        hta, tp = run_hta(a.hta_python, p), run_trainprof(p)
        diff = (max(0.0 if same(hta[k], tp[k]) else abs(hta[k] - tp[k]) for k in KEYS)
                if "error" not in hta and "error" not in tp else None)
        status = ("" if diff is None else f"{diff:.2f}" + ("  FAIL" if diff > a.tolerance else ""))
        if diff is None and ("error" in hta) != ("error" in tp):
            status = "one side only"
        bad += bool(diff is not None and diff > a.tolerance or status == "one side only")
        print(f"{name[-58:]:58} {'HTA':9} {fmt(hta)}" + (f"   ({hta['note']})" if "note" in hta else ""))
        print(f"{'':58} {'trainprof':9} {fmt(tp)}   {status}")
        rows.append({"trace": name, "hta": hta, "trainprof": tp, "max_abs_diff_pp": diff})
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} traces, {bad} beyond {a.tolerance} pp or analyzed by one side only")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
