"""Whole-process speed of `trainprof analyze` against HTA (Holistic Trace Analysis) on the same
traces: what a user waits for, start-up included.

    python benchmarks/bench_vs_hta.py [--hta-python /tmp/htavenv/bin/python] [--repeats 7]
                                      [--cases large,medium,tiny]

HTA is the optional comparison: install it in a separate venv (never in trainprof's env),
``python -m venv /tmp/htavenv && /tmp/htavenv/bin/pip install traceinsight``, and pass its python
with --hta-python; without it only trainprof is timed.

Cases (copied or generated under a temporary folder, never in the repository):

- large: df_index_resolver (HTA's test data, 216k events, 53 MB of JSON, one V100 rank)
- medium: nccl_parser_config (HTA's test data, 41k events, 9.8 MB, one A100 rank)
- tiny: the first 200 events of df_index_resolver's first step (one ProfilerStep, its host ops
  and the kernels they launch): start-up cost

Commands, each a fresh process, run interleaved (one of each per round, the order rotated every
round) so that a busy machine slows them alike:

- hta load: ``TraceAnalysis(trace_dir=...)`` (HTA's parse of the folder)
- hta load+breakdown: the same and ``get_temporal_breakdown()``
- trainprof: ``trainprof analyze DIR --out OUT -q`` (summary.json and report.html)
- trainprof --no-report: the same without report.html

Each process gets a compiled-bytecode cache (PYTHONPYCACHEPREFIX, in the temporary folder, filled
by one untimed run of every command first), as an installed package has: an environment with
PYTHONDONTWRITEBYTECODE=1 and an editable install would otherwise recompile trainprof's modules
on every start. Prints the median wall and CPU (user+sys of the process and its children) per
command and case, and the ratios of HTA's medians to trainprof's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HTA_DATA = ROOT / "tests" / "fixtures" / "hta"
LARGE = HTA_DATA / "df_index_resolver" / "df_index_resolver.json.gz"
MEDIUM = HTA_DATA / "nccl_parser_config" / "nccl_data.json.gz"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}

HTA_LOAD = """
import logging, sys, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1])
"""
HTA_BREAKDOWN = HTA_LOAD + "ta.get_temporal_breakdown(visualize=False)\n"


def tiny_trace(src: Path, dst: Path, n: int = 200) -> Path:
    """The first ``n`` events of ``src``'s first ProfilerStep: the step itself (shortened to end
    with them), its host events in order and the GPU ops each one launched."""
    doc = json.loads(gzip.decompress(src.read_bytes()))
    xs = [e for e in doc.pop("traceEvents") if e.get("ph") == "X"]
    step = min((e for e in xs if str(e.get("name", "")).startswith("ProfilerStep#")),
               key=lambda e: e["ts"])
    launched: dict = {}
    for e in xs:
        if e.get("cat") in GPU_CATS:
            launched.setdefault((e.get("args") or {}).get("correlation"), []).append(e)
    inside = sorted((e for e in xs if e.get("cat") not in GPU_CATS and e is not step
                     and step["ts"] <= e["ts"] < step["ts"] + step["dur"]), key=lambda e: e["ts"])
    out = []
    for e in inside:
        if len(out) + 1 >= n:
            break
        out.append(e)
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            out += launched.get(corr, [])
    step = dict(step, dur=max(e["ts"] + e["dur"] for e in out if e.get("cat") not in GPU_CATS)
                - step["ts"] + 1)
    doc["traceEvents"] = [step] + out
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(gzip.compress(json.dumps(doc).encode(), 6))
    return dst


def trainprof_cmd() -> list[str]:
    """The console script beside this python (what a user runs), else ``python -m trainprof``."""
    script = Path(sys.executable).with_name("trainprof")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "trainprof"]


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall, cpu) seconds of one process; cpu = user + sys of it and its children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hta-python", help="python of a venv with traceinsight (HTA) installed")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", default="large,medium,tiny")
    a = ap.parse_args()
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-vs-hta-") as tmp:
        tmp = Path(tmp)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        tp = trainprof_cmd()
        runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
        commands: list[tuple[str, str, list[str]]] = []
        events = {}
        for case in cases:
            src = tmp / case / "traces"
            if case == "large":
                src.mkdir(parents=True)
                shutil.copy(LARGE, src / LARGE.name)
            elif case == "medium":
                src.mkdir(parents=True)
                shutil.copy(MEDIUM, src / MEDIUM.name)
            elif case == "tiny":
                tiny_trace(LARGE, src / "tiny.pt.trace.json.gz")
            else:
                raise SystemExit(f"unknown case {case!r} (large, medium, tiny)")
            f = next(src.iterdir())
            events[case] = len(json.loads(gzip.decompress(f.read_bytes()))["traceEvents"])
            out = tmp / case / "out"  # outside the traces' folder: HTA reads every *.json there
            if a.hta_python:
                commands.append((case, "hta load", [a.hta_python, "-c", HTA_LOAD, str(src)]))
                commands.append((case, "hta load+breakdown",
                                 [a.hta_python, "-c", HTA_BREAKDOWN, str(src)]))
            commands.append((case, "trainprof", tp + ["analyze", str(src), "--out", str(out), "-q"]))
            commands.append((case, "trainprof --no-report",
                             tp + ["analyze", str(src), "--out", str(out), "-q", "--no-report"]))
        for _, _, cmd in commands:  # untimed: fills the bytecode cache, warms the page cache
            timed(cmd, env)
        for i in range(a.repeats):
            k = i % len(commands)
            for case, label, cmd in commands[k:] + commands[:k]:
                runs.setdefault((case, label), []).append(timed(cmd, env))
            print(f"round {i + 1}/{a.repeats} done", file=sys.stderr)
    print(f"{a.repeats} interleaved runs each, medians; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    for case in cases:
        print(f"\n{case}: {events[case]} events")
        med = {}
        for (c, label), rs in runs.items():
            if c != case:
                continue
            med[label] = (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
            print(f"  {label:24s} wall {med[label][0]:6.3f} s   cpu {med[label][1]:6.3f} s   "
                  f"(min wall {min(r[0] for r in rs):.3f} s)")
        for hta in ("hta load", "hta load+breakdown"):
            for ours in ("trainprof", "trainprof --no-report"):
                if hta in med and ours in med:
                    print(f"  {hta} / {ours}: {med[hta][0] / med[ours][0]:.2f}x wall, "
                          f"{med[hta][1] / med[ours][1]:.2f}x cpu")


if __name__ == "__main__":
    main()
