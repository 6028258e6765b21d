"""What `trainprof wrap` adds to a job of many ranks on few cores: start, exit and the
end-of-job analysis, bare vs wrapped.

    python benchmarks/bench_wrap_many_ranks.py [--nproc 64] [--steps 8] [--repeats 1]
        [--variant NAME=WRAP_ARGS ...] [--only bare,wrap,...] [--env K=V ...] [--cprofile DIR]
        [--keep DIR] [--json FILE]

Measured at 64 ranks on the 2-core machine: docs/overhead.md (Many ranks on few cores).

The job: torchrun --nproc-per-node N of a tiny gloo job (an 8 x 8 Linear, one all_reduce per
parameter and SGD step per step). Every rank stamps wall-clock times (time.time()) into a
file: when its script starts (after the interpreter, and under wrap the bootstrap, started),
when init_process_group returns (under wrap: the probes have activated), at every step's end,
and at its last atexit handler (registered first, so it runs after the probes' close). The
launcher's start and exit are stamped here, and wrap's "job finished" line on stderr, read as
it comes, separates the job's exit from the end-of-job analysis.

Phases (wall seconds, the slowest rank):
  start     launch -> the last rank's init_process_group returned
  steps     -> the last rank's last step ended
  close     -> the last rank's last atexit handler ran (the probes' close: clock end phase,
               trace export wait, stream flush)
  exit      -> the job ended (torchrun returned; under wrap: the "job finished" line)
  analysis  -> wrap exited (digests of every rank + summary + report)
plus the CPU seconds of the whole process tree (getrusage of the children: robust to the load
of a shared machine, unlike wall time).

Variants: "bare" (torchrun alone) and "wrap" (`trainprof wrap --force --out RUN --`) always;
more with --variant, e.g. `--variant "no-window=--profile-steps none"` or
`--variant "no-analyze=--no-analyze"`; --env K=V applies to every wrapped variant (e.g.
TRAINPROF_PROBES_OFF=clock to bisect). --cprofile DIR: each rank's main thread under cProfile,
dumped to DIR/VARIANT-rank-N.prof (attribution inside the ranks; slows them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

JOB = r'''
import atexit, json, os, sys, time
T = {"script": time.time()}
OUT = os.environ["BENCH_STAMPS"]
PROF = os.environ.get("BENCH_CPROFILE")
if PROF:
    import cProfile
    _pr = cProfile.Profile()
    _pr.enable()


def _last():  # registered first: runs after every later atexit handler (the probes' close)
    T["atexit"] = time.time()
    r = os.environ.get("RANK", "0")
    if PROF:
        _pr.disable()
        _pr.dump_stats(f"{PROF}-rank-{r}.prof")
    u = os.times()
    T["cpu_s"] = u.user + u.system
    T["threads"] = {}  # the live threads' CPU seconds by OS name (the probes' are tp-*)
    try:
        tick = os.sysconf("SC_CLK_TCK")
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/stat") as f:
                st = f.read()
            name = st[st.index("(") + 1:st.rindex(")")]
            fields = st[st.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick
            T["threads"][name] = T["threads"].get(name, 0) + cpu
    except OSError:
        pass
    with open(os.path.join(OUT, f"rank-{r}.json"), "w") as f:
        json.dump(T, f)


atexit.register(_last)
import torch
import torch.distributed as dist
T["imported"] = time.time()
steps = int(sys.argv[1])
dist.init_process_group("gloo")
T["init"] = time.time()
torch.manual_seed(0)
m = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
T["steps"] = []
for _ in range(steps):
    loss = m(torch.randn(4, 8)).sum()
    opt.zero_grad()
    loss.backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    T["steps"].append(time.time())
dist.destroy_process_group()
T["destroyed"] = time.time()
'''

PHASES = ("start", "steps", "close", "exit", "analysis", "total")


def run_one(name: str, wrap_args: list[str] | None, nproc: int, steps: int, work: Path,
            env_extra: dict, cprofile: Path | None) -> dict:
    stamps = work / f"stamps-{name}"
    stamps.mkdir(parents=True, exist_ok=True)
    for f in stamps.glob("*.json"):
        f.unlink()
    job = work / "job.py"
    job.write_text(JOB)
    env = {**os.environ, "BENCH_STAMPS": str(stamps), "OMP_NUM_THREADS": "1"}
    if cprofile is not None:
        cprofile.mkdir(parents=True, exist_ok=True)
        env["BENCH_CPROFILE"] = str(cprofile / name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(job), str(steps)]
    if wrap_args is not None:
        env.update(env_extra)
        cmd = [sys.executable, "-m", "trainprof", "wrap", "--force", "--out",
               str(work / f"run-{name}"), *wrap_args, "--", *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t_launch = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []

    def read():
        for raw in p.stderr:
            lines.append((time.time(), raw.decode(errors="replace").rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rc = p.wait()
    t_end = time.time()
    reader.join(10)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        tail = "\n".join(x for _, x in lines[-20:])
        raise SystemExit(f"{name}: exit code {rc}\n{tail}")
    ranks = [json.loads(f.read_text()) for f in sorted(stamps.glob("rank-*.json"))]
    if len(ranks) != nproc:
        raise SystemExit(f"{name}: {len(ranks)} of {nproc} ranks stamped")
    finished = next((t for t, x in lines if x.startswith("trainprof: job finished")), t_end)
    init = max(r["init"] for r in ranks)
    last_step = max(r["steps"][-1] for r in ranks)
    last_exit = max(r["atexit"] for r in ranks)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "variant": name, "start": init - t_launch, "steps": last_step - init,
        "close": last_exit - last_step, "exit": finished - last_exit,
        "analysis": t_end - finished, "total": t_end - t_launch, "cpu": cpu,
        "rank_cpu": sum(r["cpu_s"] for r in ranks),
        "import_s": statistics.median(r["imported"] - r["script"] for r in ranks),
        "init_s": statistics.median(r["init"] - r["imported"] for r in ranks),
        "stderr_lines": len(lines),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=WRAP_ARGS",
                    help="another wrapped variant: its name and wrap's options")
    ap.add_argument("--only", default=None, help="comma-separated variants to run (default all)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="environment of every wrapped variant")
    ap.add_argument("--cprofile", type=Path, default=None, metavar="DIR")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="keep the run directories and stamps here")
    ap.add_argument("--json", type=Path, default=None, help="also write every run's numbers here")
    a = ap.parse_args()
    variants: list[tuple[str, list[str] | None]] = [("bare", None), ("wrap", [])]
    for v in a.variant:
        name, _, args = v.partition("=")
        variants.append((name, shlex.split(args)))
    if a.only:
        keep = set(a.only.split(","))
        variants = [v for v in variants if v[0] in keep]
    env_extra = dict(kv.split("=", 1) for kv in a.env)
    work_ctx = tempfile.TemporaryDirectory(prefix="bench-wrap-ranks-") if a.keep is None else None
    work = a.keep if a.keep is not None else Path(work_ctx.name)
    work.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    try:
        for i in range(a.repeats):
            for name, wrap_args in variants:  # alternated: the machine's load hits all alike
                r = run_one(name, wrap_args, a.nproc, a.steps, work, env_extra, a.cprofile)
                r["repeat"] = i
                results.append(r)
                print(f"# {name} #{i}: " + ", ".join(f"{k} {r[k]:.1f}" for k in (*PHASES, "cpu")),
                      file=sys.stderr, flush=True)
    finally:
        if work_ctx is not None:
            work_ctx.cleanup()
    print(f"{a.nproc} ranks, {a.steps} steps, {os.cpu_count()} cores; wall seconds (median of "
          f"{a.repeats}), CPU seconds of the whole process tree")
    print(f"{'variant':14s}" + "".join(f"{p:>10s}" for p in (*PHASES, "cpu", "rank cpu")))
    med: dict[str, dict] = {}
    for name, _ in variants:
        rs = [r for r in results if r["variant"] == name]
        med[name] = {k: statistics.median(r[k] for r in rs) for k in (*PHASES, "cpu", "rank_cpu")}
        print(f"{name:14s}" + "".join(f"{med[name][k]:10.1f}" for k in (*PHASES, "cpu", "rank_cpu")))
    if "bare" in med:
        for name, _ in variants:
            if name == "bare":
                continue
            d = {k: med[name][k] - med["bare"][k] for k in med[name]}
            print(f"{'+' + name:14s}" + "".join(f"{d[k]:+10.1f}" for k in (*PHASES, "cpu", "rank_cpu")))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
