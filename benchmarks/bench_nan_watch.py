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
    a = ap.parse_args()

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


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
