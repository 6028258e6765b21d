"""Regression tests for defects found in the safety review of multi-node runs, --profile-ranks
and trace digests: each reproduces the defect it guards against."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

def _store_host_job(setup: str) -> str:
    """A 3-rank spawn job whose rank 0 hosts the TCPStore and runs ``setup`` (a probe that
    waits for peers that never answer), then all ranks finish and exit."""
    return textwrap.dedent("""
        import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp

        SETUP

        def worker(rank, port):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=3)
            if rank == 0:
                setup()
            t = torch.ones(1); dist.all_reduce(t)
            time.sleep(0.5)
            dist.destroy_process_group()
            if rank == 0:  # the store's host exits last: its clients' teardown never races it
                time.sleep(1.0)
            print(f"rank {rank} done", flush=True)

        if __name__ == "__main__":
            mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=3)
            print("ALL OK", flush=True)
    """).replace("SETUP", textwrap.dedent(setup).strip())


_HOSTMAP_JOB = _store_host_job("""
    def setup():  # the store's host waits for keys rank 1 and 2 never write
        from trainprof.probes import hostmap

        class S:
            meta = {"local_rank": 0}
            rank = 0
            def update_meta(s, **kw): pass
            def on_step(s, fn): pass

        hostmap.attach(S())
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _run_store_host_job(tmp_path, job: str):
    """Run the job; it must exit 0 with every rank done and no abort."""
    script = tmp_path / "job.py"
    script.write_text(job)
    p = subprocess.run([sys.executable, str(script), str(_free_port())], capture_output=True,
                       text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "terminate called" not in out and "SIGABRT" not in out, out[-3000:]
    assert "ALL OK" in p.stdout and p.stdout.count("done") == 3
    return p



@pytest.mark.multiproc
def test_hostmap_wait_does_not_abort_the_store_host_at_exit(tmp_path):
    """The rank hosting the TCPStore exits while its hostmap thread still waits for peers' keys:
    a thread blocked in store.wait during finalization aborted the process (SIGABRT)."""
    _run_store_host_job(tmp_path, _HOSTMAP_JOB)


def test_cached_digest_does_not_bypass_a_smaller_input_limit(tmp_path):
    """A digest cached by an analysis with a larger --max-input-mb was reused for a trace the
    current limit refuses: the trace must be refused (a problem), cached digest or not."""
    from synth import cached, synth_run

    from trainprof import safeio
    from trainprof.rundir.files import profiler_trace_path
    from trainprof.analysis.run import RunDir

    run_dir = synth_run(tmp_path / "run", 1)
    cached(run_dir)  # built under the default limit
    size = profiler_trace_path(run_dir, 0).stat().st_size
    try:
        safeio.set_max_input_mb(size / 4 / (1 << 20))
        run = RunDir(run_dir)
        docs = run.digest_docs(write=True)
        assert 0 not in (docs or {})
        assert any("larger than" in p and "--max-input-mb" in p for p in run.problems), run.problems
    finally:
        safeio.set_max_input_mb(None)
    run = RunDir(run_dir)  # the limit back: the cached digest is used again
    assert 0 in run.digest_docs(write=True)


def test_outdir_lock_is_not_broken_while_its_holder_lives(tmp_path, monkeypatch):
    """A launcher deciding about --out for longer than the stale-lock age (a --force removing
    many files) had its lock broken by a second launcher, both then decided at once, and the
    first removed the second's lock on leaving."""
    import threading
    import time

    from trainprof.launch import outdir

    monkeypatch.setattr(outdir, "LOCK_STALE_S", 0.4)
    inside, overlaps = [], []

    def hold(name, seconds):
        with outdir._Lock(tmp_path):
            if inside:
                overlaps.append((name, list(inside)))
            inside.append(name)
            time.sleep(seconds)
            inside.remove(name)

    a = threading.Thread(target=hold, args=("a", 1.5))
    a.start()
    time.sleep(0.1)
    b = threading.Thread(target=hold, args=("b", 0.1))
    b.start()
    a.join()
    b.join()
    assert overlaps == []
    assert not (tmp_path / outdir.LOCK).exists()


def test_outdir_lock_of_a_dead_holder_is_still_broken(tmp_path, monkeypatch):
    import os
    import time

    from trainprof.launch import outdir

    monkeypatch.setattr(outdir, "LOCK_STALE_S", 0.2)
    lock = tmp_path / outdir.LOCK
    lock.write_text("12345\n")
    old = time.time() - 5
    os.utime(lock, (old, old))
    t0 = time.monotonic()
    with outdir._Lock(tmp_path):
        assert lock.exists()
    assert time.monotonic() - t0 < 5 and not lock.exists()


@pytest.mark.parametrize("profiled", [True, False])
def test_rank_to_profile_without_a_trace_is_a_problem(tmp_path, profiled):
    """A rank that was to record the profiler window but lost its trace was reported as
    "2 of 2 ranks profiled" with no problem; a rank skipped on purpose stays silent."""
    import json

    from synth import synth_run

    from trainprof.analysis.runner import analyze
    from trainprof.rundir.files import profiler_trace_path
    from trainprof.analysis.run import RunDir

    run_dir = synth_run(tmp_path / "run", 2)
    for r in range(2):
        meta = run_dir / "ranks" / f"rank-{r:05d}" / "meta.json"
        doc = json.loads(meta.read_text())
        doc.update(profiled=profiled or r == 0, profile_policy="all" if profiled else "list",
                   profile_ranks="all" if profiled else "0")
        meta.write_text(json.dumps(doc))
    profiler_trace_path(run_dir, 1).unlink()
    problems = analyze(RunDir(run_dir))["problems"]
    lost = [p for p in problems if "left no trace" in p]
    if profiled:
        assert len(lost) == 1 and "ranks 1:" in lost[0], problems
    else:
        assert lost == [], problems


_CLOCK_JOB = _store_host_job("""
    def setup():  # the store's host waits for pings ranks 1 and 2 never send
        from trainprof.probes import clock

        class W:
            def write(s, rec): pass

        class S:
            state = {}
            rank = 0
            def stream(s, name): return W()

        clock.ClockProbe(S()).start()
""")


@pytest.mark.multiproc
def test_clock_start_phase_leaves_the_job_exit_alone(tmp_path):
    """The clock probe's start phase waits on a daemon thread for peers' pings; the rank that
    hosts the TCPStore exits meanwhile: no abort, no C++ warnings or stack traces on the job's
    stderr (a blocking store.wait in flight at finalization gave them)."""
    p = _run_store_host_job(tmp_path, _CLOCK_JOB)
    assert "[W" not in p.stderr, p.stderr[-3000:]
