"""Trace parsing + comm_compute analysis speed on the 216k-event V100 trace (HTA's test data).

    python benchmarks/bench_trace_parse.py [--repeats 3] [--copies 4] [--hta /tmp/hta-venv/bin/python]

Prints the parse's phases in one process (read + inflate, msgspec decode, structs -> columns,
columns -> tables; medians), the median parse time with 1 and 2 pieces (forked children decode
parts of the file), parse time (wall and CPU; CPU time is what to compare on a shared machine,
but it leaves out the children that decode pieces of the file when several CPUs are free),
analysis time, peak RSS, the time to load N copies as N ranks serially and in parallel, and,
with --hta, the time HTA (traceinsight, installed in a separate venv) needs to load the same file.
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from trainprof.analyzers._comm_breakdown import rank_breakdown
from trainprof.settings import available_cpus as _cpus
from trainprof.trace import _decode, _document, _frames, load_traces, parse_trace

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/hta/df_index_resolver/df_index_resolver.json.gz"

HTA_SNIPPET = """
import sys, time, logging, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
t, c = time.perf_counter(), time.process_time()
ta = TraceAnalysis(trace_dir=sys.argv[1])
print(f"{time.perf_counter() - t:.3f} {time.process_time() - c:.3f}")
"""


def _timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def phases(repeats: int) -> dict:
    """Median seconds of each phase of one parse, in this process, the GC paused as in the
    parser: read + inflate, msgspec decode, structs -> columns (freeing the structs included),
    and the rest of a whole parse timed in the same round (columns -> tables, steps)."""
    rounds = []
    parse_trace(FIXTURE)  # warm-up
    for _ in range(repeats):
        with _decode.gc_paused():
            t0 = time.perf_counter()
            data = _frames._read_bytes(FIXTURE)
            t1 = time.perf_counter()
            doc = _document._DECODER.decode(data)
            t2 = time.perf_counter()
            _document._from_structs(doc)
            del doc
            t3 = time.perf_counter()
        parse_trace(FIXTURE)
        t4 = time.perf_counter()
        rounds.append({"read": t1 - t0, "decode": t2 - t1, "columns": t3 - t2,
                       "tables": (t4 - t3) - (t3 - t0)})
        gc.collect()
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--hta", help="python of a venv with traceinsight installed")
    a = ap.parse_args()
    if _document.msgspec is not None:
        print("  phases (median of 5, one process): " + ", ".join(
            f"{k} {v:.3f} s" for k, v in phases(5).items()))
    for pieces in (1, 2):
        med = _median_s(lambda: parse_trace(FIXTURE, pieces=pieces), 5)
        print(f"  parse, {pieces} piece(s): median of 5 {med:.3f} s")
    best = {}
    for fast, pieces in ((True, _cpus()), (True, 1), (False, 1)):
        rows = []
        for _ in range(a.repeats):
            tr, pw, pc = _timed(lambda: parse_trace(FIXTURE, fast=fast, pieces=pieces))
            _, aw, ac = _timed(lambda: rank_breakdown(tr))
            rows.append((pw, pc, aw, ac))
        label = tr.stats["decoder"] + (" (1 process)" if pieces == 1 else f" ({_cpus()} CPUs)")
        best[label] = [min(r[i] for r in rows) for i in range(4)]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{FIXTURE.name}: {tr.stats['events']} events, {tr.stats['complete']} complete")
    for dec, (pw, pc, aw, ac) in best.items():
        print(f"  decoder {dec:22s} parse {pw:.3f} s wall / {pc:.3f} s cpu   comm_compute "
              f"{aw:.3f} s wall / {ac:.3f} s cpu   total {pw + aw:.3f} s wall / {pc + ac:.3f} s cpu")
    print(f"  peak RSS {rss:.0f} MiB")
    if a.copies > 1:
        with tempfile.TemporaryDirectory() as d:
            paths = {}
            for r in range(a.copies):
                paths[r] = Path(d) / f"rank-{r:05d}.pt.trace.json.gz"
                shutil.copy(FIXTURE, paths[r])
            for workers in (1, None):
                (traces, errors), dt, _ = _timed(lambda: load_traces(paths, workers=workers))
                assert len(traces) == a.copies and not errors
                print(f"  {a.copies} ranks, workers={workers or 'auto'}: {dt:.2f} s wall "
                      f"({dt / a.copies:.2f} s/rank)")
    if a.hta:
        with tempfile.TemporaryDirectory() as d:
            shutil.copy(FIXTURE, d)
            out = subprocess.run([a.hta, "-c", HTA_SNIPPET, d], capture_output=True, text=True)
            if out.returncode:
                print("  HTA failed:", out.stderr[-500:])
            else:
                w, c = out.stdout.split()[-2:]
                print(f"  HTA TraceAnalysis load: {float(w):.3f} s wall / {float(c):.3f} s cpu")


if __name__ == "__main__":
    main()
