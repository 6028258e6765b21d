"""Regression tests for defects found in the safety review of multi-node runs, --profile-ranks
and trace digests: each reproduces the defect it guards against.

Single-process cases: tests/unit/trainprof/test_review_safety_files.py."""

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
