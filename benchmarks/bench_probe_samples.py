"""Probe share of each rank's CPU, measured by sampling the running job (py-spy).

    python benchmarks/bench_probe_samples.py [--nproc 8] [--steps 80] [--calib 10] [--rate 200] [-- reference args]

The A/B (bench_probes_ab.py) cannot resolve 1 % here: with 8 ranks on 2 cores its paired rounds
vary by ±10-20 %. cProfile (bench_probe_self_time.py) resolves it but inflates every Python call
the probes make (~3x), so it only gives an upper bound. A sampling profiler does neither: it reads
the stacks of the running processes from outside, at a fixed rate, without instrumenting a call.

One wrapped run of the reference (`trainprof wrap --profile-steps none -- torchrun ...`). Once
every rank has finished `--skip` steps (set-up, first-step compilation of the pipeline), one
`py-spy record` per rank samples all of that rank's Python threads for as long as the remaining
steps take. Sampling is blocking: each sample pauses the rank for tens of µs, which slows job and
probes alike and keeps stacks consistent (--nonblocking tears them). py-spy leaves out samples of idle threads (blocked in a wait, a sleep,
a collective), so a rank's samples count the time its Python threads ran. A sample is the
probes' when its innermost frame in trainprof's code (not the reference workload) is anything but
a wrapper's call into the job's own work (`original(...)`, the real functional op, the real
backward): then the sample is in the probe itself or in what the probe called (a tensor reduction,
a file write). The probes' own threads (trainprof-tick: stream flushes, heartbeats, hang-trigger
polls; trainprof-telemetry on GPU) are all probe: their CPU is read from /proc (below).

Before sampling, `--calib` steps run unsampled: their step time and each rank's CPU per step
(/proc, all threads and the main thread) are the job's own. Printed per rank: probe samples / all
samples of the rank (the probes' share of its Python-thread CPU) with a Wilson 95 % interval, the
same for the main thread, and probe ms per step = main-thread share x main-thread CPU per
unsampled step; "+threads": the CPU of the probes' own threads (named tp-*) per unsampled step.
The last line says which ratio is the wall overhead: when the ranks keep the cores busy
(CPU-bound), probe ms (with the probes' threads) / the ranks' CPU; otherwise the main thread's
probe ms / step time.
Not counted as probe time: GC passes that a probe's allocations trigger inside the job's frames
(bench_probes_ab.py prints GC time per step with and without probes), and costs a probe causes
inside torch (a hook sending nn.Module down its slow path) — the A/B's. The gloo/NCCL C++ threads
are not Python threads and are not sampled.

Needs `pip install py-spy` (not a trainprof dependency) and ptrace rights over the ranks
(same user; `kernel.yama.ptrace_scope` 0 or 1 with py-spy as root).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import linecache
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# A wrapper's line that calls the job's own work: samples whose innermost trainprof frame sits
# there belong to the job (the wrapped collective, backward, DataLoader fetch, pipeline action).
# the job's own work called from a probe's wrapper (the calls of the originals they wrap: c10d,
# funcol, DDP's init/hooks/all-reduce, the framework integrations' backward, optimizer step, ...)
JOB_CALL = re.compile(r"^\s*(return\s+|\w+\s*=\s*)?(original|orig|_orig_backward|self\._packet|"
                      r"mesh_init|exec_module|start|end|init|backward|opt_step|prepare_model|"
                      r"register|builtin|hook|fn|dist\.all_reduce)\(")
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.+):(?P<line>\d+)\)$")
# The collective log's C hot path (probes/_fastlog.c): with --native its frames are in the
# stacks; time below `call_job` is the job's own op, time in any other of its frames the probe's
# (line numbers of inlined native frames are not reliable, function names are).
NATIVE_FILE = "_fastlog.c"
NATIVE_JOB_CALL = "call_job"
# A thread whose innermost frame is still at a blocking call in threading/queue has been woken
# but has not run yet (py-spy reads "runnable" as active): idle, whatever thread it is.
WAIT_LEAF = re.compile(r"\.(acquire|wait)\(")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--steps", type=int, default=80, help="training steps of the run")
    ap.add_argument("--skip", type=int, default=8, help="steps every rank finishes before sampling")
    ap.add_argument("--calib", type=int, default=10,
                    help="steps measured unsampled (step time, CPU per step) before sampling")
    ap.add_argument("--rate", type=int, default=200, help="samples per second per rank")
    ap.add_argument("--keep", help="keep the run directory and raw samples here")
    ap.add_argument("--native", choices=("auto", "on", "off"), default="auto",
                    help="unwind native frames too (py-spy --native), so the collective log's C "
                         "path is counted; auto: on where trainprof.probes._fastlog is built")
    ap.add_argument("--script", help="sample this training script instead of the reference; it gets "
                    "the step count as its first argument, then job_args (e.g. benchmarks/jobs/ddp_mlp.py)")
    ap.add_argument("job_args", nargs="*", help="reference args (default: the demo mesh for 8 ranks)")
    a = ap.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("bench_probe_samples: needs py-spy (pip install py-spy)")
    native = a.native == "on" or (a.native == "auto" and _fastlog_built())
    if os.environ.get("TRAINPROF_COLLECTIVES_PY", "") in ("1", "true", "yes") and a.native == "auto":
        native = False
    job_args = a.job_args or (["--dp", "2", "--pp", "2", "--tp", "2"]
                              if a.nproc == 8 and not a.script else [])
    root = a.keep or tempfile.mkdtemp(prefix="tp-samples-")
    os.makedirs(root, exist_ok=True)
    run = os.path.join(root, "run")
    shutil.rmtree(run, ignore_errors=True)  # a kept run's meta.json would name dead pids
    cmd = [sys.executable, "-m", "trainprof", "wrap", "--out", run, "--force", "--no-analyze",
           "--profile-steps", "none", "--",
           "torchrun", "--standalone", "--nproc-per-node", str(a.nproc),
           *([a.script, str(a.steps)] if a.script else ["-m", "trainprof.reference",
                                                         "--steps", str(a.steps)]), *job_args]
    env = dict(os.environ)
    env.pop("TRAINPROF_DISABLE", None)
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        pids, _ = _wait_for_steps(run, a.nproc, a.skip, job)
        # an unsampled window first: the job's own step time and CPU per step, unperturbed
        c0, w0 = {r: _cpu(pid) for r, pid in pids.items()}, time.time_ns()
        _wait_for_steps(run, a.nproc, a.skip + a.calib, job)
        c1, w1 = {r: _cpu(pid) for r, pid in pids.items()}, time.time_ns()
        remaining = a.steps - a.skip - a.calib - 3
        calib = _steps_between(run, w0, w1)
        step_ms = statistics.median(r["dur_ms"] for r in calib)
        duration = max(5, int(remaining * step_ms / 1000 * 0.85))
        print(f"{a.nproc} ranks, steps {a.skip}..{a.skip + a.calib} unsampled: {step_ms:.0f} ms/step; "
              f"sampling each rank for {duration} s at {a.rate} Hz"
              + (" with native frames" if native else ""))
        spies = {}
        cpu0, t0 = {r: _cpu(pid) for r, pid in pids.items()}, time.time_ns()
        for rank, pid in sorted(pids.items()):
            out = os.path.join(root, f"rank{rank}.txt")
            spies[rank] = (out, subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--threads", *(["--native"] if native else []),
                 "--full-filenames", "--rate", str(a.rate), "--duration", str(duration),
                 "--format", "raw", "--output", out],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for rank, (out, p) in spies.items():
            _, err = p.communicate()
            if p.returncode != 0 or not os.path.exists(out):
                sys.exit(f"py-spy failed on rank {rank}: {err.strip()[-400:]}")
        cpu1, t1 = {r: _cpu(pid) for r, pid in pids.items()}, time.time_ns()
        rc = job.wait(timeout=600)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait()
    if rc != 0:
        sys.exit(f"the wrapped job failed ({rc}): {job.stderr.read()[-2000:]}")
    sampled = _steps_between(run, t0, t1)
    per_step = lambda a0, a1, n: {r: tuple((x1 - x0) / max(n, 1) for x0, x1 in zip(a0[r], a1[r]))
                                  for r in pids}
    report(spies, a, job_args, calib, per_step(c0, c1, len(calib)), sampled,
           per_step(cpu0, cpu1, len(sampled)))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _wait_for_steps(run, nproc, skip, job):
    """pid per rank, and the step times so far, once every rank has finished ``skip`` steps."""
    deadline = time.time() + 600
    while time.time() < deadline:
        if job.poll() is not None:
            sys.exit(f"the wrapped job ended early ({job.returncode}): {job.stderr.read()[-2000:]}")
        metas = glob.glob(os.path.join(run, "ranks", "*", "meta.json"))
        if len(metas) == nproc:
            pids, durs, done = {}, [], True
            for m in metas:
                meta = json.load(open(m))
                pids[meta["rank"]] = meta["pid"]
                recs = _records(os.path.join(os.path.dirname(m), "steps.jsonl"))
                if len(recs) < skip:
                    done = False
                    break
                durs += [r["dur_ms"] for r in recs[2:]]
            if done:
                return pids, durs
        time.sleep(0.5)
    sys.exit("the job did not reach the sampling window in 10 minutes")


def _steps_between(run, t0, t1):
    """Rank 0's step records that ended in [t0, t1] (ns)."""
    steps = sorted(glob.glob(os.path.join(run, "ranks", "*", "steps.jsonl")))[0]
    return [r for r in _records(steps) if t0 <= r["end_ns"] <= t1]


