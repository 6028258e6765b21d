"""In-process A/B of the whole always-on probe set on the one-rank reference workload.

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
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
    sys.exit(main())
