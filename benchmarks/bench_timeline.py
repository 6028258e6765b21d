"""Time and size of `trainprof timeline` and the critical path on synthesized runs.

    python benchmarks/bench_timeline.py [--ranks 64,256,1024] [--max-mb 100]

For each size: a run synthesized from the 4-rank source (benchmarks/synth_run.py, 2 traces, a
straggler), then the critical-path analyzer (the collectives frame it reads included) and the
timeline (findings from the stragglers analyzer), with wall time, peak RSS and file size.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_run import synthesize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--max-mb", type=float, default=100)
    a = ap.parse_args()
    from trainprof.analyzers import critical_path, stragglers
    from trainprof.analysis.run import RunDir
    from trainprof.analysis.timeline import make

    print("ranks  path_s  timeline_s  file_MB  events  top_rank(share)  rss_MB")
    for n in (int(x) for x in a.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            strag = n * 3 // 4 + 1
            run_dir = synthesize(Path(tmp) / "run", n, traces=2, straggler=strag, delay_ms=300.0)
            run = RunDir(run_dir)
            t0 = time.perf_counter()
            m = critical_path.analyze(run).metrics
            t1 = time.perf_counter()
            found = [f.to_dict() for f in stragglers.analyze(run).findings]
            t2 = time.perf_counter()
            info = make(run_dir, Path(tmp) / "t.json", findings=found, max_mb=a.max_mb)
            t3 = time.perf_counter()
            top = m["job"]["by_rank"][0]
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"{n:5d}  {t1 - t0:6.1f}  {t3 - t2:10.1f}  {info['bytes'] / 2**20:7.1f}  "
                  f"{info['events']:6d}  {top['rank']}({top['share']:.2f}) [straggler {strag}]  {rss:6.0f}")


if __name__ == "__main__":
    main()
