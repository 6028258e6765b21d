"""`trainprof wrap` preserves the job's output, exit code and signals, and leaves a readable
run directory whatever happened to the job. Each case compares against the bare command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import TRAINPROF, run_cli, wait_for, write_script

TRAIN = """
import os, sys, time
steps = int(os.environ.get("STEPS", "5"))
if steps:  # (STEPS=0: what the interpreter makes of END, without importing torch)
    import torch
    m = torch.nn.Linear(16, 16); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(steps):
    m(torch.randn(4, 16)).sum().backward(); opt.step(); opt.zero_grad()
    if os.environ.get("FLAG"):
        open(os.environ["FLAG"], "w").close()
    time.sleep(float(os.environ.get("SLEEP", "0")))
print("stdout-marker", flush=True)
print("stderr-marker", file=sys.stderr, flush=True)
how = os.environ.get("END", "0")
if how.startswith("sig"):
    os.kill(os.getpid(), int(how[3:]))
sys.exit(int(how))
"""


def bare(script, env):
    return subprocess.run([sys.executable, str(script)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("end", ["0", "3", "sig9"])  # (SIGTERM: the test below sends it to wrap)
def test_python_script_exit_code_and_output_preserved(tmp_path, end):
    script = write_script(tmp_path / "train.py", TRAIN)
    env = {"END": end}
    expected = bare(script, {**env, "STEPS": "0"}).returncode  # the same exit, 5 s sooner
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "1-2", "--", sys.executable, script],
                  env=env, cwd=tmp_path)
    assert res.returncode == expected, res.stderr
    # stdout is the job's alone (`wrap ... > out.txt`); wrap's findings go to stderr
    assert res.stdout == "stdout-marker\n" and "stderr-marker" in res.stderr
    assert "summary: " in res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["exit_code"] == (128 + int(end[3:]) if end.startswith("sig") else int(end))
    assert manifest["status"] == ("ok" if end == "0" else "killed" if end.startswith("sig") else "failed")
    steps = [json.loads(x) for x in (out / "ranks/rank-00000/steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(5))
    assert (out / "profiler/rank-00000.pt.trace.json.gz").exists()
    assert (out / "summary.json").exists(), res.stderr  # analysis ran even after a signal


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_wrap_reaches_job_and_run_dir_stays_readable(tmp_path, sig):
    script = write_script(tmp_path / "train.py", TRAIN)
    flag = tmp_path / "started"
    out = tmp_path / "run"
    env = {**os.environ, "STEPS": "1000", "SLEEP": "0.05", "FLAG": str(flag)}
    # a test run in a background shell inherits SIGINT ignored, and so would wrap and the job
    # (as they should: a bare job would ignore it too); this test is about forwarding it
    proc = subprocess.Popen(TRAINPROF + ["wrap", "--out", str(out), "--profile-steps", "none", "--",
                                         sys.executable, str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert wait_for(flag.exists, timeout=60)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    # The job dies of the signal (Python re-raises SIGINT after an unhandled KeyboardInterrupt),
    # and wrap dies the same way.
    assert proc.returncode == -sig, err
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] in ("killed", "failed")
    steps = (out / "ranks/rank-00000/steps.jsonl").read_text().splitlines()
    assert len(steps) >= 1 and json.loads(steps[-1])["step"] >= 0


def test_torchrun_exit_codes_match_bare_torchrun(tmp_path):
    script = write_script(tmp_path / "ddp.py", """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(4):
    m(torch.randn(2, 8)).sum().backward()
    for p in m.parameters(): dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