def _records(path):
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.endswith("\n")]
    except (OSError, ValueError):
        return []


def _cpu(pid) -> tuple[float, float, float]:
    """CPU ms (user + system) of a process so far: all its threads, its main thread, and the
    probes' own threads (named tp-* by runtime.name_native_thread)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = main = probe = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{task}/stat").read()
            try:  # ns on the CPU: the probes' threads run ~1 ms a step, below stat's 10 ms ticks
                ms = int(open(f"/proc/{pid}/task/{task}/schedstat").read().split()[0]) / 1e6
            except (OSError, ValueError, IndexError):
                ms = None
        except OSError:  # a thread that just ended
            continue
        comm, _, rest = stat.partition(" (")[2].rpartition(")")
        if ms is None:
            fields = rest.split()
            ms = (int(fields[11]) + int(fields[12])) * 1000 / tick  # utime, stime
        total += ms
        if int(task) == pid:
            main = ms
        elif comm.startswith("tp-"):
            probe += ms
    return total, main, probe


def _fastlog_built() -> bool:
    try:
        import trainprof.probes._fastlog  # noqa: F401
    except ImportError:
        return False
    return True


def _is_trainprof(path):
    # probes (installed as trainprof.probes) and trainprof's core, but not the reference workload
    norm = path.replace(os.sep, "/")
    if "/trainprof/reference/" in norm:
        return False
    return "/probes/" in norm or "/trainprof/" in norm


def classify(stack):
    """'probe', 'job' or 'idle' for one sample (frames root first), with the probe function."""
    py = [f for f in stack if ".py:" in f]  # with --native, C frames may lie below
    if py:
        m = FRAME.match(py[-1])
        if (m is not None and os.path.basename(m["file"]) in ("threading.py", "queue.py")
                and WAIT_LEAF.search(linecache.getline(m["file"], int(m["line"])))):
            return "idle", None
    for frame in reversed(stack):
        m = FRAME.match(frame)
        if m is not None and m["file"].endswith(NATIVE_FILE):
            if m["func"] == NATIVE_JOB_CALL:
                return "job", None
            return "probe", f"{NATIVE_FILE}:{m['func']}"
        if m is None or not _is_trainprof(m["file"]):
            continue
        src = linecache.getline(m["file"], int(m["line"]))
        if JOB_CALL.match(src):
            return "job", None
        return "probe", f"{os.path.basename(m['file'])}:{m['func']}"
    return "job", None


def parse(path):
    """per-thread totals: {thread: [all, probe]} and probe samples by function."""
    threads = collections.defaultdict(lambda: [0, 0])
    by_func = collections.Counter()
    for line in open(path):
        line = line.rstrip("\n")
        if not line:
            continue
        stack_text, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack_text.split(";")
        thread = frames[0] if frames and frames[0].startswith("thread") else "?"
        kind, func = classify([f for f in frames if not f.startswith(("thread", "process"))])
        if kind == "idle":
            continue
        threads[thread][0] += n
        if kind == "probe":
            threads[thread][1] += n
            by_func[func] += n
    return threads, by_func


def _interval(k, n):
    """Wilson 95 % interval of a proportion, in %."""
    if n == 0:
        return 0.0, 0.0
    z, p = 1.96, k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, c - h), 100 * (c + h)


def report(spies, a, job_args, calib, cpu_calib, sampled, cpu_sampled):
    step_ms = statistics.median(r["dur_ms"] for r in calib)
    sampled_ms = statistics.median(r["dur_ms"] for r in sampled) if sampled else float("nan")
    print(f"{a.script or 'reference'}, {a.nproc} ranks {' '.join(job_args)} on {os.cpu_count()} cores: "
          f"{len(calib)} steps unsampled, median {step_ms:.0f} ms; {len(sampled)} steps sampled "
          f"at {a.rate} Hz, median {sampled_ms:.0f} ms (py-spy pauses the ranks); idle samples left out")
    print("share: probe samples / the rank's Python-thread samples. CPU columns: /proc, unsampled "
          "steps. probe ms: main-thread share x main-thread CPU per unsampled step")
    print(f"{'rank':>4s} {'samples':>8s} {'probe':>6s} {'share %':>8s} {'95 % interval':>15s}"
          f" {'main %':>7s} {'CPU ms/step':>12s} {'main':>6s} {'probe ms':>9s} {'+threads':>8s}"
          f" {'% of step':>10s}")
    tot_all = tot_probe = 0
    probe_ms, bg_probe_ms = [], []
    funcs = collections.Counter()
    for rank, (out, _) in sorted(spies.items()):
        threads, by_func = parse(out)
        n = sum(v[0] for v in threads.values())
        k = sum(v[1] for v in threads.values())
        main = max(threads.values(), key=lambda v: v[0])  # the training thread runs the most
        lo, hi = _interval(k, n)
        c_all, c_main, c_probe = cpu_calib[rank]
        main_share = main[1] / max(main[0], 1)
        # the probes' own threads (ticker: flushes, heartbeats, trigger polls; telemetry): their CPU in the
        # unsampled window, from /proc. Not from their samples: they wake by the wall clock, and
        # sampling stretches the steps several-fold, so per step they would be sampled that
        # many times too often
        bg_ms = c_probe
        probe_ms.append(c_main * main_share)
        bg_probe_ms.append(bg_ms)
        print(f"{rank:4d} {n:8d} {k:6d} {100 * k / max(n, 1):8.2f} {lo:7.2f}..{hi:5.2f}"
              f" {100 * main_share:7.2f} {c_all:12.1f} {c_main:6.1f} {probe_ms[-1]:9.2f}"
              f" {bg_ms:8.2f} {100 * probe_ms[-1] / step_ms:10.2f}")
        tot_all, tot_probe = tot_all + n, tot_probe + k
        funcs.update(by_func)
    lo, hi = _interval(tot_probe, tot_all)
    mean_ms = statistics.fmean(probe_ms)
    print(f" all {tot_all:8d} {tot_probe:6d} {100 * tot_probe / max(tot_all, 1):8.2f} "
          f"{lo:7.2f}..{hi:5.2f} {'':7s} {'':12s} {'':6s} {mean_ms:9.2f}"
          f" {statistics.fmean(bg_probe_ms):8.2f} {100 * mean_ms / step_ms:10.2f}")
    cpu_total = sum(c[0] for c in cpu_calib.values())
    busy = cpu_total / (os.cpu_count() * step_ms)
    with_bg = sum(probe_ms) + sum(bg_probe_ms)
    print(f"machine: the ranks' CPU per step {cpu_total:.0f} ms over {os.cpu_count()} cores x "
          f"{step_ms:.0f} ms = {100 * busy:.0f} % busy"
          + (f" -> CPU-bound: wall overhead ~ probe ms / the ranks' CPU = "
             f"{100 * sum(probe_ms) / cpu_total:.2f} % (main threads), "
             f"{100 * with_bg / cpu_total:.2f} % with the probes' own threads" if busy > 0.8 else
             f" -> not CPU-bound: wall overhead ~ main-thread probe ms / step = "
             f"{100 * mean_ms / step_ms:.2f} % (the probes' own threads run on spare cores)"))
    print("probe samples by function (all ranks):")
    for f, n in funcs.most_common(15):
        print(f"  {n:6d}  {100 * n / max(tot_all, 1):5.2f} %  {f}")


if __name__ == "__main__":
    sys.exit(main())
