"""The process pool that reduces traces to digests (trainprof/analysis/digest.py): as many
workers as the CPUs and the memory allow, each one trace at a time, forked only from a process
with no other thread (else from a fresh child process), a worker killed (out of memory?) failing
only its own trace. Jobs are digest job tuples (digest._job: kind, run_dir, rank, trace path,
stamp, write, names, pieces); ``fn`` is the function run on each."""

from __future__ import annotations

import os
from pathlib import Path

from trainprof import safeio, settings

WORKERS_ENV = "TRAINPROF_DIGEST_WORKERS"  # the pool's size (default: the CPUs)


def default_workers() -> int:
    """The pool size: TRAINPROF_DIGEST_WORKERS when set (a positive integer), else the CPUs."""
    v = os.environ.get(WORKERS_ENV, "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else settings.available_cpus()


PARSE_FACTOR = 4          # a parsed trace holds about 4x its JSON text (measured on an H100 trace)
GZIP_RATIO_EST = 15       # profiler traces compress 10-20x
WORKER_BASE = 64 << 20    # a worker's own memory besides its trace
MEMORY_SHARE = 0.6        # of the available memory, at most this for the pool's parsed traces


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_bound(jobs: list[tuple]) -> int:
    """The most workers whose parsed traces (each the largest of ``jobs``) fit in MEMORY_SHARE of
    the available memory: a node with many CPUs and large traces is not driven out of memory
    (by default, the pool is as large as the CPUs). A large number when it is not known."""
    avail = _mem_available()
    if avail is None:
        return 1 << 20
    largest = 0
    for j in jobs:
        try:
            size = os.stat(j[3]).st_size
        except OSError:
            continue
        largest = max(largest, size * (GZIP_RATIO_EST if str(j[3]).endswith(".gz") else 1))
    return max(1, int(avail * MEMORY_SHARE // (PARSE_FACTOR * largest + WORKER_BASE)))


def run_jobs(fn, jobs: list[tuple], workers: int | None = None, run=None, progress=None,
             isolate: bool = False) -> list[tuple]:
    """Run ``fn`` (trainprof/analysis/digest.py _job) on each job in a process pool of ``workers`` (default min(default_workers(), jobs,
    memory_bound(jobs)); TRAINPROF_DIGEST_WORKERS, when set, is not bounded by memory),
    each worker one trace at a time; in-process when one worker is enough, unless ``isolate``
    (the launcher: a parse killed for memory must not take it, and the job's exit status, with
    it). A worker killed (out of memory?) breaks the pool: the traces it had not finished are
    digested again, each in a process of its own, so that only the one that kills its worker
    is lost. Results in the jobs' order.

    The workers are forked, and only from a process with no other thread (``fork_safe``): a
    child forked while another thread holds a lock (the import lock, an allocator's) can
    deadlock. A process with threads (the launcher: its node heartbeat, its hang watchdog)
    runs the pool in a fresh child instead (``python -m trainprof.analysis.reduce --pool``), which
    forks the workers from its only thread."""
    if not jobs:
        return []
    cpus = settings.available_cpus()
    if not workers and not os.environ.get(WORKERS_ENV, "").strip() and len(jobs) > 1:
        workers = min(default_workers(), memory_bound(jobs))  # many CPUs, large traces
    workers = max(1, min(workers or default_workers(), len(jobs)))
    pieces = max(1, cpus // len(jobs)) if workers >= len(jobs) else 1
    jobs = [j[:-1] + (pieces,) for j in jobs]
    out: list = [None] * len(jobs)
    if workers == 1 and not isolate:
        for i, j in enumerate(jobs):
            # no collection after the last one (a full one costs tens of ms at start-up)
            out[i] = fn(j, run if j[0] in ("run", "job") else None, collect=i + 1 < len(jobs))
            if progress:
                progress(f"trace digests {i + 1}/{len(jobs)}")
        return out
    if not fork_safe() and not _POOL_CHILD:
        return pool_in_child(jobs, workers, progress)
    import multiprocessing as mp
    from concurrent.futures.process import BrokenProcessPool

    ProcessPoolExecutor, as_completed = _futures()

    # spawn only where there is no fork, in the pool's child (its main module is this package's)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    broken = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futs = {pool.submit(fn, j): k for k, j in enumerate(jobs)}
        for i, f in enumerate(as_completed(futs)):
            k = futs[f]
            try:
                out[k] = f.result()
            except BrokenProcessPool:
                broken.append(k)
            except Exception as e:  # noqa: BLE001
                out[k] = _worker_failed(jobs[k], e)
            if progress:
                progress(f"trace digests {i + 1}/{len(jobs)}")
    if broken:  # the pool (and its threads) are gone: fork again from this thread alone
        for k, res in _alone(fn, jobs, broken, workers, ctx).items():
            out[k] = res
    return out


_FUTURES = ("ProcessPoolExecutor", "as_completed")


def __getattr__(name: str):
    # concurrent.futures (with multiprocessing and logging: milliseconds of start-up) is imported
    # when a pool is first needed; one trace is digested in this process without it
    if name in _FUTURES:
        import concurrent.futures

        value = globals()[name] = getattr(concurrent.futures, name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _futures() -> tuple:
    """(ProcessPoolExecutor, as_completed): this module's names for them, imported on first use."""
    g = globals()
    return tuple(g[n] if n in g else __getattr__(n) for n in _FUTURES)


def fork_safe() -> bool:
    """This process may fork workers: the platform forks, and no other thread runs."""
    import multiprocessing as mp
    import threading

    return "fork" in mp.get_all_start_methods() and threading.active_count() == 1


POOL_MODULE = "trainprof.analysis.reduce"  # `python -m trainprof.analysis.reduce --pool FILE`: digest.pool_child_main
_POOL_CHILD = False  # this process is that child: its pool runs here, whatever fork_safe says


def pool_in_child(jobs: list[tuple], workers: int, progress=None) -> list[tuple]:
    """run_jobs in a fresh single-threaded child process (``python -m trainprof.analysis.reduce --pool
    FILE``): the jobs, the pool size and this process's input limit go in FILE (pickle), the
    results come back in FILE.out, progress lines on the child's stdout. A child that fails
    (it could not start, or was killed) fails the jobs it did not return, each said."""
    import pickle
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trainprof-pool-") as tmp:
        src = Path(tmp) / "jobs.pickle"
        src.write_bytes(pickle.dumps({"jobs": jobs, "workers": workers,
                                      "settings": _worker_settings()}))
        why = None
        try:
            with subprocess.Popen([sys.executable, "-m", POOL_MODULE, "--pool", str(src)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  text=True) as child:
                try:
                    for line in child.stdout:
                        if progress and line.startswith("trace digests "):
                            progress(line.strip())
                    child.wait()
                except BaseException:
                    child.kill()
                    raise
            if child.returncode:
                why = (f"killed by signal {-child.returncode}" if child.returncode < 0
                       else f"exit status {child.returncode}")
        except OSError as e:
            why = f"could not start it: {e.strerror or e}"
        try:
            results = pickle.loads((Path(tmp) / "jobs.pickle.out").read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as e:
            results = None
            why = why or f"no results ({type(e).__name__})"
    if isinstance(results, list) and len(results) == len(jobs):
        return [tuple(r) if r is not None else _worker_failed(j, RuntimeError(why))
                for r, j in zip(results, jobs)]
    return [_worker_failed(j, RuntimeError(f"the digest pool process failed: {why}"))
            for j in jobs]


def child_main(fn, src: str, prepare=None) -> int:
    """The child side of pool_in_child: this process has one thread, so its pool forks.
    ``prepare``: imports done once here, before the workers fork."""
    import pickle

    global _POOL_CHILD
    _POOL_CHILD = True
    spec = pickle.loads(Path(src).read_bytes())
    _init_worker(*spec["settings"])
    if prepare is not None:
        prepare()
    out = run_jobs(fn, spec["jobs"], spec["workers"], isolate=True,
                   progress=lambda line: print(line, flush=True))
    tmp = Path(src + ".out.tmp")
    tmp.write_bytes(pickle.dumps(out))
    os.replace(tmp, src + ".out")
    return 0


def _worker_settings() -> tuple:
    """What the pool's child process must see as this process does: the input limit
    (--max-input-mb, TRAINPROF_MAX_INPUT_MB)."""
    return safeio._override_mb, os.environ.get(safeio.ENV)


def _init_worker(override_mb, env_mb) -> None:
    if env_mb is None:
        os.environ.pop(safeio.ENV, None)
    else:
        os.environ[safeio.ENV] = env_mb
    try:
        safeio.set_max_input_mb(override_mb)
    except safeio.SettingError:
        pass


def _worker_failed(j: tuple, e: BaseException) -> tuple:
    return (j[2] if j[0] in ("run", "job") else j[3], None,
            f"{j[3]}: could not digest the trace: the worker process failed "
            f"({type(e).__name__}: {e})")


def _alone(fn, jobs: list[tuple], ks: list[int], workers: int, ctx) -> dict[int, tuple]:
    """Digest jobs ``ks`` each in a process of its own, ``workers`` at a time, forked from this
    thread (no pool, no other thread): one that kills its process fails alone."""
    from multiprocessing.connection import wait

    todo, running, out = list(ks), {}, {}
    while todo or running:
        while todo and len(running) < workers:
            k = todo.pop(0)
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_alone_child, args=(fn, jobs[k], w))
            p.start()
            w.close()
            running[k] = (p, r)
        ready = wait([r for _, r in running.values()])
        for k, (p, r) in list(running.items()):
            if r not in ready:
                continue
            try:
                out[k] = r.recv()
            except (EOFError, OSError) as e:  # it died (out of memory?) before answering
                p.join()
                out[k] = _worker_failed(jobs[k], RuntimeError(
                    f"{type(e).__name__}; exit status {p.exitcode}"))
            r.close()
            p.join()
            del running[k]
    return out


def _alone_child(fn, job: tuple, conn) -> None:
    conn.send(fn(job))
    conn.close()
