"""Calibration microbenchmark: what this device can actually do, for devices without a
datasheet entry (CPUs, unknown GPUs), recorded in meta.json as ``calibration``::

    {"device": "cpu"|"cuda:N", "device_name", "threads", "cpu_count", "local_rank", "host",
     "matmul": {"dtype", "n", "reps", "flops_per_s"},            # fp32 square matmul
     "matmul_bf16": {...} (CUDA only), "copy": {"bytes", "reps", "bytes_per_s"},  # read + write
     "ms": wall time spent, "at": "activation"|"step N"}

One measurement per host: only local_rank 0 measures (the analyzer shares it with the host's
other ranks), under the job's own thread settings (torch.get_num_threads()). It is short
(BUDGET_S, ~0.2 s) and never runs inside the profiler window. CPU-only processes measure at
activation (inside step 0, which statistics exclude); CUDA processes at the first step boundary,
when the job has chosen its device; that time is booked as probe overhead of the next step.
Env: TRAINPROF_CALIBRATION=0 turns it off.
"""

from __future__ import annotations

import os
import time

from trainprof import settings
from trainprof.probes import runtime

BUDGET_S = 0.15       # per measurement (matmul, copy), at most
ENV = "TRAINPROF_CALIBRATION"


def _timed(fn, sync, budget_s: float, max_reps: int = 50) -> tuple[float, int]:
    """Best per-call seconds of fn over repetitions filling budget_s (one warm-up call)."""
    fn()
    sync()
    best, reps, t_end = float("inf"), 0, time.perf_counter() + budget_s
    while reps < max_reps and (reps < 2 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best, reps


def measure(device: str = "cpu", budget_s: float = BUDGET_S) -> dict:
    import torch

    cuda = device.startswith("cuda")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"device": device, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if cuda:
        out["device_name"] = torch.cuda.get_device_name(dev)
    t_start = time.perf_counter()
    for key, dtype, n in ((("matmul", torch.float32, 4096 if cuda else 512),)
                          + ((("matmul_bf16", torch.bfloat16, 4096),) if cuda else ())):
        # a generator of its own: the job's random streams (a seeded job's data, dropout,
        # init) are exactly what they would be without trainprof
        gen = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
        c = torch.empty(n, n, device=dev, dtype=dtype)
        s, reps = _timed(lambda: torch.mm(a, b, out=c), sync, budget_s / 2)
        out[key] = {"dtype": "bf16" if dtype == torch.bfloat16 else "fp32", "n": n, "reps": reps,
                    "flops_per_s": 2 * n ** 3 / s}
        del a, b, c
    size = (256 << 20) if cuda else (32 << 20)  # bytes per buffer: well past the caches
    src = torch.empty(size // 4, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    s, reps = _timed(lambda: dst.copy_(src), sync, budget_s / 2)
    out["copy"] = {"bytes": size, "reps": reps, "bytes_per_s": 2 * size / s}  # read + write
    del src, dst
    if cuda:
        torch.cuda.empty_cache()  # give the job back what the benchmark cached
    out["ms"] = round((time.perf_counter() - t_start) * 1e3, 1)
    return out


def _needed(session, device: str) -> bool:
    if not settings.value(ENV) or int(session.meta.get("local_rank") or 0) != 0:
        return False
    if device.startswith("cuda"):
        from trainprof.devices import lookup  # lazy: start-up time of the job's ranks

        return lookup(session.meta.get("device_name")) is None  # known GPUs use the datasheet
    return True


def _run(session, device: str, at: str) -> None:
    try:
        rec = measure(device)
        rec.update(local_rank=session.meta.get("local_rank"), host=session.meta.get("host"), at=at)
        session.update_meta(calibration=rec)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"calibration skipped: {type(e).__name__}: {e}")


def attach(session) -> None:
    import torch

    if not torch.cuda.is_available():
        # CPU-only process: measure now, inside step 0 (set-up), never inside a measured step
        if session.profiler is None and _needed(session, "cpu"):
            _run(session, "cpu", "activation")
            return
    state = {"done": False}

    def on_step(rec) -> None:
        if state["done"] or session.profiler is not None:  # never inside the profiler window
            return
        state["done"] = True
        device = str(session.meta.get("device") or "cpu")
        if not _needed(session, device):
            return
        t0 = time.perf_counter_ns()
        _run(session, device, f"step {rec['step']}")
        session.clock.overhead_ns += time.perf_counter_ns() - t0  # booked into the next step

    session.on_step(on_step)
