"""A/B of the always-on probe set: blocks of steps alternated in one process, or whole runs.

Blocks of steps in one process (default); whole wrapped runs alternated with `--whole-runs` (below).

In process, on the one-rank reference workload:

    python benchmarks/bench_probes_ab.py [--block 20] [--rounds 8] [--warmup 3] [-- reference args]
    torchrun --nproc-per-node 8 benchmarks/bench_probes_ab.py [...] -- --dp 2 --pp 2 --tp 2

Under torchrun (WORLD_SIZE > 1) the reference's own training loop runs with every rank entering
and leaving its session at the same steps; rank 0 reports (synchronous training: its step time is
the job's).

Separate runs cannot resolve 1 % on a shared machine (run-to-run spread ±5-8 %: memory layout,
CPU frequency, neighbours). Here one process builds the reference model once (the model, data
loader, AdamW and the two world-group collectives per step of `python -m trainprof.reference`
with dp = pp = tp = 1) and runs the same training loop in alternating blocks of `--block` steps:
"on" inside `trainprof.session()` (every probe of a wrapped run attached, profiler window off),
"off" with no session. The first `--warmup` steps of every block are not timed (a new session
discovers modules and registers hooks on its first steps; the bare block re-warms caches).
Overhead: per round, median(on block) / median(off block) of the two adjacent blocks (drift hits
both alike; which goes first alternates), then the median over rounds with a bootstrap 95 %
interval. The calibration probe is left out (TRAINPROF_PROBES_OFF): a one-time microbenchmark at
activation, not a per-step cost, and its ~1.5 s per session would forbid short blocks.

What "off" still pays: the patches a session installs stay in place, inert, after it closes
(a Python wrapper around each ProcessGroup method and around torch.autograd.backward that finds
no session: ~1 µs each, a few µs per step here) — the overhead is understated by that much.

`--whole-runs`: median step time of whole wrapped runs with probes vs without, on the same job.

    python benchmarks/bench_probes_ab.py --whole-runs [--nproc 4] [--steps 30] [--repeats 3]
        [--module trainprof.reference] [-- job args]

Both variants run under `trainprof wrap --profile-steps none --no-analyze` (same launcher,
same environment); the bare variant sets TRAINPROF_DISABLE=1, which turns every probe off.
Step times come from this script's own optimizer-step hook (identical in both variants), so
the comparison does not depend on the probes being measured. Variants alternate to spread
machine noise; the job step time of a run is the median over steps (warm-up steps dropped) of
the slowest rank's step. Prints per-run numbers, the medians and the overhead in %.
For each probes run it also times `trainprof analyze` on the captured run (summary + report).

Without `python -m trainprof.reference` (module missing), the FSDP2 + TP + PP job on gloo of
tests/support/jobs/fsdp_tp_pp_job.py is used. On a shared, busy machine the numbers are
noisy: read them with the spread.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # a rank of a --whole-runs job
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    if "--whole-runs" in sys.argv[1:(sys.argv + ["--"]).index("--")]:
        sys.argv.remove("--whole-runs")
        whole_runs_main(sys.argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--whole-runs", action="store_true",
                    help="alternate whole wrapped runs instead (its options: --whole-runs --help)")
    ap.add_argument("--block", type=int, default=10, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=30, help="on/off block pairs")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each block")
    ap.add_argument("--json", help="also write the wall-time result to this file (one rank)")
    ap.add_argument("ref", nargs=argparse.REMAINDER, help="-- reference args (dp/pp/tp must stay 1)")
    a = ap.parse_args()
    ref_args = [x for x in a.ref if x != "--"]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return mesh_main(a, ref_args)

    import torch
    import torch.distributed as dist

    import trainprof
    from trainprof.reference.config import parse_args
    from trainprof.reference.data import loader
    from trainprof.reference.model import build_full, extract_stage, loss_fn
    from trainprof.reference.parallel import layer_layout

    total_steps = a.rounds * 2 * (a.block + a.warmup) + 5
    cfg = parse_args([*ref_args, "--steps", str(total_steps)])
    if cfg.dp * cfg.pp * cfg.tp != 1:
        sys.exit("bench_probes_ab: one rank only (dp = pp = tp = 1)")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dev = torch.device("cuda" if cfg.device in ("cuda", "auto") and torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    layout = layer_layout(cfg.layers, 1, {})
    model = extract_stage(build_full(cfg, cfg.layers), layout[0], first=True, last=True,
                          autocast_dtype=torch.bfloat16 if cfg.dtype == "bf16" and dev.type == "cuda" else None)
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = iter(loader(cfg, 0))
    world = dist.group.WORLD

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():  # the reference loop's body for dp = pp = tp = 1
        x, y = next(data)
        x, y = x.to(dev), y.to(dev)
        local = torch.zeros((), device=dev)
        for xm, ym in zip(x.chunk(cfg.micro_batches), y.chunk(cfg.micro_batches)):
            loss = loss_fn(model(xm), ym)
            (loss / cfg.micro_batches).backward()
            local += loss.detach() / cfg.micro_batches
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = local.detach().clone()
        dist.all_reduce(total, group=world)
        stats = torch.tensor([0.0, 0.0], device=dev)
        gathered = torch.empty(2, device=dev)
        dist.all_gather_into_tensor(gathered, stats, group=world)
        return float(total)

    def block(n_timed, v):
        out, cpu_out = [], []
        for i in range(a.warmup + n_timed):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync()
            if i >= a.warmup:
                out.append((time.perf_counter() - t0) * 1e3)
                cpu_out.append((time.process_time() - c0) * 1e3)
        cpu[v].append(cpu_out)
        return out

    _probes_env()
    blocks = {"on": [], "off": []}
    cpu = {"on": [], "off": [], "warm-up": []}  # process CPU time per step (all threads), ms
    with tempfile.TemporaryDirectory() as root:
        block(2, "warm-up")  # process warm-up
        for r in range(a.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")  # no fixed position in a pair
            for v in order:
                if v == "on":
                    with trainprof.session(os.path.join(root, f"run{r}"), profile_steps="none"):
                        blocks["on"].append(block(a.block, "on"))
                else:
                    blocks["off"].append(block(a.block, "off"))
        import glob

        # evidence that the "on" blocks ran the probes: the step records their sessions wrote
        step_records = sum(1 for f in glob.glob(os.path.join(root, "run*", "ranks", "*", "steps.jsonl"))
                           for _ in open(f))
    dist.destroy_process_group()
    res = _report(f"reference 1 rank on {dev} ({' '.join(ref_args) or 'defaults'})", a, blocks)
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({**res, "device": str(dev), "ref_args": ref_args, "rounds": a.rounds,
                       "block": a.block, "warmup": a.warmup, "step_records_on": step_records,
                       "probes_off": os.environ["TRAINPROF_PROBES_OFF"]}, f, indent=1)
    # CPU time is blind to time the process waited for a CPU (neighbours on a shared host)
    _report("CPU time per step (process, all threads)", a, {k: cpu[k] for k in ("on", "off")},
            unit="CPU ms")
    return 0


def _probes_env() -> None:
    os.environ.pop("TRAINPROF_DISABLE", None)
    # calibration is a one-time microbenchmark at activation (~1.5 s on CPU), not a per-step cost:
    # leaving it out lets blocks be short, so machine drift hits a pair's two blocks alike
    off = {x for x in os.environ.get("TRAINPROF_PROBES_OFF", "").split(",") if x} | {"calibration"}
    os.environ["TRAINPROF_PROBES_OFF"] = ",".join(sorted(off))


def _report(title: str, a, blocks: dict, unit: str = "ms") -> dict:
    med = {k: statistics.median([t for b in v for t in b]) for k, v in blocks.items()}
    # paired: each round's on-block against its adjacent off-block, then the median over rounds
    ratios = [statistics.median(on) / statistics.median(off)
              for on, off in zip(blocks["on"], blocks["off"])]
    over = 100 * (statistics.median(ratios) - 1)
    rng = random.Random(0)
    boots = sorted(100 * (statistics.median(rng.choices(ratios, k=len(ratios))) - 1) for _ in range(4000))
    lo, hi = boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots)) - 1]
    print(f"{title}: {a.rounds} rounds x {a.block} timed steps per variant; probes off: "
          f"{os.environ['TRAINPROF_PROBES_OFF']}")
    for k in ("off", "on"):
        allv = [t for b in blocks[k] for t in b]
        q = statistics.quantiles(allv, n=10)
        print(f"  {k:>3}: median {med[k]:8.2f} {unit}  p10 {q[0]:8.2f}  p90 {q[-1]:8.2f}")
    print(f"  per-round on/off ratios: {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"  probe overhead {over:+.2f} % (median of paired rounds; 95 % bootstrap interval "
          f"{lo:+.2f} .. {hi:+.2f} %), pooled medians {med['on'] - med['off']:+.3f} {unit}/step")
    return {"overhead_pct": over, "ci95_pct": [lo, hi], "ratios": ratios,
            "median_ms": {"on": med["on"], "off": med["off"]},
            "steps_timed": {k: sum(len(b) for b in v) for k, v in blocks.items()}}


def mesh_main(a, ref_args) -> int:
    """Under torchrun: the reference's own 3D-parallel loop (trainprof.reference.train.main),
    every rank entering and leaving its session at the same steps (a step callback); rank 0's
    step times (synchronous training: the whole job's) form the blocks."""
    import trainprof
    from trainprof.reference import train

    _probes_env()
    per_round = 2 * (a.block + a.warmup)
    lead = 2  # process warm-up steps, probes off
    total = lead + a.rounds * per_round + 1  # the last step closes any open session
    variant = {}
    for r in range(a.rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for h, v in enumerate(order):
            for i in range(a.block + a.warmup):
                variant[lead + r * per_round + h * (a.block + a.warmup) + i] = (v, r, i >= a.warmup)
    root = os.path.join(tempfile.gettempdir(), f"trainprof-ab-{os.environ.get('MASTER_PORT', 'x')}")
    state = {"cm": None, "t": None, "cpu": None, "step": None}
    blocks = {"on": {}, "off": {}}
    cpu = {"on": {}, "off": {}}  # this rank's process CPU time per step (all threads), ms
    gc_ms = {"on": [], "off": []}  # time in Python's cyclic GC per timed step, ms
    gc_state = {"t": 0.0, "acc": 0.0}

    def gc_cb(phase, info):  # probes allocate records per op: do they make the job collect more?
        if phase == "start":
            gc_state["t"] = time.perf_counter()
        else:
            gc_state["acc"] += time.perf_counter() - gc_state["t"]

    gc.callbacks.append(gc_cb)

    def on_step(step):
        now, now_cpu = time.perf_counter(), time.process_time()
        prev = variant.get(state["step"])
        if prev is not None and prev[2]:  # the previous step was a timed one: its duration
            blocks[prev[0]].setdefault(prev[1], []).append((now - state["t"]) * 1e3)
            cpu[prev[0]].setdefault(prev[1], []).append((now_cpu - state["cpu"]) * 1e3)
            gc_ms[prev[0]].append(gc_state["acc"] * 1e3)
        gc_state["acc"] = 0.0
        want = variant.get(step, ("off", None, False))[0]
        if want == "on" and state["cm"] is None:
            state["cm"] = trainprof.session(os.path.join(root, f"s{step}"), profile_steps="none")
            state["cm"].__enter__()
        elif want == "off" and state["cm"] is not None:
            state["cm"].__exit__(None, None, None)
            state["cm"] = None
        state["t"], state["cpu"], state["step"] = time.perf_counter(), time.process_time(), step

    rc = train.main([*ref_args, "--steps", str(total)], on_step=on_step)
    import json

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f"cpu-{rank}.json.tmp"), "w") as f:
        json.dump({**cpu, "gc": gc_ms}, f)
    os.replace(os.path.join(root, f"cpu-{rank}.json.tmp"), os.path.join(root, f"cpu-{rank}.json"))
    if rank == 0:
        import glob
        import shutil

        deadline = time.time() + 120
        files = [os.path.join(root, f"cpu-{r}.json") for r in range(world)]
        while not all(os.path.exists(f) for f in files) and time.time() < deadline:
            time.sleep(0.2)
        per_rank = [json.load(open(f)) for f in files if os.path.exists(f)]

        # evidence that the "on" blocks ran the probes: their step records, every rank
        n = sum(1 for f in glob.glob(os.path.join(root, "s*", "ranks", "*", "steps.jsonl"))
                for _ in open(f))
        print(f"  sessions {len(glob.glob(os.path.join(root, 's*')))}, step records written {n}")
        shutil.rmtree(root, ignore_errors=True)
        by = {k: [v[r] for r in sorted(v)] for k, v in blocks.items()}
        _report(f"reference {world} ranks ({' '.join(ref_args)})", a, by)
        if len(per_rank) == world:
            # the job's CPU per step, every rank and thread summed: on an oversubscribed host
            # (8 ranks, 2 cores) the step's wall time follows it; on a node with a core per
            # rank, a rank's own CPU cost bounds what its probes can add to the critical path
            tot = {k: [[sum(x) for x in zip(*(pr[k][str(r)] for pr in per_rank))]
                       for r in sorted(int(r) for r in per_rank[0][k])] for k in ("on", "off")}
            _report(f"CPU time per step, {world} ranks summed, all threads", a, tot, unit="CPU ms")
            for k in ("off", "on"):
                meds = [statistics.median([t for b in pr[k].values() for t in b]) for pr in per_rank]
                print(f"  {k:>3} CPU ms/step by rank: " + " ".join(f"{m:.0f}" for m in meds))
            for k in ("off", "on"):
                means = [statistics.fmean(pr["gc"][k]) for pr in per_rank if pr["gc"][k]]
                print(f"  {k:>3} cyclic GC ms/step by rank (mean): " + " ".join(f"{m:.1f}" for m in means))
        else:
            print(f"  CPU time: {len(per_rank)} of {world} ranks reported")
    return rc


