"""A job on two "nodes" (two torchrun invocations on localhost, --nnodes 2, c10d rendezvous), each
under its own `trainprof wrap`: one shared run directory, and one run directory per node analyzed
together; a node's directory alone says which ranks are missing and on which host.

Single-process cases: tests/unit/trainprof/test_launcher_liveness.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from trainprof.launch import outdir

from helpers import TRAINPROF, run_cli, wait_for
from paths import JOBS
from multinode_shared import HOST

JOB = JOBS / "ddp_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(outs: list[Path], job_id: str, nproc: int = 1, steps: int = 6) -> list:
    """Start both nodes' `trainprof wrap -- torchrun --nnodes 2 ...` at once; their results."""
    port = free_port()
    procs = []
    for i, out in enumerate(outs):
        cmd = TRAINPROF + ["wrap", "--out", str(out), "--profile-steps", "2-3", "--",
                           sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                           "--node-rank", str(i), "--nproc-per-node", str(nproc),
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                           "--rdzv-id", job_id, str(JOB), "--steps", str(steps)]
        logs = [tempfile.TemporaryFile("w+") for _ in range(2)]  # no pipe to fill up
        procs.append((subprocess.Popen(cmd, stdout=logs[0], stderr=logs[1], text=True), logs))
    # a node that fails leaves the other waiting in the rendezvous: end it rather than wait
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p, _ in procs):
            deadline = min(deadline, time.monotonic() + 20)
        time.sleep(0.2)
    results = []
    for p, logs in procs:
        if p.poll() is None:
            p.terminate()  # wrap passes it on to its job
        p.wait(timeout=60)
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read())
            f.close()
        results.append((p.returncode, *texts))
    return results


def summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def missing_problems(s: dict) -> list[str]:
    return [p for p in s["problems"] if "missing:" in p or "no readable files" in p]


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("shared") / "run"
    return out, two_nodes([out, out], "shared-job")


@pytest.fixture(scope="module")
def per_node_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("per-node")
    outs = [root / "node0", root / "node1"]
    return outs, two_nodes(outs, "per-node-job")


@pytest.mark.multiproc
def test_shared_out_one_run_directory_both_nodes_recorded_one_analysis(shared_run):
    out, results = shared_run
    for rc, _, err in results:
        assert rc == 0, err  # the second node needed no --force
    errs = [err for _, _, err in results]
    assert sum("joining job shared-job" in e for e in errs) == 1
    # exactly one node analyzed (the last to finish): the other said who does
    analyzed = [e for _, _o, e in results if "summary:" in e]  # wrap prints it on stderr
    assert len(analyzed) == 1
    assert sum("the last node to finish analyzes" in e or "another node of this job analyzes" in e
               for e in errs) == 1
    records = [json.loads(p.read_text()) for p in sorted((out / "nodes").glob("*.json"))]
    assert len(records) == 2
    assert sorted(r["ranks"] for r in records) == [[0], [1]]
    for r in records:
        assert r["status"] == "ok" and r["exit_code"] == 0 and r["job_id"] == "shared-job"
        assert r["command"][0] == sys.executable and "--nnodes" in r["command"]
        assert r["start_time"]["ns"] <= r["end_time"]["ns"] and r["finished_ns"]
    man = json.loads((out / "manifest.json").read_text())
    assert man["job_id"] == "shared-job" and man["node"] in {r["node"] for r in records}
    s = summary(out)
    assert s["run"]["world_size"] == 2 and "partial" not in s["run"]
    assert not missing_problems(s), s["problems"]
    assert [n["ranks"] for n in s["run"]["nodes"]] == ["0", "1"]
    assert {n["status"] for n in s["run"]["nodes"]} == {"ok"} and s["run"]["exit_code"] == 0
    assert s["run"]["profiled"]["text"] == "2 of 2 ranks profiled (policy all)"
    assert len(list((out / "profiler").glob("rank-*.pt.trace.json.gz"))) == 2
    # each rank says which launcher started it; every node knows every rank's host
    metas = [json.loads((out / f"ranks/rank-0000{r}/meta.json").read_text()) for r in (0, 1)]
    assert {m["node"] for m in metas} == {r["node"] for r in records}
    assert all(m["hosts"] == {HOST: "0-1"} for m in metas)


@pytest.mark.multiproc
def test_shared_out_of_another_job_is_still_refused(shared_run, tmp_path):
    out, _ = shared_run
    res = run_cli(["wrap", "--out", out, "--job-id", "another-job", "--", sys.executable, "-c",
                   "pass"])
    assert res.returncode == 2
    assert "holds a previous trainprof run (job 'shared-job'" in res.stderr
    # the same job id after the job ended: a rerun, refused too
    res = run_cli(["wrap", "--out", out, "--job-id", "shared-job", "--", sys.executable, "-c",
                   "pass"])
    assert res.returncode == 2 and "already finished" in res.stderr


