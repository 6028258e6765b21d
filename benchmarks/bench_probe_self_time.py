"""Probe self-time per step: how much of each training step the always-on probes spend.

    python benchmarks/bench_probe_self_time.py [--steps 40] [--nproc N] [-- reference args]

An A/B of step times (bench_probe_overhead.py) cannot resolve 1 % on a shared machine: run-to-run
spread is ±5-8 %. This measures the probes' own time directly instead: one wrapped run of
`python -m trainprof.reference` (under torchrun with --nproc N > 1, one profile per rank) under
cProfile (profile_steps none), then the time attributed to
trainprof's probe code — the self time of every function in trainprof/probes plus the time of
what those functions call outside it (tensor reductions, file writes), *except* the job's own
work that a probe wraps (the original backward, collective, DataLoader fetch, pipeline action).
Functions called fewer than steps/2 times (imports, activation, calibration, shutdown) are
counted as set-up, apart from the per-step share. cProfile slows Python code (probes are mostly
Python) more than the job's C++ work, so the per-step share printed is an upper bound.

The wrappers' own self time is printed apart: cProfile does not see a call through a pybind
method object (e.g. ``Work.wait``), so that self time holds the job's wait as well.
Not seen at all: costs a probe causes inside torch (a hook making nn.Module take its slow path,
tensors kept alive) — bench_probe_overhead.py's A/B covers those, with its noise.
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

# Probe functions that call the job's own work: their non-probe callees are the job's time.
WRAPPERS = {"backward",                          # nan_watch: torch.autograd.backward
            "wrapper", "wait", "__call__",          # collectives: PG methods, Work.wait, funcol ops
            "step",                                 # pipeline_spans: schedule.step (and its actions)
            "__next__",                             # dataloader: the batch fetch
            "quiet",                                # nan_watch: pipelining's shape inference
            "exec_then_patch", "exec_and_patch", "init_process_group", "device_mesh_init"}
SETUP = {"_attach", "attach", "activate"}  # run once per session, however many calls


# torchrun worker: profile the reference module into PROFILE with {rank} filled in
RUNNER = r"""
import cProfile, os, runpy, sys
out = sys.argv[1].replace("{rank}", os.environ.get("RANK", "0"))
sys.argv = ["trainprof.reference", *sys.argv[2:]]
prof = cProfile.Profile()
prof.enable()
try:
    runpy.run_module("trainprof.reference", run_name="__main__", alter_sys=True)
except SystemExit as e:
    if e.code not in (None, 0):
        raise
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def attribute(st: pstats.Stats, steps: int):
    """(per-step seconds, set-up seconds, wrappers' self seconds, per-function seconds)."""
    probes_dir = os.sep + "probes" + os.sep
    is_probe = lambda f: probes_dir in f  # noqa: E731
    per_step = once = wrappers = 0.0
    by_fn: dict[str, float] = {}
    for (f, _line, name), (_cc, ncalls, tt, _ct, _callers) in st.stats.items():
        if not is_probe(f):
            continue
        own = tt
        if name in WRAPPERS and ncalls >= steps // 2:
            wrappers += tt
            continue
        if name not in WRAPPERS:
            # the time of what it calls outside the probes (reductions, writes) is its cost too
            for (cf, _cl, _cn), (_c, _n, _t, ct, callers) in st.stats.items():
                if not is_probe(cf) and (f, _line, name) in callers:
                    own += callers[(f, _line, name)][3]
        if ncalls < steps // 2 or f.endswith("calibration.py") or name in SETUP:  # set-up, shutdown
            once += own
        else:
            per_step += own
            key = f"{Path(f).name}:{name}"
            by_fn[key] = by_fn.get(key, 0.0) + own
    return per_step, once, wrappers, by_fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) ; pass the mesh in job args")
    ap.add_argument("job_args", nargs="*")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-self-") as tmp:
        runner = Path(tmp) / "runner.py"
        runner.write_text(RUNNER)
        job = [sys.executable, str(runner), str(Path(tmp) / "rank{rank}.prof"),
               "--steps", str(a.steps), *a.job_args]
        if a.nproc > 1:
            job = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(a.nproc), *job[1:]]
        cmd = [sys.executable, "-m", "trainprof", "wrap", "--out", str(Path(tmp) / "run"), "--no-analyze",
               "--profile-steps", "none", "--", *job]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        profs = sorted(Path(tmp).glob("rank*.prof"), key=lambda q: int(q.stem[4:]))
        if p.returncode != 0 or len(profs) != a.nproc:
            print(p.stderr[-3000:])
            return 1
        steps_ms = [float(line.split()[4]) for line in p.stdout.splitlines() if line.startswith("step ")]
        per_rank = [attribute(pstats.Stats(str(q)), a.steps) for q in profs]
    n = len(steps_ms)
    med = sorted(steps_ms)[n // 2] if n else float("nan")
    print(f"reference {' '.join(a.job_args) or '(defaults)'}, {a.nproc} rank(s): {n} steps, "
          f"median step {med:.1f} ms (slowest rank, under cProfile)")
    for r, (per_step, once, wrappers, _by) in enumerate(per_rank):
        print(f"rank {r}: probe self time {1e3 * per_step / max(n, 1):.2f} ms per step "
              f"= {100 * 1e3 * per_step / max(n, 1) / med:.2f} % of the median step (upper bound); "
              f"wrappers' self time {1e3 * wrappers / max(n, 1):.2f} ms/step "
              f"(probe bookkeeping + untracked job calls); set-up/shutdown {once:.2f} s once")
    by_fn: dict[str, float] = {}
    for *_x, b in per_rank:
        for k, v in b.items():
            by_fn[k] = by_fn.get(k, 0.0) + v / len(per_rank)
    print("largest per-step costs (mean over ranks):")
    for k, v in sorted(by_fn.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {1e3 * v / max(n, 1):7.3f} ms/step  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
