"""Analysis cost against the number of ranks, on runs synthesized from a real small one.

    python benchmarks/bench_scale.py [--ranks 8,64,256,1024,4096] [--traces 8] [--report]
                                     [--straggler-at 777 --delay-ms 300] [--source RUN]
                                     [--work DIR] [--keep]

For each N: benchmarks/synth_run.py writes an N-rank run directory (8 ranks per host, ±3 %
step jitter, ``--traces`` ranks keep a profiler trace), then ``trainprof analyze --no-report``
runs on it as a subprocess, after ``python -m trainprof.analysis.reduce`` built the trace digests as
each node's ``wrap`` does at the end of a job (timed apart; ``--no-reduce``: analyze builds
them) (and, with ``--report``, ``trainprof analyze`` with the HTML report)
under ``/usr/bin/time -v`` where present (else getrusage(RUSAGE_CHILDREN) of a fresh child).
Prints wall time (and user+sys CPU: on a shared machine the wall time includes waiting for
the CPU), max RSS, summary.json size, findings, and the growth per doubling of ranks
between consecutive sizes ((t2/t1) ** (1 / log2(N2/N1))), checked against the targets:
1,024 ranks under 20 s and 1 GB, 4,096 under 90 s and 2 GB, growth ≤ 2.1x per doubling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_run import synthesize  # noqa: E402

TARGETS = {1024: (20.0, 1024.0), 4096: (90.0, 2048.0)}  # ranks: (seconds, MB)
GROWTH = 2.1


def measure(cmd: list[str]) -> dict:
    """Wall seconds and max RSS (MB) of a child process."""
    timev = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    t0 = time.perf_counter()
    if timev:
        p = subprocess.run([timev, "-v", *cmd], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
        rss = int(m.group(1)) / 1024 if m else float("nan")
        cpu = sum(float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", p.stderr))
    else:  # a fresh interpreter runs the command, so RUSAGE_CHILDREN is that command's alone
        probe = ("import resource,subprocess,sys;p=subprocess.run(sys.argv[1:]);"
                 "print('RSSKB',resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,file=sys.stderr);"
                 "sys.exit(p.returncode)")
        p = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        m = re.search(r"RSSKB (\d+)", p.stderr)
        rss = int(m.group(1)) / 1024 if m else float("nan")
        cpu = float("nan")
    return {"wall_s": wall, "cpu_s": cpu, "rss_mb": rss, "rc": p.returncode, "stderr": p.stderr}


def run_one(n: int, a, work: Path) -> dict:
    run = work / f"run-{n}"
    straggler = a.straggler_at if a.straggler_at is not None and a.straggler_at < n else None
    t0 = time.perf_counter()
    synthesize(run, n, a.source, traces=a.traces, straggler=straggler,
               delay_ms=a.delay_ms if straggler is not None else 0.0, force=True)
    synth_s = time.perf_counter() - t0
    out = {"ranks": n, "synth_s": synth_s,
           "input_mb": sum(f.stat().st_size for f in run.rglob("*") if f.is_file()) / 2 ** 20}
    if not a.no_reduce:  # what each node's wrap does at the end of the job: the trace digests
        m = measure([sys.executable, "-m", "trainprof.analysis.reduce", str(run)])
        out["reduce"] = {"wall_s": m["wall_s"], "rss_mb": m["rss_mb"], "rc": m["rc"]}
    modes = [("no_report", ["--no-report"])] + ([("report", [])] if a.report else [])
    for name, extra in modes:
        res = work / f"out-{n}-{name}"
        cmd = ["trainprof", "analyze", str(run), "--out", str(res), "-q", *extra]
        m = measure(cmd)
        if m["rc"] != 0:
            print(f"  analyze failed ({m['rc']}): {m['stderr'][-2000:]}", file=sys.stderr)
        summ = res / "summary.json"
        out[name] = {"wall_s": m["wall_s"], "cpu_s": m["cpu_s"], "rss_mb": m["rss_mb"], "rc": m["rc"],
                     "summary_mb": summ.stat().st_size / 2 ** 20 if summ.exists() else None}
        if name == "no_report" and summ.exists():
            s = json.loads(summ.read_text())
            out["findings"] = [(f["kind"], f["ranks"][:4] + (["…"] if len(f["ranks"]) > 4 else []))
                               for f in s["findings"]]
            out["analyzer_seconds"] = s.get("analyzer_seconds")
            out["errors"] = [e.get("analyzer") + ": " + e.get("error", "")[:200] for e in s.get("errors", [])]
        if name == "report" and (res / "report.html").exists():
            out[name]["report_mb"] = (res / "report.html").stat().st_size / 2 ** 20
    if not a.keep:
        shutil.rmtree(run, ignore_errors=True)
    return out


def growth(rows: list[dict], key: str, mode: str) -> list[str]:
    out = []
    for a, b in zip(rows, rows[1:]):
        x, y = a[mode][key], b[mode][key]
        doublings = math.log2(b["ranks"] / a["ranks"])
        g = (y / x) ** (1 / doublings) if x and y and doublings else float("nan")
        out.append(f"{a['ranks']}→{b['ranks']}: {g:.2f}x{' (over ' + str(GROWTH) + 'x)' if g > GROWTH else ''}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="8,64,256,1024,4096", help="comma list of N")
    ap.add_argument("--traces", type=int, default=8)
    ap.add_argument("--report", action="store_true", help="also time analyze with report.html")
    ap.add_argument("--straggler-at", type=int, default=None, help="inject a straggler at this rank")
    ap.add_argument("--delay-ms", type=float, default=300.0)
    ap.add_argument("--source", default=None, help="source run (default: the repository's fixture)")
    ap.add_argument("--work", type=Path, default=None, help="where runs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the synthesized runs")
    ap.add_argument("--no-reduce", action="store_true",
                    help="leave the trace digests to analyze (default: built first by "
                         "python -m trainprof.analysis.reduce, as wrap does at the end of a job)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="trainprof-bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sorted(int(x) for x in a.ranks.split(",")):
        r = run_one(n, a, work)
        rows.append(r)
        line = (f"{n:5d} ranks ({r['input_mb']:.0f} MB in, synth {r['synth_s']:.1f} s): "
                f"analyze --no-report {r['no_report']['wall_s']:.1f} s "
                f"({r['no_report']['cpu_s']:.1f} s CPU, children included), "
                f"{r['no_report']['rss_mb']:.0f} MB max RSS, summary "
                f"{(r['no_report']['summary_mb'] or 0):.2f} MB")
        if "reduce" in r:
            line += (f"; trace digests (reduce, as at the end of the job) "
                     f"{r['reduce']['wall_s']:.1f} s, {r['reduce']['rss_mb']:.0f} MB")
        if "report" in r:
            line += (f"; with report {r['report']['wall_s']:.1f} s, {r['report']['rss_mb']:.0f} MB, "
                     f"report.html {r['report'].get('report_mb', 0):.2f} MB")
        print(line, flush=True)
        print(f"       findings: {r.get('findings')}", flush=True)
        if r.get("errors"):
            print(f"       errors: {r['errors']}", flush=True)
        print(f"       analyzer seconds: {r.get('analyzer_seconds')}", flush=True)
        for target_n, (t_max, mb_max) in TARGETS.items():
            if n == target_n:
                ok = r["no_report"]["wall_s"] <= t_max and r["no_report"]["rss_mb"] <= mb_max
                print(f"       target {t_max:.0f} s / {mb_max:.0f} MB: {'met' if ok else 'NOT met'}")
    for mode in ("no_report", "report"):
        if len(rows) > 1 and mode in rows[0]:
            print(f"growth per doubling ({mode}): time {', '.join(growth(rows, 'wall_s', mode))}; "
                  f"memory {', '.join(growth(rows, 'rss_mb', mode))}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2, default=str))
    if not a.work and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