@pytest.mark.multiproc
def test_per_node_directories_analyzed_as_one_job(per_node_runs, tmp_path):
    (d0, d1), results = per_node_runs
    for rc, _, err in results:
        assert rc == 0, err
    # each node analyzed its own directory: loud about the other node's ranks, naming the host
    # (c10d rendezvous assigns node ranks in arrival order: either directory may hold rank 0)
    held = [[int(p.name[5:]) for p in (d / "ranks").glob("rank-*")] for d in (d0, d1)]
    assert sorted(held) == [[0], [1]]
    for d, gone in ((d0, held[1][0]), (d1, held[0][0])):
        s = summary(d)
        (line,) = missing_problems(s)
        assert f"world size 2, 1 rank(s) present; missing: {gone} (host {HOST})" in line
        assert s["run"]["partial"]["missing_ranks"] == [gone]
    merged = tmp_path / "merged"
    res = run_cli(["analyze", d0, d1, "--out", merged, "--no-report"])
    assert res.returncode == 0, res.stderr
    s = summary(merged)
    assert s["run"]["world_size"] == 2 and "partial" not in s["run"]
    assert not missing_problems(s), s["problems"]
    assert sorted(r["rank"] for r in s["run"]["ranks"]) == [0, 1]
    assert s["run"]["dirs"] == [str(d0), str(d1)]
    assert sorted(n["ranks"] for n in s["run"]["nodes"]) == ["0", "1"]
    assert s["metrics"]["step_time"]["job"].get("partial") is None
    # default output: the first directory
    res = run_cli(["analyze", d1, d0, "--no-report", "-q"])
    assert res.returncode == 0, res.stderr
    assert not missing_problems(summary(d1))


@pytest.mark.multiproc
def test_per_node_directories_of_different_jobs_or_same_ranks_are_refused(per_node_runs,
                                                                          shared_run):
    (d0, d1), _ = per_node_runs
    shared, _ = shared_run
    res = run_cli(["analyze", d0, shared, "--no-report"])
    assert res.returncode == 2
    assert "different jobs" in res.stderr and str(d0 / "manifest.json") in res.stderr \
        and str(shared / "manifest.json") in res.stderr
    res = run_cli(["analyze", d0, d0, "--no-report"])
    assert res.returncode == 2 and "given twice" in res.stderr


def test_damaged_node_record_of_another_node_never_changes_the_exit_code(tmp_path):
    """A node record written by another version (or damaged) with fields of unexpected types:
    the launcher that joins the run still exits as its job did (it raised AttributeError while
    deciding which node analyzes: exit 1 and a traceback instead of the job's 3)."""
    from trainprof.rundir import nodes

    out = tmp_path / "run"
    (out / "nodes").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({
        "schema_version": 1, "kind": "trainprof-run", "job_id": "jobx", "node": "other-1-abc",
        "host": "elsewhere", "launcher_pid": 12345, "status": "running"}))
    bad = {"kind": "trainprof-node", "node": "other-1-abc", "host": "elsewhere",
           "launcher_pid": 12345, "status": "running", "start_time": "yesterday",
           "end_time": [1], "ranks": ["a", None], "finished_ns": 5}
    (out / "nodes" / "other-1-abc.json").write_text(json.dumps(bad))
    res = run_cli(["wrap", "--out", out, "--job-id", "jobx", "--", sys.executable, "-c",
                   "import sys; sys.exit(3)"])
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr and "joining job jobx" in res.stderr
    recs = nodes.read_records(out)
    assert len(recs) == 2
    merged = nodes.merge({"kind": "trainprof-run"}, recs)
    assert len(merged["nodes"]) == 2 and merged["exit_code"] == 3