# ------------------------------ --whole-runs

WHOLE_RUNS_DOC = """Always-on probe overhead: median step time with probes vs without, on the same job.

    python benchmarks/bench_probes_ab.py --whole-runs [--nproc 4] [--steps 30] [--repeats 3]
        [--module trainprof.reference] [-- job args]

Both variants run under `trainprof wrap --profile-steps none --no-analyze` (same launcher,
same environment); the bare variant sets TRAINPROF_DISABLE=1, which turns every probe off.
Step times come from this script's own optimizer-step hook (identical in both variants), so
the comparison does not depend on the probes being measured. Variants alternate to spread
machine noise; the job step time of a run is the median over steps (warm-up steps dropped) of
the slowest rank's step. Prints per-run numbers, the medians and the overhead in %.
For each probes run it also times `trainprof analyze` on the captured run (summary + report).

Without `python -m trainprof.reference` (module missing), the FSDP2 + TP + PP job on gloo of
tests/support/jobs/fsdp_tp_pp_job.py is used. On a shared, busy machine the numbers are
noisy: read them with the spread.
"""

WARMUP = 3
# without the reference: the tests' FSDP2 + TP + PP job, wider and with one all_reduce per step
FSDP_TP_PP_JOB = Path(__file__).resolve().parents[1] / "tests" / "support" / "jobs" / "fsdp_tp_pp_job.py"
FSDP_TP_PP_ARGS = ["--hidden", "256", "--microbatches", "4", "--batch", "64", "--lr", "1e-3",
                   "--collectives", "loss"]


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


