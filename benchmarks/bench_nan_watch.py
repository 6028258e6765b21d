"""Healthy-run overhead of the NaN watch (probes/nan_watch.py) on the reference model.

    python benchmarks/bench_nan_watch.py [--steps 20] [--rounds 5] [--layers 4] [--hidden 64]
        [--seq-len 32] [--batch 16] [--micro-batches 4] [--device cpu|cuda]

One process, one trainprof session (the other probes stay attached in every variant). The
training step of the reference transformer (micro-batched forward/backward, AdamW) runs in
alternating blocks of `--steps` steps with the watch detached ("off"), with loss + gradient
checks only ("loss+grads", TRAINPROF_NAN_MODULES=off), in the default mode that also keeps
references to each root module call's inputs for a replay after a detection ("replay"), with
flags on leaf modules only
("leaf") and with module-level flags on every module ("full"),
`--rounds` times, so machine noise hits every variant alike. Per variant: median step time over
all its steps; overhead = median(variant) / median(off) - 1. The step time is taken around the
whole step with a device sync (CUDA) so the deferred device work is counted.

    python benchmarks/bench_nan_watch.py --job benchmarks/jobs/ddp_mlp.py [--nproc 2]
        [--repeats 8] [-- job args]

`--job`: the NaN watch's share of a whole wrapped job. Runs the script under `trainprof wrap`
(bench_probe_overhead.py's launcher and step/CPU hooks) with every probe ("on") and with every
probe but the NaN watch ("off", TRAINPROF_PROBES_OFF=nan_watch), alternated ABBA; per run the
median over steps of the ranks' mean CPU time per step (all threads) and of the slowest rank's
step time. Prints the medians, the per-round paired differences (on/off - 1 of adjacent runs)
with their median and a 90 % bootstrap interval of that median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        job_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--job", help="A/B a wrapped job script with the watch on/off instead")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--block", type=int, default=0,
                    help="--job: toggle the watch in-process every N steps instead of A/B runs")
    ap.add_argument("job_args", nargs="*")
    a = ap.parse_args()
    if a.job:
        return job_ab(a)

    import torch

    import trainprof
    from trainprof.probes import nan_watch
    from trainprof.reference.model import Transformer, loss_fn

    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = Transformer(a.vocab, a.hidden, a.heads, range(a.layers)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev)
    y = torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev)

    def step():
        for xm, ym in zip(x.chunk(a.micro_batches), y.chunk(a.micro_batches)):
            (loss_fn(model(xm), ym) / a.micro_batches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = {"off": [], "loss+grads": [], "replay": [], "leaf": [], "full": []}
    if dev.type == "cuda":
        times["replay+sync"] = []  # TRAINPROF_NAN_SYNC=1: one flag read per step (CUDA only)
    with tempfile.TemporaryDirectory() as d, trainprof.session(d, profile_steps="none") as s:
        watch = s.state.pop("nan_watch", None)
        if watch is not None:
            watch.close()
        for _ in range(3):
            step()  # warm-up
        for _ in range(a.rounds):
            for variant in times:
                w = None
                if variant != "off":
                    os.environ[nan_watch.ENV_MODULES] = {"full": "all", "leaf": "leaf", "replay": "replay",
                                                         "replay+sync": "replay"}.get(variant, "off")
                    os.environ[nan_watch.ENV_SYNC] = "1" if variant == "replay+sync" else "0"
                    nan_watch.attach(s)
                    w = s.state.pop("nan_watch")
                    step()  # first steps register the per-module / per-root hooks: not timed
                    step()
                for _ in range(a.steps):
                    sync()
                    t0 = time.perf_counter()
                    step()
                    sync()
                    times[variant].append((time.perf_counter() - t0) * 1e3)
                if w is not None:
                    w.close()
                    s._step_listeners.remove(w._on_step)
                    s._close_listeners.remove(w.close)
        os.environ.pop(nan_watch.ENV_MODULES, None)
        os.environ.pop(nan_watch.ENV_SYNC, None)
    base = statistics.median(times["off"])
    print(f"device {dev}  layers {a.layers}  hidden {a.hidden}  seq {a.seq_len}  batch {a.batch}"
          f"  micro-batches {a.micro_batches}  ({a.rounds} rounds x {a.steps} steps per variant)")
    for k, v in times.items():
        med = statistics.median(v)
        q = statistics.quantiles(v, n=10)
        print(f"{k:>11}: median {med:8.2f} ms  p10 {q[0]:8.2f}  p90 {q[-1]:8.2f}  "
              f"overhead {100 * (med / base - 1):+6.2f} %")
    return 0


# NanWatch methods the job's thread enters (hooks, wrappers, step listener): the watch's own time
ENTRY_POINTS = ("on_backward", "_pre_step", "_on_step", "_pre", "_post", "_grad_hook", "_g_pre",
                "_g_post", "_r_pre", "_r_post")


def job_worker(out_dir: str, script: str, args: list) -> None:
    """Inside each rank: the watch's own CPU time (thread time in its entry points), sampled at
    every optimizer step, then bench_probe_overhead's worker (step and CPU time per step)."""
    import functools
    import json
    from pathlib import Path

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from trainprof.probes import nan_watch

    acc = [0, 0]  # [nanoseconds in the watch, depth]
    for name in ENTRY_POINTS:
        orig = getattr(nan_watch.NanWatch, name)

        def timed(*a, _orig=orig, **k):
            if acc[1]:
                return _orig(*a, **k)
            acc[1] = 1
            t0 = time.thread_time_ns()
            try:
                return _orig(*a, **k)
            finally:
                acc[0] += time.thread_time_ns() - t0
                acc[1] = 0
        setattr(nan_watch.NanWatch, name, functools.wraps(orig)(timed))
    marks: list = []
    leader: list = []
    states: list = []  # per step: was the watch attached (in-process toggling, BENCH_NAN_BLOCK)
    block = int(os.environ.get("BENCH_NAN_BLOCK", "0"))

    def hook(opt, a, k):
        if not leader:
            leader.append(id(opt))
        if id(opt) != leader[0]:
            return
        marks.append(acc[0])
        from trainprof.probes import runtime

        s = runtime._session
        if s is None:
            return
        states.append("nan_watch" in s.state)
        if block and len(marks) % block == 0:  # every rank flips at the same steps
            w = s.state.pop("nan_watch", None)
            if w is not None:
                w.close()
                s._step_listeners.remove(w._on_step)
                s._close_listeners.remove(w.close)
            else:
                nan_watch.attach(s)

    register_optimizer_step_post_hook(hook)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_probe_overhead as bpo
    try:
        bpo.worker(out_dir, script, args)
    finally:
        rank = os.environ.get("RANK", "0")
        Path(out_dir, f"watch-{rank}.json").write_text(json.dumps(
            [(b - a) / 1e6 for a, b in zip(marks, marks[1:])]))
        Path(out_dir, f"states-{rank}.json").write_text(json.dumps(states[1:]))


