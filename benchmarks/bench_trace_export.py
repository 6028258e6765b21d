"""What the profiler window's trace export costs the job's thread: the duration of the step
that closes the window (torch collects the results there, then on_trace_ready writes the trace)
against the median of the other steps, with the export on trainprof's thread (default) and
inline on the job's thread (TRAINPROF_TRACE_EXPORT=inline, what torch's own handlers do).

    python benchmarks/bench_trace_export.py [--repeats 3] [--steps 12] [--window 4-6]

Reports per mode the extra ms of the closing step (median over repeats) and the export time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = """
import sys, time, torch, trainprof
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
opt = torch.optim.SGD(m.parameters(), lr=0.01)
with trainprof.session(sys.argv[1], profile_steps=sys.argv[3]):
    for i in range(int(sys.argv[2])):
        for _ in range(20):  # ~2,000 ops a step: a trace of ~20k events over the window
            m(torch.randn(64, 256)).sum().backward()
        opt.step(); opt.zero_grad()
"""


def one(mode: str, steps: int, window: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "TRAINPROF_CALIBRATION": "0", "TRAINPROF_TELEMETRY": "0"}
        if mode == "inline":
            env["TRAINPROF_TRACE_EXPORT"] = "inline"
        run = Path(d) / "run"
        subprocess.run([sys.executable, "-c", JOB, str(run), str(steps), window], env=env,
                       check=True, capture_output=True, timeout=600)
        recs = [json.loads(x) for x in (run / "ranks/rank-00000/steps.jsonl").read_text().splitlines()]
        last = int(window.split("-")[1])
        closing = next(r["dur_ms"] for r in recs if r["step"] == last + 1)
        others = [r["dur_ms"] for r in recs if r["step"] > last + 1 or 0 < r["step"] < int(window.split("-")[0]) - 1]
        return {"closing_ms": closing, "other_ms": statistics.median(others),
                "extra_ms": closing - statistics.median(others)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--window", default="4-6")
    a = ap.parse_args()
    for mode in ("thread", "inline"):
        rs = [one(mode, a.steps, a.window) for _ in range(a.repeats)]
        print(f"{mode:7s} step after the window +{statistics.median(r['extra_ms'] for r in rs):.0f} ms "
              f"(median of {a.repeats}; runs {[round(r['extra_ms']) for r in rs]}; other steps "
              f"{statistics.median(r['other_ms'] for r in rs):.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
