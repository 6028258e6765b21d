"""Per-op cost of the always-on collective log, without a profiler in the way.

    python benchmarks/bench_collective_probe.py [--ops 500] [--rounds 20] [--backend fake|gloo]

One process, one rank, the collective log alone (every other probe off): blocks of N ops of each
kind alternate with and without a `trainprof.session` (the patches stay installed, inert, when no
session is open, so "off" still pays their ~1 µs of pass-through), and each round's on-block is
paired with the off-block just before it; the median over rounds of the difference is the probe's
cost per op. Paired blocks in one process resolve ~1 µs where separate processes could not
(±10 µs: memory layout, CPU frequency, neighbours).

Kinds: c10d all_reduce (sync), async all_reduce + wait, async all_gather_into_tensor + wait (the
FSDP2 path) and a functional all_reduce + wait_tensor (DTensor / tensor parallel).
The default "fake" backend (torch's FakeProcessGroup: every op completes at once) leaves only the
Python around the op, so the probe's share is not hidden in the backend's latency; `--backend
gloo` runs a world-size-1 gloo group instead. Multiply by the ops per step of a job
(collectives.jsonl lines / steps) for the probe's per-step cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=500, help="ops per block")
    ap.add_argument("--rounds", type=int, default=20, help="off/on block pairs per kind")
    ap.add_argument("--backend", choices=("fake", "gloo"), default="fake")
    a = ap.parse_args()
    os.environ.pop("TRAINPROF_DISABLE", None)
    from trainprof.probes.session import ATTACHED_PROBES

    os.environ["TRAINPROF_PROBES_OFF"] = ",".join(n.rsplit(".", 1)[-1] for n in ATTACHED_PROBES
                                                  if not n.endswith(".collectives"))
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    import trainprof

    if a.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29613"))
        dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.ones(16)
    out = torch.empty(16 * dist.get_world_size())
    g = dist.group.WORLD
    kinds = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_reduce async+wait": lambda: dist.all_reduce(x, async_op=True).wait(),
        "all_gather_into_tensor async+wait":
            lambda: dist.all_gather_into_tensor(out, x, async_op=True).wait(),
        "funcol all_reduce+wait_tensor": lambda: fc.wait_tensor(fc.all_reduce(x, "sum", g)),
    }

    def block(f) -> float:
        t = time.perf_counter()
        for _ in range(a.ops):
            f()
        return (time.perf_counter() - t) / a.ops * 1e6

    res: dict[str, tuple[list, list]] = {k: ([], []) for k in kinds}
    n_records = 0
    with tempfile.TemporaryDirectory() as root:
        with trainprof.session(os.path.join(root, "warm"), profile_steps="none"):
            for f in kinds.values():  # installs the patches; warms both paths
                block(f)
        for r in range(a.rounds):
            for k, f in kinds.items():
                off = block(f)
                run = os.path.join(root, f"r{r}")
                with trainprof.session(run, profile_steps="none"):
                    on = block(f)
                res[k][0].append(off)
                res[k][1].append(on)
        import glob

        n_records = sum(1 for p in glob.glob(os.path.join(root, "r*", "ranks", "*", "collectives.jsonl"))
                        for _ in open(p))
    dist.destroy_process_group()
    print(f"collective log, {a.backend} backend: {a.rounds} rounds x {a.ops} ops per kind and "
          f"variant; {n_records} records written by the 'on' blocks")
    print(f"{'op':36s} {'off µs':>8s} {'on µs':>8s} {'probe µs':>9s}  (median of paired rounds, p10..p90)")
    for k, (off, on) in res.items():
        d = sorted(b - o for o, b in zip(off, on))
        q = statistics.quantiles(d, n=10) if len(d) > 1 else [d[0]] * 9
        print(f"{k:36s} {statistics.median(off):8.2f} {statistics.median(on):8.2f} "
              f"{statistics.median(d):9.2f}  ({q[0]:.1f}..{q[-1]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