def job_blocks(a, run_once) -> int:
    """One wrapped run per repeat whose ranks attach and detach the watch every `--block` steps
    (at the same steps on every rank); the first steps of each block are not counted (a new watch
    discovers the root modules). Per adjacent on/off block pair: mean CPU per rank and step
    on/off - 1; then the median over pairs with a bootstrap interval."""
    import json
    from pathlib import Path

    os.environ["BENCH_NAN_BLOCK"] = str(a.block)
    d, shares = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-nan-") as tmp:
            for i in range(a.repeats):
                out = Path(tmp) / f"on-{i}"
                run_once("on", Path(tmp), i)
                ranks = sorted(out.glob("cpu-*.json"))
                cpu = [json.loads(p.read_text()) for p in ranks]
                st = [json.loads(p.read_text()) for p in sorted(out.glob("states-*.json"))]
                ww = [json.loads(p.read_text()) for p in sorted(out.glob("watch-*.json"))]
                n = min(len(x) for x in cpu + st)
                skip = 2  # first steps of a block: (re)discovery, caches
                blocks: list = []
                for j in range(n):  # cpu[j], watch[j], states[j]: step j + 1
                    k = j + 1
                    if k % a.block < skip or k < a.block:
                        continue
                    state = st[0][j]
                    if any(x[j] != state for x in st):
                        continue
                    if not blocks or k % a.block == skip:
                        blocks.append([state, [], []])
                    blocks[-1][1].append(sum(x[j] for x in cpu) / len(cpu))
                    blocks[-1][2].append(sum(x[j] for x in ww) / len(ww))
                run_d = []
                for b0, b1 in zip(blocks, blocks[1:]):
                    if b0[0] != b1[0]:
                        on, off = (b0, b1) if b0[0] else (b1, b0)
                        run_d.append(100 * (statistics.mean(on[1]) / statistics.mean(off[1]) - 1))
                        shares.append(100 * statistics.mean(on[2]) / statistics.mean(on[1]))
                print(f"  run {i}: {len(run_d)} block pairs, on/off {statistics.median(run_d):+.2f} %, "
                      f"watch's own CPU {statistics.median(shares[-len(run_d):]):.2f} % of the rank's",
                      flush=True)
                d += run_d
    finally:
        os.environ.pop("BENCH_NAN_BLOCK", None)
    print(f"{a.job} {' '.join(a.job_args)}: {a.nproc} ranks, blocks of {a.block} steps, {len(d)} pairs")
    print(f"CPU per rank and step, watch on/off: {_interval(d)}")
    print(f"watch's own CPU (its hooks, thread time): {statistics.median(shares):.2f} % of the rank's CPU")
    return 0