dist.barrier()
code = int(os.environ.get("FAIL_RANK_CODE", "0")) if dist.get_rank() == 1 else 0
dist.destroy_process_group()
sys.exit(code)
""")
    for code in ("0", "4"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script)]
        env = {**os.environ, "FAIL_RANK_CODE": code}
        # a clean job exits 0; what torchrun makes of a failed worker is asked of torchrun itself
        expected = 0 if code == "0" else subprocess.run(cmd, env=env, capture_output=True,
                                                        timeout=300).returncode
        out = tmp_path / f"run{code}"
        res = run_cli(["wrap", "--out", out, "--profile-steps", "1-2", "--no-analyze", "--"] + cmd,
                      env={"FAIL_RANK_CODE": code}, timeout=300)
        assert res.returncode == expected, res.stderr
        assert (code == "0") == (expected == 0)
        for r in (0, 1):
            meta = json.loads((out / f"ranks/rank-0000{r}/meta.json").read_text())
            assert meta["rank"] == r and meta["world_size"] == 2 and meta["backend"] == "gloo"
            assert meta["activated_by"] == "init_process_group"


def test_refuses_non_empty_out_without_force(tmp_path):
    script = write_script(tmp_path / "t.py", "print('hi')")
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run_cli(["wrap", "--out", out, "--", sys.executable, script])
    assert res.returncode == 2 and "not empty" in res.stderr and str(out) in res.stderr
    (out / "keep.txt").unlink()
    res = run_cli(["wrap", "--out", out, "--no-analyze", "--", sys.executable, script])
    assert res.returncode == 0, res.stderr  # a previous run...
    (out / "keep.txt").write_text("mine")  # ...beside which the user keeps a file
    res = run_cli(["wrap", "--out", out, "--", sys.executable, script])
    assert res.returncode == 2 and "previous trainprof run" in res.stderr
    res = run_cli(["wrap", "--out", out, "--force", "--no-analyze", "--", sys.executable, script])
    assert res.returncode == 0, res.stderr
    assert (out / "keep.txt").read_text() == "mine"  # --force removes only trainprof's files
    assert json.loads((out / "manifest.json").read_text())["status"] == "ok"


def test_job_without_torch_is_untouched(tmp_path):
    script = write_script(tmp_path / "t.py", "import sys; print(sorted(m for m in sys.modules if m.startswith('torch')))")
    res = run_cli(["wrap", "--out", tmp_path / "run", "--no-analyze", "--", sys.executable, script])
    assert res.returncode == 0 and "[]" in res.stdout  # the bootstrap imports nothing heavy


def test_jobs_own_sitecustomize_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os; os.environ['USER_SITE_RAN'] = 'yes'\n")
    script = write_script(tmp_path / "t.py", "import os; print('site:', os.environ.get('USER_SITE_RAN'))")
    res = run_cli(["wrap", "--out", tmp_path / "run", "--no-analyze", "--", sys.executable, script],
                  env={"PYTHONPATH": str(site)})
    assert res.returncode == 0 and "site: yes" in res.stdout, res.stderr


def test_usage_errors(tmp_path):
    res = run_cli(["wrap", "--out", tmp_path / "r"])
    assert res.returncode == 2
    res = run_cli(["wrap", "--out", tmp_path / "r", "--profile-steps", "5-2", "--", "true"])
    assert res.returncode != 0 and "profile steps" in res.stderr
    res = run_cli(["wrap", "--out", tmp_path / "r2", "--", "/nonexistent/cmd"])
    assert res.returncode != 0 and "cannot start" in res.stderr


def _stream(out, rank, name):
    path = out / f"ranks/rank-{rank:05d}/{name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


CHILD_EVAL = """
import os, torch
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(4):
    m(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
print("child-done", os.getpid(), flush=True)
"""


@pytest.mark.multiproc
def test_processes_a_rank_starts_are_not_probed_as_that_rank(tmp_path):
    """A rank's subprocess inherits RANK/LOCAL_RANK/WORLD_SIZE; a rank's fork inherits even the
    probes' state. Neither may write into the rank's directory. The DataLoader workers (fork)
    go on serving batches."""
    write_script(tmp_path / "child_eval.py", CHILD_EVAL)
    script = write_script(tmp_path / "ddp.py", """
import os, subprocess, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo"); rank = dist.get_rank()
data = torch.utils.data.TensorDataset(torch.randn(48, 8))
loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=1)
model = DDP(torch.nn.Linear(8, 8)); opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x,) in enumerate(loader):
    model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    if step == 2 and rank == 0:
        subprocess.run([sys.executable, "child_eval.py"], check=True)
    if step == 2 and rank == 1:
        pid = os.fork()
        if pid == 0:
            m = torch.nn.Linear(4, 4); o = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(4):
                m(torch.randn(2, 4)).sum().backward(); o.step()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
dist.barrier()
open(f"pid{rank}", "w").write(str(os.getpid()))
dist.destroy_process_group()
""")
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--no-analyze", "--",
                   sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", str(script)], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "child-done" in res.stdout
    pids = {r: int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)}
    for r in (0, 1):
        assert [s["step"] for s in _stream(out, r, "steps")] == list(range(6))
        assert {h["pid"] for h in _stream(out, r, "heartbeat")} == {pids[r]}
        assert [h["event"] for h in _stream(out, r, "heartbeat")].count("close") == 1
        meta = json.loads((out / f"ranks/rank-{r:05d}/meta.json").read_text())
        assert meta["pid"] == pids[r] and meta["world_size"] == 2
    assert sorted(p.name for p in (out / "ranks").iterdir()) == ["rank-00000", "rank-00001"]


def test_child_process_of_a_single_process_job_is_not_probed(tmp_path):
    """A plain `python train.py` (no rank variables at all) that runs an evaluation script:
    the child would be rank 0 of 1 as well."""
    write_script(tmp_path / "child_eval.py", CHILD_EVAL)
    script = write_script(tmp_path / "train.py", """
import os, subprocess, sys, torch
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(5):
    m(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
    if step == 1:
        subprocess.run([sys.executable, "child_eval.py"], check=True)
print("parent", os.getpid(), flush=True)
""")
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--no-analyze", "--",
                   sys.executable, script], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "child-done" in res.stdout
    parent = int(res.stdout.split("parent")[1].split()[0])
    assert [s["step"] for s in _stream(out, 0, "steps")] == list(range(5))
    assert {h["pid"] for h in _stream(out, 0, "heartbeat")} == {parent}
    assert json.loads((out / "ranks/rank-00000/meta.json").read_text())["pid"] == parent


@pytest.mark.multiproc
def test_mp_spawn_ranks_are_probed(tmp_path):
    """The PyTorch DDP tutorial's layout: `python train.py` whose mp.spawn children are the
    ranks (rank given to init_process_group, no rank variables in the environment)."""
    script = write_script(tmp_path / "spawn.py", """
import os, socket, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def work(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DDP(torch.nn.Linear(8, 8)); opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(work, args=(2, port), nprocs=2, join=True)
""")
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--no-analyze", "--",
                   sys.executable, script], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    for r in (0, 1):
        assert [s["step"] for s in _stream(out, r, "steps")] == list(range(4))
        meta = json.loads((out / f"ranks/rank-{r:05d}/meta.json").read_text())
        assert meta["rank"] == r and meta["world_size"] == 2
        assert meta["activated_by"] == "init_process_group"
