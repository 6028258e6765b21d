"""The HTA check: trainprof's analysis of the captured CUDA traces against HTA's on the same files.

HTA (the optional extra, `pip install -e .[hta]`, package traceinsight) runs in its own process
(--hta-python; benchmarks/hta_crosscheck.py's HTA_WORKER: TraceAnalysis, get_temporal_breakdown,
get_comm_comp_overlap); trainprof's side is _comm_breakdown.rank_breakdown, the function
`trainprof analyze` digests each rank with. Idle / compute / non-compute % of HTA's window and
the share of communication overlapped with compute must agree within the tolerance.

On CUDA the traces are the ones this run captured (ref_1rank's profiler window, job_profiler's
own trace). A CPU trace has no GPU timeline for HTA to break down, so --dry-run compares the
committed H100 trace (tests/fixtures/gpu/h100_item_sync.pt.trace.json.gz) instead, and says so.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from vcore import Ctx, Verdict

KEYS = ("idle_pct", "compute_pct", "non_compute_pct", "overlap_pct")


def _crosscheck(root: Path):
    spec = importlib.util.spec_from_file_location("hta_crosscheck", root / "benchmarks" / "hta_crosscheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def traces(ctx: Ctx, results: dict) -> list[tuple[str, Path]]:
    if not ctx.cuda:
        return [("h100_item_sync (committed; dry run)",
                 ctx.root / "tests" / "fixtures" / "gpu" / "h100_item_sync.pt.trace.json.gz")]
    out = []
    ref = results.get("ref_1rank")
    if ref and ref.data.get("run"):
        out += [("ref_1rank", p) for p in sorted((Path(ref.data["run"]) / "profiler").glob("*.json.gz"))]
    jp = results.get("job_profiler")
    if jp and jp.data.get("trace"):
        out.append(("job_profiler", Path(jp.data["trace"])))
    return out


def run_hta(ctx: Ctx, mod, name: str, path: Path) -> dict:
    job = ctx.run(f"hta_{name}", [ctx.hta_python, "-c", mod.HTA_WORKER, path], env={"CUDA_VISIBLE_DEVICES": ""})
    for line in job.log.read_text(errors="replace").splitlines():
        if line.startswith("HTA-RESULT "):
            return json.loads(line[len("HTA-RESULT "):])
    return {"error": f"exit {job.rc}: {job.tail(200)!r}"}


def check(ctx: Ctx, v: Verdict, results: dict, tolerance: float) -> None:
    mod = _crosscheck(ctx.root)
    probe = ctx.run("hta_import", [ctx.hta_python, "-c", "import hta"])
    if not v.need(f"HTA importable by {ctx.hta_python} (pip install -e '.[hta]')", probe.rc == 0):
        return
    items = traces(ctx, results)
    if not v.need(f"CUDA traces to compare (got {len(items)})", len(items) >= (2 if ctx.cuda else 1)):
        return
    worst, rows = 0.0, []
    for i, (name, path) in enumerate(items):
        hta, tp = run_hta(ctx, mod, f"{i}", path), mod.run_trainprof(path)
        row = {"trace": name, "file": path.name, "hta": hta, "trainprof": tp}
        rows.append(row)
        if not v.need(f"{name}: both analyse it (HTA {hta.get('error', 'ok')}; trainprof "
                      f"{tp.get('error', 'ok')})", "error" not in hta and "error" not in tp):
            continue
        diff = max(0.0 if mod.same(hta[k], tp[k]) else abs(hta[k] - tp[k]) for k in KEYS)
        row["max_abs_diff_pp"] = diff
        worst = max(worst, diff)
        v.need(f"{name}: max |Δ| {diff:.2f} pp <= {tolerance} (HTA {[hta[k] for k in KEYS]}, "
               f"trainprof {[tp[k] for k in KEYS]})", diff <= tolerance)
    v.data["rows"] = rows
    if not ctx.cuda:
        v.notes.append("(dry run: the committed H100 trace)")
    v.number = f"max |Δ| {worst:.2f} pp over {len(items)} trace(s)"
