"""gpu_overview's per-rank reduction on a long synthetic GPU trace and on the 123k-event V100
trace (HTA's test data): the digest's CPU time, which must grow with events, not steps × events.

    python benchmarks/bench_gpu_overview.py [--steps 5000] [--kernels 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from trainprof.analyzers import gpu_overview
from trainprof.trace import parse_trace

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/hta/df_index_resolver/df_index_resolver.json.gz"


def synthetic(steps: int, kernels: int) -> dict:
    """Each step: kernels × (aten::mm -> cudaLaunchKernel -> a gemm kernel)."""
    ev = []
    for s in range(steps):
        b = s * 100 * kernels
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                   "ts": b, "dur": 100 * kernels})
        for k in range(kernels):
            c, t = s * kernels + k, b + k * 100
            ev += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t, "dur": 60,
                    "args": {"External id": c, "Input type": ["c10::BFloat16", "c10::BFloat16"]}},
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                    "ts": t + 5, "dur": 5, "args": {"correlation": c, "External id": c}},
                   {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "pid": 0, "tid": 7,
                    "ts": t + 20, "dur": 70, "args": {"correlation": c, "External id": c, "stream": 7,
                                                      "grid": [66, 1, 1], "block": [128, 1, 1],
                                                      "registers per thread": 64, "shared memory": 0}}]
    return {"deviceProperties": [{"name": "NVIDIA H100 80GB HBM3", "numSms": 132, "warpSize": 32,
                                  "maxThreadsPerMultiprocessor": 2048, "regsPerMultiprocessor": 65536,
                                  "sharedMemPerMultiprocessor": 233472}], "traceEvents": ev}


def digest_time(trace, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        gpu_overview.trace_digest(None, 0, trace)
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--kernels", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for steps in (args.steps // 10, args.steps):
            p = Path(d) / f"s{steps}.json"
            p.write_text(json.dumps(synthetic(steps, args.kernels)))
            tr = parse_trace(p)
            print(f"synthetic: {steps} steps, {len(tr.tables.events)} events: "
                  f"{digest_time(tr) * 1e3:.0f} ms CPU")
    tr = parse_trace(FIXTURE)
    print(f"{FIXTURE.name}: {len(tr.tables.steps)} steps, {len(tr.tables.events)} events: "
          f"{digest_time(tr) * 1e3:.0f} ms CPU")


if __name__ == "__main__":
    main()
