"""Time linear in the input, for the three shapes that grew faster than it (issue 32 item 4):

    python benchmarks/bench_linear_inputs.py [--shape steps|files|traces|all] [--sizes 5000,10000,20000]

- ``steps``: one CPU trace of N one-op profiler steps (ProfilerStep, aten::mm, a gloo
  all_reduce per step), analyzed as a bare trace: the comm/compute split clipped every interval
  set to every step (40,000 steps: 38 s, x4 per doubling);
- ``files``: one trace next to N JSON files that are not traces (10,000: 51 s);
- ``traces``: N tiny one-step traces of one job (distinct ranks), digested by one worker
  (TRAINPROF_DIGEST_WORKERS=1), which ran a full garbage collection after every trace
  (5,000: 245 s).

Each size runs `trainprof analyze INPUT --out TMP --no-report -q` in a child and prints its wall
time and CPU time (user + system of the child: what to compare on a shared machine), and the
ratio to the previous size: ~2 per doubling is linear, ~4 quadratic.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SIZES = {"steps": [10_000, 20_000, 40_000], "files": [2_500, 5_000, 10_000],
                 "traces": [500, 1_000, 2_000]}


def _ev(name, cat, ts, dur, tid=1, pid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": {}}


def _doc(events, rank=0, world=1):
    return {"schemaVersion": 1, "traceEvents": events,
            "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world}}


def many_steps(folder: Path, n: int) -> Path:
    events = []
    for i in range(n):
        t = 1_000_000 + i * 300
        events += [_ev(f"ProfilerStep#{i}", "user_annotation", t, 300),
                   _ev("aten::mm", "cpu_op", t + 10, 150),
                   _ev("c10d::allreduce_", "cpu_op", t + 170, 100),
                   _ev("gloo:all_reduce", "user_annotation", t + 170, 100, tid=2)]
    p = folder / "steps.pt.trace.json.gz"
    p.write_bytes(gzip.compress(json.dumps(_doc(events)).encode(), 6))
    return p


def many_files(folder: Path, n: int) -> Path:
    d = folder / "traces"
    d.mkdir()
    many_steps(d, 8)
    for i in range(n):
        (d / f"notes-{i:06d}.json").write_text('{"note": %d}' % i)
    return d


def many_traces(folder: Path, n: int) -> Path:
    d = folder / "traces"
    d.mkdir()
    for r in range(n):
        t = 1_000_000
        events = [_ev("ProfilerStep#1", "user_annotation", t, 300, pid=r + 1),
                  _ev("aten::mm", "cpu_op", t + 10, 150, pid=r + 1)]
        (d / f"rank-{r}.pt.trace.json").write_text(json.dumps(_doc(events, r, n)))
    return d


SHAPES = {"steps": many_steps, "files": many_files, "traces": many_traces}


def measure(shape: str, n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-linear-{shape}-") as tmp:
        tmp = Path(tmp)
        inp = SHAPES[shape](tmp, n)
        env = dict(os.environ, TRAINPROF_DIGEST_WORKERS="1")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "trainprof", "analyze", str(inp), "--out",
                               str(tmp / "out"), "--no-report", "-q"], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"shape": shape, "n": n, "rc": proc.returncode, "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2), "err": proc.stderr.strip().splitlines()[-1:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="all", choices=["all", *SHAPES])
    ap.add_argument("--sizes", default=None, help="comma-separated sizes (default per shape)")
    args = ap.parse_args(argv)
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES[shape]
        prev = None
        for n in sizes:
            r = measure(shape, n)
            ratio = f"  x{r['cpu_s'] / prev['cpu_s']:.2f} CPU for x{n / prev['n']:g} input" \
                if prev and prev["cpu_s"] else ""
            print(f"{shape:7s} n={n:>7d}  rc={r['rc']}  wall {r['wall_s']:7.2f} s  "
                  f"cpu {r['cpu_s']:7.2f} s{ratio}" + (f"  ({r['err'][0]})" if r["rc"] not in (0,) else ""),
                  flush=True)
            prev = r
    return 0


if __name__ == "__main__":
    sys.exit(main())