def whole_runs_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog=f"{sys.argv[0]} --whole-runs",
                                description=WHOLE_RUNS_DOC.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--module", default="trainprof.reference")
    p.add_argument("job_args", nargs="*")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        tmp = Path(tmp)
        module, args = a.module, list(a.job_args)
        import importlib.util

        if module == "trainprof.reference" and importlib.util.find_spec(
                "trainprof.reference.__main__") is None:
            module = str(FSDP_TP_PP_JOB)
            args = [str(a.steps), *FSDP_TP_PP_ARGS] + args
            print(f"trainprof.reference not available: using {FSDP_TP_PP_JOB.name} (FSDP2+TP+PP)")
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
        # paired by repeat (the two runs of a repeat ran back to back): per pair the ratio of
        # CPU per rank and step, the median over pairs and its 95 % bootstrap interval
        pairs = [(p_["cpu_ms"], b_["cpu_ms"]) for p_, b_ in zip(
            [r for r in results if r["variant"] == "probes"],
            [r for r in results if r["variant"] == "bare"])
            if p_["cpu_ms"] is not None and b_["cpu_ms"] is not None]
        if len(pairs) >= 2:
            ratios = [x / y for x, y in pairs]
            rng = random.Random(0)
            boots = sorted(100 * (statistics.median(rng.choices(ratios, k=len(ratios))) - 1)
                           for _ in range(4000))
            lo, hi = boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots)) - 1]
            print(f"CPU per rank and step, paired by repeat: {100 * (statistics.median(ratios) - 1):+.2f} % "
                  f"(95 % bootstrap interval {lo:+.2f} .. {hi:+.2f} %; pairs: "
                  + " ".join(f"{100 * (r - 1):+.1f}" for r in ratios) + ")")



if __name__ == "__main__":
    sys.exit(main())
