"""Cost of one `trainprof watch` refresh (analyzers/live.py snapshot + its rendering) on a
synthetic run directory of R ranks with S steps each (steps.jsonl and heartbeat.jsonl as the
probes write them); prints the wall time and peak RSS of a refresh.

    python benchmarks/bench_watch.py [--ranks 1024] [--steps 20000] [--dir /tmp/bench-watch]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from pathlib import Path


def make(root: Path, ranks: int, steps: int) -> None:
    now = time.time_ns()
    t0 = now - steps * 10_000_000
    lines = "".join(json.dumps({"step": s, "start_ns": t0 + s * 10_000_000,
                                "end_ns": t0 + (s + 1) * 10_000_000, "dur_ms": 10.0,
                                "source": "optimizer"}) + "\n" for s in range(steps))
    beat = json.dumps({"t_ns": now, "event": "progress", "pid": 1, "step": steps}) + "\n"
    for r in range(ranks):
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        (d / "steps.jsonl").write_text(lines)
        (d / "heartbeat.jsonl").write_text(beat * 200)
    (root / "manifest.json").write_text(json.dumps({"schema_version": 1, "status": "running",
                                                    "launcher_pid": os.getpid(),
                                                    "host": os.uname().nodename}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--dir", default="/tmp/bench-watch")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    make(root, a.ranks, a.steps)
    from rich.console import Console

    from trainprof.analyzers.live import snapshot
    from trainprof.reports.live import render_watch

    t = time.perf_counter()
    snap = snapshot(root)
    c = Console(record=True, width=120, file=open(os.devnull, "w"))
    c.print(render_watch(snap))
    dt = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{a.ranks} ranks x {a.steps} steps: one refresh {dt:.2f} s, peak RSS {rss:.0f} MiB, "
          f"{snap['steps_per_s']:.0f} steps/s, {len(c.export_text().splitlines())} lines")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
