"""Sampled attribution of the always-on probes' cost: per probe, per collective, per NaN-watch mode.

    python benchmarks/bench_probe_attribution.py samples [...]     # py-spy samples of one wrapped run
    python benchmarks/bench_probe_attribution.py self-time [...]   # cProfile of one wrapped run
    python benchmarks/bench_probe_attribution.py collective [...]  # µs per collective op, in one process
    python benchmarks/bench_probe_attribution.py nan-watch [...]   # the NaN watch alone, per mode / in a job

Where bench_probes_ab.py compares whole runs or blocks of steps with and without the probes (what
the job pays, with its noise), these attribute the probes' own time inside one run: `samples`
(py-spy, the probes' share of each rank's CPU), `self-time` (cProfile, an upper bound), and the
per-op or per-mode price of two probes measured alone (`collective`, `nan-watch`).
`python benchmarks/bench_probe_attribution.py SUBCOMMAND --help` describes each one.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import linecache
import math
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {}  # sub-command -> its main()


# ------------------------------ samples

SAMPLES_DOC = """Probe share of each rank's CPU, measured by sampling the running job (py-spy).

    python benchmarks/bench_probe_attribution.py samples [--nproc 8] [--steps 80] [--calib 10]
        [--rate 200] [-- reference args]

The A/B (bench_probes_ab.py) cannot resolve 1 % here: with 8 ranks on 2 cores its paired rounds
vary by ±10-20 %. cProfile (bench_probe_attribution.py self-time) resolves it but inflates every Python call
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


def samples_main() -> int:
    ap = argparse.ArgumentParser(description=SAMPLES_DOC.split("\n")[0])
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
        sys.exit("bench_probe_attribution samples: needs py-spy (pip install py-spy)")
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


def _wilson(k, n):
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
        lo, hi = _wilson(k, n)
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
    lo, hi = _wilson(tot_probe, tot_all)
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


# ------------------------------ self-time

SELF_TIME_DOC = """Probe self-time per step: how much of each training step the always-on probes spend.

    python benchmarks/bench_probe_attribution.py self-time [--steps 40] [--nproc N] [-- reference args]

An A/B of step times (bench_probes_ab.py --whole-runs) cannot resolve 1 % on a shared machine: run-to-run
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
tensors kept alive) — bench_probes_ab.py --whole-runs's A/B covers those, with its noise.
"""


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


def self_time_main() -> int:
    ap = argparse.ArgumentParser(description=SELF_TIME_DOC.split("\n")[0])
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


# ------------------------------ collective

COLLECTIVE_DOC = """Per-op cost of the always-on collective log, without a profiler in the way.

    python benchmarks/bench_probe_attribution.py collective [--ops 500] [--rounds 20] [--backend fake|gloo]

One process, one rank, the collective log alone (every other probe off): blocks of N ops of each
kind alternate with and without a `trainprof.session` (the patches stay installed, inert, when no
session is open, so "off" still pays their ~1 µs of pass-through), and each round's on-block is
paired with the off-block just before it; the median over rounds of the difference is the probe's
cost per op. Paired blocks in one process resolve ~1 µs where separate processes could not
(±10 µs: memory layout, CPU frequency, neighbours).

Kinds: c10d all_reduce (sync), async all_reduce + wait, async all_gather_into_tensor + wait (the
FSDP2 path) and a functional all_reduce + wait_tensor (DTensor / tensor parallel).
The default "fake" backend (torch's FakeProcessGroup: every op completes at once) leaves only the
Python around the op, so the probe's share is not hidden in the backend's latency; `--backend
gloo` runs a world-size-1 gloo group instead. Multiply by the ops per step of a job
(collectives.jsonl lines / steps) for the probe's per-step cost.
"""


