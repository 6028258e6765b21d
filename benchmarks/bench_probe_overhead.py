"""Always-on probe overhead: median step time with probes vs without, on the same job.

    python benchmarks/bench_probe_overhead.py [--nproc 4] [--steps 30] [--repeats 3]
        [--module trainprof.reference] [-- job args]

Both variants run under `trainprof wrap --profile-steps none --no-analyze` (same launcher,
same environment); the bare variant sets TRAINPROF_DISABLE=1, which turns every probe off.
Step times come from this script's own optimizer-step hook (identical in both variants), so
the comparison does not depend on the probes being measured. Variants alternate to spread
machine noise; the job step time of a run is the median over steps (warm-up steps dropped) of
the slowest rank's step. Prints per-run numbers, the medians and the overhead in %.
For each probes run it also times `trainprof analyze` on the captured run (summary + report).

Without `python -m trainprof.reference` (module missing), a built-in FSDP2 + TP + PP job on
gloo is used. On a shared, busy machine the numbers are noisy: read them with the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 3
BUILTIN_JOB = r'''
import sys
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
H = 256
dist.init_process_group("gloo")
world = dist.get_world_size()
mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
torch.manual_seed(0)

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = MLP(), MLP()
    def forward(self, x):
        return self.b(self.a(x))

model = Stage()
fully_shard(model.a, mesh=mesh["tp"])
parallelize_module(model.b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
stage_idx = mesh.get_coordinate()[0]
stage = PipelineStage(model, stage_idx, 2, torch.device("cpu"), group=mesh["pp"].get_group())
sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda o, t: ((o - t) ** 2).mean())
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, H)
for _ in range(steps):
    opt.zero_grad()
    sched.step(x) if stage_idx == 0 else sched.step(target=x)
    loss = torch.ones(1)
    dist.all_reduce(loss)
    opt.step()
dist.destroy_process_group()
'''


def worker(out_dir: str, module: str, args: list[str]) -> None:
    """Inside each rank: time every optimizer step, then run the job as __main__."""
    import runpy

    from torch.optim.optimizer import register_optimizer_step_post_hook

    stamps: list[int] = []
    cpu: list[int] = []
    leader: list[int] = []

    def hook(opt, a, k):
        if not leader:
            leader.append(id(opt))
        if id(opt) == leader[0]:
            stamps.append(time.perf_counter_ns())
            cpu.append(time.process_time_ns())  # every thread of the rank, probes' included

    register_optimizer_step_post_hook(hook)
    sys.argv = [module] + args
    try:
        if module.endswith(".py"):
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        rank = os.environ.get("RANK", "0")
        durs = [(b - a) / 1e6 for a, b in zip(stamps, stamps[1:])]
        Path(out_dir, f"steps-{rank}.json").write_text(json.dumps(durs))
        cpus = [(b - a) / 1e6 for a, b in zip(cpu, cpu[1:])]
        Path(out_dir, f"cpu-{rank}.json").write_text(json.dumps(cpus))


def job_step_ms(out_dir: Path) -> float:
    per_rank = [json.loads(p.read_text()) for p in sorted(out_dir.glob("steps-*.json"))]
    if not per_rank or not all(per_rank):
        raise SystemExit(f"{out_dir}: no step times recorded (did the job fail?)")
    n = min(len(d) for d in per_rank)
    slowest = [max(d[i] for d in per_rank) for i in range(min(WARMUP, n - 1), n)]
    return statistics.median(slowest)


def job_cpu_ms(out_dir: Path) -> float | None:
    """Median over steps of the ranks' mean CPU time per step (all threads of a rank): less
    sensitive than wall time to other load on a shared machine, and it counts probe threads."""
    per_rank = [json.loads(p.read_text()) for p in sorted(out_dir.glob("cpu-*.json"))]
    if not per_rank or not all(per_rank):
        return None
    n = min(len(d) for d in per_rank)
    mean = [sum(d[i] for d in per_rank) / len(per_rank) for i in range(min(WARMUP, n - 1), n)]
    return statistics.median(mean)


def run_once(variant: str, nproc: int, module: str, args: list[str], tmp: Path, i: int) -> dict:
    out = tmp / f"{variant}-{i}"
    out.mkdir()
    env = dict(os.environ)
    env.pop("TRAINPROF_DISABLE", None)
    if variant == "bare":
        env["TRAINPROF_DISABLE"] = "1"
    cmd = [sys.executable, "-m", "trainprof", "wrap", "--out", str(out / "run"), "--no-analyze",
           "--profile-steps", "none", "--", sys.executable, "-m", "torch.distributed.run",
           "--standalone", "--nproc-per-node", str(nproc), __file__, "--worker", str(out),
           module, *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    res = {"variant": variant, "step_ms": job_step_ms(out), "cpu_ms": job_cpu_ms(out),
           "wall_s": time.monotonic() - t0}
    if variant == "probes":  # analyze time of the captured run (summary + report)
        t1 = time.monotonic()
        a = subprocess.run([sys.executable, "-m", "trainprof", "analyze", str(out / "run"), "--quiet"],
                           env=env, capture_output=True, text=True)
        if a.returncode == 0:
            res["analyze_s"] = time.monotonic() - t1
    coll = list((out / "run" / "ranks").glob("rank-*/collectives.jsonl"))
    if coll:
        n = sum(1 for p in coll for _ in open(p))
        res["collective_records_per_rank"] = n / len(coll)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--module", default="trainprof.reference")
    p.add_argument("job_args", nargs="*")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        tmp = Path(tmp)
        module, args = a.module, list(a.job_args)
        import importlib.util

        if module == "trainprof.reference" and importlib.util.find_spec(
                "trainprof.reference.__main__") is None:
            module = str(tmp / "builtin_job.py")
            Path(module).write_text(BUILTIN_JOB)
            args = [str(a.steps)] + args
            print("trainprof.reference not available: using the built-in FSDP2+TP+PP job")
        elif module == "trainprof.reference" and "--steps" not in args:
            args += ["--steps", str(a.steps)]
        results = []
        for i in range(a.repeats):
            for variant in ("probes", "bare") if i % 2 == 0 else ("bare", "probes"):
                r = run_once(variant, a.nproc, module, args, tmp, i)
                results.append(r)
                print(f"  {variant:6s} run {i}: median step {r['step_ms']:.2f} ms, "
                      f"CPU {r['cpu_ms']:.2f} ms/rank "
                      f"(wall {r['wall_s']:.1f} s"
                      + (f", {r['collective_records_per_rank']:.0f} collective records/rank"
                         if "collective_records_per_rank" in r else "")
                      + (f", analyze {r['analyze_s']:.1f} s" if "analyze_s" in r else "") + ")", flush=True)
    probes = [r["step_ms"] for r in results if r["variant"] == "probes"]
    bare = [r["step_ms"] for r in results if r["variant"] == "bare"]
    mp, mb = statistics.median(probes), statistics.median(bare)
    print(f"median step: probes {mp:.2f} ms, bare {mb:.2f} ms over {a.repeats} runs each "
          f"({a.nproc} ranks, {a.steps} steps, first {WARMUP} dropped)")
    print(f"probe overhead: {100 * (mp - mb) / mb:+.2f} %  (spread: probes {min(probes):.2f}–"
          f"{max(probes):.2f} ms, bare {min(bare):.2f}–{max(bare):.2f} ms)")
    pc = [r["cpu_ms"] for r in results if r["variant"] == "probes" and r["cpu_ms"] is not None]
    bc = [r["cpu_ms"] for r in results if r["variant"] == "bare" and r["cpu_ms"] is not None]
    if pc and bc:
        cp, cb = statistics.median(pc), statistics.median(bc)
        print(f"CPU per rank and step: probes {cp:.2f} ms, bare {cb:.2f} ms: {100 * (cp - cb) / cb:+.2f} %"
              f"  (spread: probes {min(pc):.2f}–{max(pc):.2f}, bare {min(bc):.2f}–{max(bc):.2f})")


if __name__ == "__main__":
    main()