def test_run_directory_lock_never_removes_what_is_not_a_dead_launchers_lock(tmp_path,
                                                                           monkeypatch):
    """The --out lock (RUN/.trainprof.lock): a user's file of that name was deleted (taken for a
    stale lock by its age), a live launcher's lock was broken after 60 s by the file's mtime
    (another host's clock ahead of the file server), and a launcher's exit removed whatever lock
    was there, another launcher's included."""
    from trainprof.launch import outdir

    monkeypatch.setattr(outdir, "LOCK_WAIT_S", 0.6)
    monkeypatch.setattr(outdir, "LOCK_STALE_S", 0.3)
    old = time.time() - 7200
    # a user's file of that name, in a directory that is not a run: refused, left as it is
    user = tmp_path / "user"
    user.mkdir()
    (user / ".trainprof.lock").write_text("my notes\n")
    (user / "data.txt").write_text("data\n")
    import os

    os.utime(user / ".trainprof.lock", (old, old))
    res = run_cli(["wrap", "--out", user, "--", sys.executable, "-c", "pass"])
    assert res.returncode == 2
    assert (user / ".trainprof.lock").read_text() == "my notes\n"
    # a live launcher of this host holds it (an mtime far in the past): waited for, never broken
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".trainprof.lock"
    held = f"{os.getpid()} {outdir._hostname()}\n"
    lock.write_text(held)
    os.utime(lock, (old, old))
    with pytest.raises(outdir.OutDirError, match="held by another trainprof launcher"):
        with outdir._Lock(run):
            pass
    assert lock.read_text() == held
    # a dead launcher of this host: broken at once; ours removed at the end, and only ours
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    lock.write_text(f"{dead} {outdir._hostname()}\n")
    t0 = time.monotonic()
    with outdir._Lock(run) as mine:
        assert time.monotonic() - t0 < 0.3
        assert lock.read_text() == held
        lock.unlink()  # another launcher broke it and took the lock meanwhile
        lock.write_text("424242 otherhost\n")
    assert lock.read_text() == "424242 otherhost\n" and mine.fd is not None
    # a lock of another host: broken once this waiter saw it unchanged for LOCK_STALE_S
    t0 = time.monotonic()
    with outdir._Lock(run):
        assert time.monotonic() - t0 >= 0.3
    assert not lock.exists()


def test_force_never_removes_the_run_of_a_launcher_still_running(tmp_path):
    """`wrap --force` on the --out of a launcher of this host that is still running (another
    job, or a node without a known job id): it removed the live run's manifest and node record
    while that launcher kept writing there."""
    out = tmp_path / "run"
    first = subprocess.Popen(TRAINPROF + ["wrap", "--no-analyze", "--out", str(out), "--",
                                          sys.executable, "-c", "import time; time.sleep(30)"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: any((out / "nodes").glob("*.json")), timeout=60)
        def files():  # the live launcher's own temporaries (an atomic write) come and go
            return sorted(p.relative_to(out) for p in out.rglob("*")
                          if p.is_file() and not outdir.TMP_RE.fullmatch(p.name))

        before = files()
        res = run_cli(["wrap", "--force", "--no-analyze", "--out", out, "--", sys.executable,
                       "-c", "pass"])
        assert res.returncode == 2, res.stderr
        assert f"pid {first.pid} on this host" in res.stderr
        after = files()
        assert set(before) <= set(after)
    finally:
        first.terminate()
        first.wait(timeout=60)
    # once it has ended, --force replaces it as before
    res = run_cli(["wrap", "--force", "--no-analyze", "--out", out, "--", sys.executable, "-c",
                   "pass"])
    assert res.returncode == 0, res.stderr


def _pids_of(marker: str) -> list[int]:
    """Processes whose command line holds marker (the test's own job id)."""
    import os

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


@pytest.mark.multiproc
@pytest.mark.long  # a shared --out stays covered by the suite; this kill case: benchmarks/long_tests.py
def test_shared_out_node_launcher_killed_the_survivor_analyzes(tmp_path):
    """Two nodes sharing one --out; the second node's launcher is SIGKILLed while the job runs
    (its torchrun goes on). The first node, last one left, analyzes on its own, naming the gone
    node, and exits as its job did."""
    import os
    import signal

    out = tmp_path / "run"
    job_id = f"killed-launcher-{os.getpid()}"
    port = free_port()
    procs = []
    for i in range(2):
        cmd = TRAINPROF + ["wrap", "--out", str(out), "--profile-steps", "2-3", "--",
                           sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                           "--node-rank", str(i), "--nproc-per-node", "1", "--rdzv-backend",
                           "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job_id,
                           str(JOB), "--steps", "30", "--slow-rank", "0", "--slow-ms", "200"]
        err = tempfile.TemporaryFile("w+")
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True),
                      err))
        if i == 0:
            assert wait_for(lambda: len(list((out / "nodes").glob("*.json"))) == 1, timeout=60)
    try:
        assert wait_for(lambda: len(list((out / "nodes").glob("*.json"))) == 2
                        and len(list(out.glob("ranks/rank-*/heartbeat.jsonl"))) == 2, timeout=120)
        killed = procs[1][0]
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        survivor, err = procs[0]
        assert survivor.wait(timeout=300) == 0
        err.seek(0)
        text = err.read()
        assert "is gone" in text and "this node is the last one left and analyzes" in text, text
        assert f"-{killed.pid}-" in text  # the gone node, named
        s = summary(out)
        assert sorted(n["status"] for n in s["run"]["nodes"]) == ["ok", "running"]
        claim = json.loads((out / "nodes" / ".analysis-claim").read_text())
        assert len(claim["presumed_dead"]) == 1 and f"-{killed.pid}-" in claim["presumed_dead"][0]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        # the killed launcher's torchrun and its worker, orphaned: ended with the job, or here
        wait_for(lambda: not _pids_of(job_id), timeout=60)
        for pid in _pids_of(job_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


