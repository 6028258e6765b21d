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

    def block(n_timed):
        out = []
        for i in range(a.warmup + n_timed):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i >= a.warmup:
                out.append((time.perf_counter() - t0) * 1e3)
        return out

    _probes_env()
    blocks = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as root:
        block(2)  # process warm-up
        for r in range(a.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")  # no fixed position in a pair
            for v in order:
                if v == "on":
                    with trainprof.session(os.path.join(root, f"run{r}"), profile_steps="none"):
                        blocks["on"].append(block(a.block))
                else:
                    blocks["off"].append(block(a.block))
    dist.destroy_process_group()
    _report(f"reference 1 rank on {dev} ({' '.join(ref_args) or 'defaults'})", a, blocks)
    return 0


def _probes_env() -> None:
    os.environ.pop("TRAINPROF_DISABLE", None)
    # calibration is a one-time microbenchmark at activation (~1.5 s on CPU), not a per-step cost:
    # leaving it out lets blocks be short, so machine drift hits a pair's two blocks alike
    off = {x for x in os.environ.get("TRAINPROF_PROBES_OFF", "").split(",") if x} | {"calibration"}
    os.environ["TRAINPROF_PROBES_OFF"] = ",".join(sorted(off))


def _report(title: str, a, blocks: dict) -> None:
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
        print(f"  {k:>3}: median {med[k]:8.2f} ms  p10 {q[0]:8.2f}  p90 {q[-1]:8.2f}")
    print(f"  per-round on/off ratios: {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"  probe overhead {over:+.2f} % (median of paired rounds; 95 % bootstrap interval "
          f"{lo:+.2f} .. {hi:+.2f} %), pooled medians {med['on'] - med['off']:+.3f} ms/step")


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
    state = {"cm": None, "t": None, "step": None}
    blocks = {"on": {}, "off": {}}

    def on_step(step):
        now = time.perf_counter()
        prev = variant.get(state["step"])
        if prev is not None and prev[2]:  # the previous step was a timed one: its duration
            blocks[prev[0]].setdefault(prev[1], []).append((now - state["t"]) * 1e3)
        want = variant.get(step, ("off", None, False))[0]
        if want == "on" and state["cm"] is None:
            state["cm"] = trainprof.session(os.path.join(root, f"s{step}"), profile_steps="none")
            state["cm"].__enter__()
        elif want == "off" and state["cm"] is not None:
            state["cm"].__exit__(None, None, None)
            state["cm"] = None
        state["t"], state["step"] = time.perf_counter(), step  # toggling is not a step's cost

    rc = train.main([*ref_args, "--steps", str(total)], on_step=on_step)
    if int(os.environ.get("RANK", "0")) == 0:
        import glob
        import shutil

        # evidence that the "on" blocks ran the probes: their step records, every rank
        n = sum(1 for f in glob.glob(os.path.join(root, "s*", "ranks", "*", "steps.jsonl"))
                for _ in open(f))
        print(f"  sessions {len(glob.glob(os.path.join(root, 's*')))}, step records written {n}")
        shutil.rmtree(root, ignore_errors=True)
        by = {k: [v[r] for r in sorted(v)] for k, v in blocks.items()}
        _report(f"reference {os.environ.get('WORLD_SIZE')} ranks ({' '.join(ref_args)})", a, by)
    return rc


if __name__ == "__main__":
    sys.exit(main())