def collective_main() -> int:
    ap = argparse.ArgumentParser(description=COLLECTIVE_DOC.split("\n")[0])
    ap.add_argument("--ops", type=int, default=500, help="ops per block")
    ap.add_argument("--rounds", type=int, default=20, help="off/on block pairs per kind")
    ap.add_argument("--backend", choices=("fake", "gloo"), default="fake")
    a = ap.parse_args()
    os.environ.pop("TRAINPROF_DISABLE", None)
    from trainprof.probes.session import ATTACHED_PROBES

    os.environ["TRAINPROF_PROBES_OFF"] = ",".join(n.rsplit(".", 1)[-1] for n in ATTACHED_PROBES
                                                  if not n.endswith(".collectives"))
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    import trainprof

    if a.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29613"))
        dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.ones(16)
    out = torch.empty(16 * dist.get_world_size())
    g = dist.group.WORLD
    kinds = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_reduce async+wait": lambda: dist.all_reduce(x, async_op=True).wait(),
        "all_gather_into_tensor async+wait":
            lambda: dist.all_gather_into_tensor(out, x, async_op=True).wait(),
        "funcol all_reduce+wait_tensor": lambda: fc.wait_tensor(fc.all_reduce(x, "sum", g)),
    }

    def block(f) -> float:
        t = time.perf_counter()
        for _ in range(a.ops):
            f()
        return (time.perf_counter() - t) / a.ops * 1e6

    res: dict[str, tuple[list, list]] = {k: ([], []) for k in kinds}
    n_records = 0
    with tempfile.TemporaryDirectory() as root:
        with trainprof.session(os.path.join(root, "warm"), profile_steps="none"):
            for f in kinds.values():  # installs the patches; warms both paths
                block(f)
        for r in range(a.rounds):
            for k, f in kinds.items():
                off = block(f)
                run = os.path.join(root, f"r{r}")
                with trainprof.session(run, profile_steps="none"):
                    on = block(f)
                res[k][0].append(off)
                res[k][1].append(on)
        import glob

        n_records = sum(1 for p in glob.glob(os.path.join(root, "r*", "ranks", "*", "collectives.jsonl"))
                        for _ in open(p))
    dist.destroy_process_group()
    print(f"collective log, {a.backend} backend: {a.rounds} rounds x {a.ops} ops per kind and "
          f"variant; {n_records} records written by the 'on' blocks")
    print(f"{'op':36s} {'off µs':>8s} {'on µs':>8s} {'probe µs':>9s}  (median of paired rounds, p10..p90)")
    for k, (off, on) in res.items():
        d = sorted(b - o for o, b in zip(off, on))
        q = statistics.quantiles(d, n=10) if len(d) > 1 else [d[0]] * 9
        print(f"{k:36s} {statistics.median(off):8.2f} {statistics.median(on):8.2f} "
              f"{statistics.median(d):9.2f}  ({q[0]:.1f}..{q[-1]:.1f})")
    return 0


# ------------------------------ nan-watch

NAN_WATCH_DOC = """Healthy-run overhead of the NaN watch (probes/nan_watch.py) on the reference model.

    python benchmarks/bench_probe_attribution.py nan-watch [--steps 20] [--rounds 5] [--layers 4]
        [--hidden 64] [--seq-len 32] [--batch 16] [--micro-batches 4] [--device cpu|cuda]

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

    python benchmarks/bench_probe_attribution.py nan-watch --job benchmarks/jobs/ddp_mlp.py [--nproc 2]
        [--repeats 8] [-- job args]

`--job`: the NaN watch's share of a whole wrapped job. Runs the script under `trainprof wrap`
(bench_probes_ab.py --whole-runs's launcher and step/CPU hooks) with every probe ("on") and with every
probe but the NaN watch ("off", TRAINPROF_PROBES_OFF=nan_watch), alternated ABBA; per run the
median over steps of the ranks' mean CPU time per step (all threads) and of the slowest rank's
step time. Prints the medians, the per-round paired differences (on/off - 1 of adjacent runs)
with their median and a 90 % bootstrap interval of that median.
"""


def nan_watch_main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        job_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    ap = argparse.ArgumentParser(description=NAN_WATCH_DOC.split("\n")[0])
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
    every optimizer step, then bench_probes_ab's whole-run worker (step and CPU time per step)."""
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
    import bench_probes_ab as bpo
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
    print(f"CPU per rank and step, watch on/off: {_boot_interval(d)}")
    print(f"watch's own CPU (its hooks, thread time): {statistics.median(shares):.2f} % of the rank's CPU")
    return 0


def _boot_interval(d: list) -> str:
    import random

    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(2000))
    return f"{statistics.median(d):+.2f} % (90 % interval {boot[100]:+.2f}..{boot[1899]:+.2f} %)"


def job_ab(a) -> int:
    import json
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_probes_ab as bpo

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
              f"paired on/off {_boot_interval(d)}; rounds {', '.join(f'{x:+.1f}' for x in d)}")
    return 0


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False



COMMANDS.update({"samples": samples_main, "self-time": self_time_main, "collective": collective_main,
                 "nan-watch": nan_watch_main})


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # a rank of `nan-watch --job`
        job_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    cmd = sys.argv.pop(1)
    sys.argv[0] = f"{sys.argv[0]} {cmd}"
    return COMMANDS[cmd]() or 0


if __name__ == "__main__":
    sys.exit(main())
