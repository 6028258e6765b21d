"""Whole-run analysis at scale (issue 28): synthesize long bounded-format run directories from a
real run (benchmarks/synth_long.py) and time `trainprof analyze --no-report` on each, printing
wall time, peak RSS and summary.json size per size. Targets (2-core CI machine): 1,000,000
steps x 8 ranks and 100,000 steps x 1,024 ranks each <= 60 s and <= 2 GB. Ends with a table
(wall time follows the machine's load; the CPU time, user + sys, is the figure to compare).

    python benchmarks/bench_long_run.py [--sizes 8x1000000,1024x100000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scale import measure  # noqa: E402

BUDGETS = {8: 256.0, 1024: 2.0}  # MB per rank: the default; a small one keeps 1,024 ranks at ~2 GB on disk


def run(size: str, root: Path) -> dict:
    from synth_long import synthesize

    ranks, steps = (int(x) for x in size.split("x"))
    budget = BUDGETS.get(ranks, 16.0)
    out = root / f"run-{ranks}x{steps}"
    t = time.perf_counter()
    synthesize(out, ranks, steps, budget_mb=budget, straggler=ranks // 2, delay_ms=40.0,
               from_step=steps - steps // 3)
    synth_s = time.perf_counter() - t
    disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    # this analyze's own wall, CPU (user + sys) and peak RSS (/usr/bin/time -v, or a fresh child)
    m = measure([sys.executable, "-m", "trainprof", "analyze", str(out), "--no-report",
                 "--out", str(root / f"out-{ranks}x{steps}")])
    wall, cpu, rss = m["wall_s"], m["cpu_s"], m["rss_mb"] * 1024
    res = subprocess.CompletedProcess([], m["rc"], "", m["stderr"])
    summary = root / f"out-{ranks}x{steps}" / "summary.json"
    import json

    doc = json.loads(summary.read_text()) if summary.exists() else {}
    found = [f for f in doc.get("findings", []) if f.get("kind") == "straggler"]
    return {"size": size, "budget_mb": budget, "disk_mb": disk / 2**20, "synth_s": synth_s,
            "rc": res.returncode, "wall_s": wall, "cpu_s": cpu, "rss_mb": rss / 1024,
            "summary_mb": summary.stat().st_size / 2**20 if summary.exists() else None,
            "straggler_found": [f["ranks"] for f in found],
            "resolution": (doc.get("run") or {}).get("resolution", {}).get("text"),
            "stderr": res.stderr[-500:] if res.returncode else ""}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8x1000000,1024x100000")
    ap.add_argument("--keep", type=Path, default=None)
    a = ap.parse_args()
    root = a.keep or Path(tempfile.mkdtemp(prefix="trainprof-long-"))
    rows = []
    try:
        for size in a.sizes.split(","):
            r = run(size, root)
            rows.append(r)
            print(f"{r['size']:>14}: analyze {r['wall_s']:.1f} s wall ({r['cpu_s']:.1f} s CPU), peak RSS {r['rss_mb']:.0f} MB, "
                  f"summary {r['summary_mb'] or 0:.2f} MB, rc {r['rc']} | run dir {r['disk_mb']:.0f} MB "
                  f"(budget {r['budget_mb']:g} MB/rank, synthesized in {r['synth_s']:.0f} s) | "
                  f"straggler found: {r['straggler_found']} | {r['resolution']}", flush=True)
            if r["stderr"]:
                print(r["stderr"], file=sys.stderr)
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| ranks x steps | wall s | CPU s | peak RSS MB | summary MB | target (60 s, 2 GB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ok = r["cpu_s"] <= 60 and r["rss_mb"] <= 2048
        print(f"| {r['size']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['rss_mb']:.0f} | "
              f"{r['summary_mb'] or 0:.2f} | {'met (CPU)' if ok else 'NOT met'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
