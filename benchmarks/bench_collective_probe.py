"""Per-op cost of the always-on collective log, without a profiler in the way.

    python benchmarks/bench_collective_probe.py [--ops 4000]

A one-rank gloo group (world size 1: the collective itself is as cheap as it gets, so the
difference is the probe's bookkeeping) issues N small ops of three kinds — c10d all_reduce,
async all_reduce + wait, functional all_reduce + wait (the path DTensor/FSDP2 take) — once in a
process with the probes active (trainprof.session) and once with TRAINPROF_DISABLE=1. Prints µs
per op for each and the difference. Multiply by the ops per step of a job (collectives.jsonl
lines / steps) for the probe's per-step cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, time, statistics, tempfile
import torch, torch.distributed as dist
import trainprof
n = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
ctx = trainprof.session(sys.argv[3], profile_steps="none") if sys.argv[3] != "-" else None
if ctx: ctx.__enter__()
dist.init_process_group("gloo", rank=0, world_size=1)
import torch.distributed._functional_collectives as fc
x = torch.ones(16)
g = dist.group.WORLD
def sync():  dist.all_reduce(x)
def asyn():  dist.all_reduce(x, async_op=True).wait()
def func():  fc.wait_tensor(fc.all_reduce(x, "sum", g))
out = []
for name, f in (("all_reduce", sync), ("all_reduce async+wait", asyn), ("funcol all_reduce+wait", func)):
    for _ in range(200): f()
    best = []
    for _rep in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        best.append((time.perf_counter() - t) / n * 1e6)
        if ctx: trainprof.step()   # flushes the log as a step boundary would
    out.append(f"{name}={min(best):.2f}")
print(";".join(out))
dist.destroy_process_group()
if ctx: ctx.__exit__(None, None, None)
"""


def run(ops: int, probes: bool, port: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if not probes:
            env["TRAINPROF_DISABLE"] = "1"
        p = subprocess.run([sys.executable, "-c", CHILD, str(ops), str(port),
                            os.path.join(tmp, "run") if probes else "-"],
                           capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            raise SystemExit(p.stderr[-2000:])
        last = p.stdout.strip().splitlines()[-1]
        return {k: float(v) for k, v in (kv.split("=") for kv in last.split(";"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3, help="bare/probes pairs, alternated")
    a = ap.parse_args()
    diffs: dict[str, list[float]] = {}
    print(f"{'op':26s} {'bare µs':>9s} {'probes µs':>10s} {'probe cost µs':>14s}")
    for i in range(a.repeats):
        bare = run(a.ops, False, 29611 + 2 * i)
        probed = run(a.ops, True, 29612 + 2 * i)
        for k in bare:
            diffs.setdefault(k, []).append(probed[k] - bare[k])
            print(f"{k:26s} {bare[k]:9.2f} {probed[k]:10.2f} {probed[k] - bare[k]:14.2f}")
    print("median probe cost per op: " + ", ".join(f"{k} {statistics.median(v):.1f} µs"
                                                   for k, v in diffs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