def _interval(d: list) -> str:
    import random

    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(2000))
    return f"{statistics.median(d):+.2f} % (90 % interval {boot[100]:+.2f}..{boot[1899]:+.2f} %)"


def job_ab(a) -> int:
    import json
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_probe_overhead as bpo

    def run_once(variant, tmp, i):
        out = tmp / f"{variant}-{i}"
        out.mkdir()
        cmd = [sys.executable, "-m", "trainprof", "wrap", "--out", str(out / "run"), "--no-analyze",
               "--profile-steps", "none", "--", sys.executable, "-m", "torch.distributed.run",
               "--standalone", "--nproc-per-node", str(a.nproc), os.path.abspath(__file__),
               "--worker", str(out), a.job, *a.job_args]
        env = {k: v for k, v in os.environ.items() if k not in ("TRAINPROF_DISABLE", "TRAINPROF_PROBES_OFF")}
        if variant == "off":
            env["TRAINPROF_PROBES_OFF"] = "nan_watch"
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        r = {"step_ms": bpo.job_step_ms(out), "cpu_ms": bpo.job_cpu_ms(out)}
        if variant == "on":  # the watch's share of each rank's CPU, mean over steps past warm-up
            shares = []
            for wp in sorted(out.glob("watch-*.json")):
                w = json.loads(wp.read_text())[bpo.WARMUP:]
                c = json.loads((out / wp.name.replace("watch-", "cpu-")).read_text())[bpo.WARMUP:]
                if w and c:
                    shares.append(100 * sum(w) / sum(c))
            r["watch_ms"] = statistics.mean(
                statistics.mean(json.loads(p.read_text())[bpo.WARMUP:]) for p in out.glob("watch-*.json"))
            r["share"] = statistics.mean(shares)
        return r

    if a.block:
        return job_blocks(a, run_once)
    res: dict = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-nan-") as tmp:
        tmp = Path(tmp)
        for i in range(a.repeats):
            for variant in ("on", "off") if i % 2 == 0 else ("off", "on"):
                r = run_once(variant, tmp, i)
                res[variant].append(r)
                print(f"  watch {variant:3s} run {i}: median step {r['step_ms']:.2f} ms, "
                      f"CPU {r['cpu_ms']:.2f} ms/rank"
                      + (f", watch {r['watch_ms']:.2f} ms/step = {r['share']:.2f} % of the rank's CPU"
                         if "share" in r else ""), flush=True)
    print(f"{a.job} {' '.join(a.job_args)}: {a.nproc} ranks, {a.repeats} runs per variant")
    sh = [r["share"] for r in res["on"]]
    print(f"watch's own CPU (its hooks, thread time): {statistics.median([r['watch_ms'] for r in res['on']]):.2f}"
          f" ms/step per rank = {statistics.median(sh):.2f} % of the rank's CPU "
          f"(runs {min(sh):.2f}..{max(sh):.2f} %)")
    for key, what in (("cpu_ms", "CPU per rank and step"), ("step_ms", "step (slowest rank)")):
        on = [r[key] for r in res["on"]]
        off = [r[key] for r in res["off"]]
        d = [100 * (x / y - 1) for x, y in zip(on, off)]
        print(f"{what}: on {statistics.median(on):.2f} ms, off {statistics.median(off):.2f} ms; "
              f"paired on/off {_interval(d)}; rounds {', '.join(f'{x:+.1f}' for x in d)}")
    return 0


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
