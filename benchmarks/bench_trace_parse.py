"""Trace parsing + comm_compute analysis speed on the 216k-event V100 trace (HTA's test data).

    python benchmarks/bench_trace_parse.py [--copies N]

Prints parse time, analysis time, peak RSS, and (with --copies) the time to load N copies as N
ranks in parallel. Reference point: HTA needs ~4.7 s just to load this trace on this machine.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from trainprof.analyzers.comm_compute import rank_breakdown
from trainprof.trace import load_trace, load_traces

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/hta/df_index_resolver/df_index_resolver.json.gz"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copies", type=int, default=4)
    a = ap.parse_args()
    parse, analyze = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        tr = load_trace(FIXTURE)
        t1 = time.perf_counter()
        rank_breakdown(tr)
        t2 = time.perf_counter()
        parse.append(t1 - t0)
        analyze.append(t2 - t1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"events: {tr.stats['events']}  parse: best {min(parse):.3f} s  "
          f"comm_compute: best {min(analyze):.3f} s  total: {min(parse) + min(analyze):.3f} s  "
          f"peak RSS: {rss:.0f} MiB")
    if a.copies > 1:
        with tempfile.TemporaryDirectory() as d:
            paths = {}
            for r in range(a.copies):
                paths[r] = Path(d) / f"rank-{r:05d}.pt.trace.json.gz"
                shutil.copy(FIXTURE, paths[r])
            for workers in (1, None):
                t0 = time.perf_counter()
                traces, errors = load_traces(paths, workers=workers)
                dt = time.perf_counter() - t0
                print(f"{a.copies} ranks, workers={workers or 'auto'}: {dt:.2f} s "
                      f"({dt / a.copies:.2f} s/rank)")


if __name__ == "__main__":
    main()
