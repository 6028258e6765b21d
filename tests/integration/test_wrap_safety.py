"""`trainprof wrap` is safe around the user's files, settings and exit codes: --force removes only
what a previous trainprof run wrote; /, $HOME, . and its ancestors are refused; a full or
read-only run directory never changes the job's exit status; every TRAINPROF_* value is checked
before the job starts; a run with its probes off never reads as "nothing looks wrong"; a rank
killed by SIGKILL is named as the first failure. Most cases need no torch job at all.

Single-process cases: tests/unit/trainprof/test_wrap_safety_rules.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TRAINPROF, run_cli, write_script


TORCH_JOB = """
import os, sys, time, torch
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(int(os.environ.get("STEPS", "6"))):
    m(torch.randn(2, 8)).sum().backward(); opt.step(); opt.zero_grad()
    if i == 2 and os.environ.get("FLAG"):
        open(os.environ["FLAG"], "w").close()
    time.sleep(float(os.environ.get("SLEEP", "0")))
sys.exit(int(os.environ.get("CODE", "3")))
"""


def tree(root: Path) -> dict[str, str]:
    """Every entry under root (symlinks not followed): relative path -> content or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = p.read_bytes().decode("utf-8", "replace")
            else:
                out[rel] = "<dir>"
    return out


MEASURE = """
import json, resource, subprocess, sys, time
t0 = time.monotonic()
p = subprocess.run(sys.argv[2:], capture_output=True, text=True)
json.dump({"rc": p.returncode, "out": p.stdout, "err": p.stderr, "s": time.monotonic() - t0,
           "rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024},
          open(sys.argv[1], "w"))
"""


def run_measured(args, tmp_path: Path, env=None, cwd=None) -> dict:
    """Run `trainprof ARGS` from a fresh process that reports its child's peak RSS (MB, from
    resource.getrusage(RUSAGE_CHILDREN)) and wall time, so that no earlier child counts."""
    report = tmp_path / f"measure-{time.monotonic_ns()}.json"
    e = {**os.environ, **(env or {})}
    subprocess.run([sys.executable, "-c", MEASURE, str(report)] + TRAINPROF + [str(a) for a in args],
                   env=e, cwd=cwd, timeout=300, check=True)
    return json.loads(report.read_text())


def trainprof_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(("trainprof:", "Error:"))]


# --------------------------------------------------------------------------- --out and --force


def test_force_on_a_directory_with_foreign_files_deletes_nothing(tmp_path):
    d = tmp_path / "d"
    (d / "profiler").mkdir(parents=True)
    (d / "profiler" / "notes.md").write_text("x")
    (d / "ranks").mkdir()
    (d / "summary.json").write_text('{"mine": 1}')
    (d / "manifest.json").write_text('{"kind": "something-else"}')
    before = tree(d)
    flag = tmp_path / "started"
    m = run_measured(["wrap", "--out", d, "--force", "--", sys.executable, "-c",
                      f"open({str(flag)!r}, 'w')"], tmp_path)
    assert m["rc"] == 2, m["err"]
    (line,) = trainprof_lines(m["err"])
    assert "not a trainprof run directory" in line and "even with --force" in line
    assert tree(d) == before and not flag.exists()  # nothing deleted, the job not started
    assert m["s"] < 60 and m["rss_mb"] < 400


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    """A real run (one rank, a profiler window), copied by each test that changes it."""
    root = tmp_path_factory.mktemp("prev")
    script = write_script(root / "job.py", TORCH_JOB)
    out = root / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "1-2", "--", sys.executable, script],
                  env={"CODE": "0"})
    assert res.returncode == 0, res.stderr
    return out


def test_force_removes_only_what_the_run_wrote(previous_run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(previous_run, d, symlinks=True)
    man = json.loads((d / "manifest.json").read_text())
    written = set(man["files"])
    assert "ranks/rank-00000/steps.jsonl" in written and "profiler/rank-00000.pt.trace.json.gz" in written
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "steps.jsonl").write_text("the user's\n")
    (outside / "meta.json").write_text("{}")
    # the user's files, some named like ours
    (d / "profiler" / "notes.md").write_text("notes")
    (d / "ranks" / "notes.txt").write_text("notes")
    (d / "ranks" / "rank-00000" / "mine.jsonl").write_text("{}\n")  # our layout, not our file
    (d / "ranks" / "rank-00001").symlink_to(outside, target_is_directory=True)
    (d / "ranks" / "rank-00000" / "link.jsonl").symlink_to(outside / "steps.jsonl")
    (d / "report.html").write_text("<html>the user's own report</html>")
    foreign = ["profiler/notes.md", "ranks/notes.txt", "ranks/rank-00000/mine.jsonl",
               "ranks/rank-00001", "ranks/rank-00000/link.jsonl", "report.html"]
    theirs = {k: v for k, v in tree(d).items() if k in foreign}
    outside_before = tree(outside)
    before = tree(d)
    # without --force: refused, and told exactly what --force would do
    res = run_cli(["wrap", "--out", d, "--", sys.executable, "-c", "pass"])
    assert res.returncode == 2
    (line,) = trainprof_lines(res.stderr)
    assert "holds a previous trainprof run" in line and "would stay" in line
    for rel in foreign:
        assert rel in line
    assert tree(d) == before
    # with --force: the previous run's files go, every other one stays as it was
    res = run_cli(["wrap", "--out", d, "--force", "--no-analyze", "--", sys.executable, "-c", "pass"])
    assert res.returncode == 0, res.stderr
    assert "removed" in res.stderr and "kept 6" in res.stderr
    after = tree(d)
    assert {k: after.get(k) for k in theirs} == theirs
    assert tree(outside) == outside_before  # nothing followed through a symlink
    for rel in written - {"manifest.json"}:
        assert rel not in after, rel
    assert not (d / "summary.json").exists()  # trainprof's own summary (checked by content)
    new = json.loads((d / "manifest.json").read_text())
    assert new["status"] == "ok" and new["command"][-1] == "pass"
    assert not set(new["files"]) & set(foreign)  # the new inventory leaves the user's files out


@pytest.mark.parametrize("where", ["/", "home", ".", "..", "empty-cwd"])
def test_out_at_root_home_cwd_and_ancestors_is_refused(tmp_path, where):
    home = tmp_path / "home"
    work = home / "work" / "sub"
    work.mkdir(parents=True)
    (home / "keep.txt").write_text("mine")
    (work / "keep.txt").write_text("mine")
    if where == "empty-cwd":
        work = tmp_path / "empty"
        work.mkdir()
    out = {"/": "/", "home": str(home), ".": ".", "..": "..", "empty-cwd": "."}[where]
    flag = tmp_path / "started"
    before = tree(tmp_path)
    for force in ([], ["--force"]):
        m = run_measured(["wrap", "--out", out, *force, "--", sys.executable, "-c",
                          f"open({str(flag)!r}, 'w')"], tmp_path, env={"HOME": str(home)}, cwd=work)
        assert m["rc"] == 2, m["err"]
        (line,) = trainprof_lines(m["err"])
        assert "trainprof never writes a run into it" in line
        assert not flag.exists()
        assert m["s"] < 60
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("measure-")} == \
        {k: v for k, v in before.items() if not k.startswith("measure-")}


def test_force_plan_on_a_large_foreign_tree_is_bounded(tmp_path):
    """A previous run beside 20 000 files of the user's: --force reads names only."""
    d = tmp_path / "run"
    res = run_cli(["wrap", "--out", d, "--no-analyze", "--", sys.executable, "-c", "pass"])
    assert res.returncode == 0, res.stderr
    big = d / "ranks" / "rank-00000"
    big.mkdir(parents=True)
    for i in range(20_000):
        (big / f"user{i}.dat").write_bytes(b"x")
    m = run_measured(["wrap", "--out", d, "--force", "--no-analyze", "--", sys.executable, "-c",
                      "pass"], tmp_path)
    assert m["rc"] == 0, m["err"]
    assert len(list(big.iterdir())) == 20_000
    assert m["s"] < 60 and m["rss_mb"] < 400, m


# --------------------------------------------------------------------------- the job's exit code


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err, err


def test_read_only_run_directory_mid_run_keeps_exit_code(tmp_path, monkeypatch):
    """Every write trainprof makes after the job started fails (EROFS), in wrap's process."""
    import errno

    from click.testing import CliRunner

    import trainprof.launch.launcher as launcher
    import trainprof.analysis.run as rundir
    from trainprof.cli import main

    real = rundir.write_json_atomic
    calls = {"n": 0}

    def read_only_after_start(path, obj, indent=2):
        calls["n"] += 1
        if calls["n"] == 1:  # the manifest at the start
            return real(path, obj, indent)
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(launcher, "write_json_atomic", read_only_after_start)
    monkeypatch.setattr(rundir, "write_json_atomic", read_only_after_start)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["wrap", "--out", str(out), "--", sys.executable, "-c",
                                    "import sys; sys.exit(3)"])
    assert res.exit_code == 3, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    lines = [ln for ln in res.output.splitlines() if "could not" in ln]
    assert len(lines) == 1 and "Read-only file system" in lines[0]
    assert "exit code 3 is passed on unchanged" in lines[0]
    _no_traceback(res.output)
    assert calls["n"] >= 2
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("limit, job", [(1500, "torch"), (1500, "torch-sig9"), (0, "plain")])
def test_full_file_system_keeps_exit_code(tmp_path, limit, job):
    """RLIMIT_FSIZE: every write past `limit` bytes fails with EFBIG, in wrap and in the job
    (0: not even the manifest can be written, so the job runs without probes). wrap must exit
    as the same job does bare under the same limit."""
    import resource

    text = {"torch": TORCH_JOB, "torch-sig9": TORCH_JOB.replace("sys.exit(", "os.kill(os.getpid(), 9) or sys.exit("),
            "plain": "import sys; sys.exit(3)\n"}[job]
    script = write_script(tmp_path / "job.py", text)
    out = tmp_path / "run"

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    bare = subprocess.run([sys.executable, str(script)], env={**os.environ, "CODE": "3"},
                          preexec_fn=cap, capture_output=True, timeout=300)
    assert bare.returncode == (-9 if job == "torch-sig9" else 3), bare.stderr[-2000:]
    res = run_cli(["wrap", "--out", out, "--profile-steps", "1-2", "--", sys.executable, script],
                  env={"CODE": "3"}, preexec_fn=cap, timeout=300)
    assert res.returncode == bare.returncode, res.stderr[-3000:]
    _no_traceback(res.stderr)
    notes = [ln for ln in trainprof_lines(res.stderr) if "passed on unchanged" in ln]
    assert len(notes) == 1, res.stderr[-3000:]
    assert "File too large" in notes[0]
    if limit == 0:
        assert "ran without probes" in notes[0]
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("end, expected", [("sys.exit(5)", 5), ("os.kill(os.getpid(), 9)", -9)])
def test_closed_stdout_keeps_exit_status(tmp_path, end, expected):
    """wrap's stdout is a pipe nobody reads any more (`trainprof wrap ... | head -0`): the
    analysis, on stderr, is still printed."""
    proc = subprocess.Popen(TRAINPROF + ["wrap", "--out", str(tmp_path / "run"), "--", sys.executable,
                                         "-c", f"import os, sys, time; time.sleep(0.5); {end}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == expected, err
    _no_traceback(err)
    assert "summary: " in err and not [ln for ln in trainprof_lines(err) if "passed on unchanged" in ln]


@pytest.mark.parametrize("end, expected", [("sys.exit(5)", 5), ("os.kill(os.getpid(), 9)", -9)])
def test_closed_stderr_keeps_exit_status_and_stdout(tmp_path, end, expected):
    """wrap's stderr, where it prints the analysis, is a closed pipe: the job's status and its
    stdout are what they would be without trainprof."""
    proc = subprocess.Popen(TRAINPROF + ["wrap", "--out", str(tmp_path / "run"), "--", sys.executable,
                                         "-c", "import os, sys, time; print('job-out', flush=True); "
                                               f"time.sleep(0.5); {end}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stderr.close()
    out = proc.stdout.read()
    assert proc.wait(timeout=120) == expected, out
    assert out == "job-out\n"
    assert (tmp_path / "run" / "summary.json").is_file()  # analyzed all the same


def _unshare_works(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    mnt = tmp_path / "probe-mnt"
    mnt.mkdir()
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


NS_SCRIPT = r"""
set -u
mount -t tmpfs -o size={size} tmpfs "$MNT"
cd "$WORK"
rm -f "$FLAG"
"$PY" -m trainprof wrap --out "$MNT/run" --profile-steps 1-2 -- "$PY" job.py 2>err.txt &
pid=$!
if [ "$MODE" = ro ]; then
  while [ ! -e "$FLAG" ]; do sleep 0.05; done
  mount --bind "$MNT/run" "$MNT/run" && mount -o remount,bind,ro "$MNT/run" && echo made-read-only
fi
wait $pid; echo "rc=$?"
echo "leftovers: $(find "$MNT" -name '*.tmp' -o -name '.report.html.*' | wc -l)"
"""


@pytest.mark.parametrize("mode", ["full", "ro"])
def test_tmpfs_full_or_made_read_only_keeps_exit_code(tmp_path, mode):
    """A real 24 KB tmpfs (full), or the run directory bind-mounted read-only mid-run, in a
    private mount namespace (skipped where unprivileged namespaces are not allowed)."""
    if not _unshare_works(tmp_path):
        pytest.skip("no unprivileged mount namespace here (unshare -rm)")
    write_script(tmp_path / "job.py", TORCH_JOB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, "MNT": str(mnt), "WORK": str(tmp_path), "FLAG": str(tmp_path / "flag"),
           "PY": sys.executable, "MODE": mode, "CODE": "3", "STEPS": "20" if mode == "ro" else "6",
           "SLEEP": "0.1" if mode == "ro" else "0"}
    res = subprocess.run(["unshare", "-rm", "bash", "-c",
                          NS_SCRIPT.replace("{size}", "24k" if mode == "full" else "20m")],
                         env=env, capture_output=True, text=True, timeout=300)
    err = (tmp_path / "err.txt").read_text()
    assert "rc=3" in res.stdout, res.stdout + res.stderr + err[-3000:]
    assert "leftovers: 0" in res.stdout
    if mode == "ro":
        assert "made-read-only" in res.stdout
    _no_traceback(err)
    notes = [ln for ln in trainprof_lines(err) if "passed on unchanged" in ln]
    assert len(notes) == 1, err
    assert ("No space left" if mode == "full" else "Read-only file system") in notes[0]


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("name, value, expect", [
    ("TRAINPROF_FLUSH_S", "abc", "a number of seconds > 0"),
    ("TRAINPROF_HEARTBEAT_S", "abc", "a number of seconds > 0"),
    ("TRAINPROF_HEARTBEAT_S", "0", "a number of seconds > 0"),
    ("TRAINPROF_HANG_POLL_S", "nan", "a number of seconds > 0"),
    ("TRAINPROF_NAN_KEEP_MB", "abc", "a number >= 0"),
    ("TRAINPROF_NAN_MODULES", "bogus", "one of replay, leaf, all, off"),
    ("TRAINPROF_DISABLE", "maybe", "1/0"),
    ("TRAINPROF_TELEMETRY", "2", "1/0"),
    ("TRAINPROF_MEMORY_HISTORY_ENTRIES", "1e5", "a whole number > 0"),
    ("TRAINPROF_PROBES_OFF", "heartbeat,bogus", "probe names"),
    ("TRAINPROF_NAN_MODE", "leaf", "not a trainprof setting"),
])
def test_bad_setting_is_refused_before_the_job_starts(tmp_path, name, value, expect):
    flag = tmp_path / "started"
    out = tmp_path / "run"
    m = run_measured(["wrap", "--out", out, "--", sys.executable, "-c", f"open({str(flag)!r}, 'w')"],
                     tmp_path, env={name: value})
    assert m["rc"] == 2, m["err"]
    (line,) = [ln for ln in m["err"].splitlines() if ln.strip()]
    assert name in line and expect in line
    assert not flag.exists() and not out.exists()
    assert m["s"] < 60 and m["rss_mb"] < 400


def test_settings_reach_the_job_in_canonical_form(tmp_path):
    code = ("import os; print({k: v for k, v in sorted(os.environ.items()) "
            "if k.startswith('TRAINPROF_') and k not in ('TRAINPROF_RUN_DIR', 'TRAINPROF_NODE')})")
    res = run_cli(["wrap", "--out", tmp_path / "run", "--no-analyze", "--profile-steps", "none",
                   "--", sys.executable, "-c", code],
                  env={"TRAINPROF_NAN_SYNC": "true", "TRAINPROF_TELEMETRY": "Off",
                       "TRAINPROF_DISABLE": "no", "TRAINPROF_NAN_MODULES": "LEAF",
                       "TRAINPROF_FLUSH_S": " 0.5 "})
    assert res.returncode == 0, res.stderr
    seen = eval(res.stdout.strip().splitlines()[-1])  # noqa: S307 - our own dict literal
    assert seen == {"TRAINPROF_FLUSH_S": "0.5", "TRAINPROF_NAN_MODULES": "leaf",
                    "TRAINPROF_NAN_SYNC": "1", "TRAINPROF_PROFILE_STEPS": "none",
                    "TRAINPROF_TELEMETRY": "0"}


def test_disable_0_captures_and_disable_1_never_reads_as_nothing_wrong(tmp_path):
    script = write_script(tmp_path / "job.py", TORCH_JOB)
    on, off = tmp_path / "on", tmp_path / "off"
    res = run_cli(["wrap", "--out", on, "--profile-steps", "none", "--no-analyze", "--",
                   sys.executable, script], env={"TRAINPROF_DISABLE": "0", "CODE": "0"})
    assert res.returncode == 0, res.stderr
    steps = (on / "ranks/rank-00000/steps.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in steps] == list(range(6))
    res = run_cli(["wrap", "--out", off, "--profile-steps", "none", "--", sys.executable, script],
                  env={"TRAINPROF_DISABLE": "1", "CODE": "0"})
    assert res.returncode == 0, res.stderr  # the job's exit code, whatever the analysis says
    assert not (off / "ranks").exists()
    assert "nothing looks wrong" not in res.stderr and "nothing analyzed" in res.stderr
    assert "probes were disabled" in res.stderr and res.stdout == ""  # stdout is the job's
    res = run_cli(["analyze", off])
    assert res.returncode == 3 and "nothing looks wrong" not in res.stdout
    assert "nothing analyzed: the probes were disabled" in res.stderr
    summary = json.loads((off / "summary.json").read_text())
    assert "disabled" in summary["nothing_analyzed"] and "disabled" in summary["problems"][0]
    # a job that never started its probes (no torch at all): also not "nothing looks wrong"
    res = run_cli(["wrap", "--out", tmp_path / "bare", "--", sys.executable, "-c", "pass"])
    assert res.returncode == 0 and "no rank captured any data" in res.stderr
    assert run_cli(["analyze", tmp_path / "bare"]).returncode == 3


# --------------------------------------------------------------------------- a SIGKILLed rank


KILL_JOB = """
import os, signal, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(40):
    if rank == 1 and step == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = m(torch.randn(2, 8)).sum(); loss.backward()
    for p in m.parameters(): dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
    time.sleep(0.2)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_sigkilled_rank_is_named_first_failure(tmp_path):
    script = write_script(tmp_path / "job.py", KILL_JOB)
    out = tmp_path / "run"
    t0 = time.monotonic()
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--", sys.executable, "-m",
                   "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
                  env={"TRAINPROF_HEARTBEAT_S": "0.1"}, timeout=300)
    print(f"wall {time.monotonic() - t0:.1f} s")
    assert res.returncode == 1, res.stderr[-3000:]  # torchrun's own exit code, passed on
    assert re.search(r"trainprof: first failure: rank 1 \(pid \d+ on .*\) killed by SIGKILL",
                     res.stderr), res.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    (first,) = [f for f in man["first_failures"] if f["rank"] == 1]
    assert first["signal"] == signal.SIGKILL and first["exitcode"] == -9
    summary = json.loads((out / "summary.json").read_text())
    (f,) = [f for f in summary["findings"] if f["kind"] == "rank_failure"]  # a crash, not a hang
    c = f["evidence"]["culprit"]
    assert f["ranks"] == [1] and c["reason"] == "died" and c["signal_name"] == "SIGKILL"
    assert c["last_step_done"] == 5 and c["step"] == 6
    assert c["last_collective"]["op"] == "all_reduce" and c["last_collective"]["step"] == 5
    assert "rank 1 was the first to fail: killed by SIGKILL (signal 9) in step 6" in f["message"]
    states = {r["rank"]: r["state"] for r in summary["metrics"]["hang"]["ranks"]}
    assert states[1] == "died" and (states[0] == "ended_by_launcher" or c["also_failed"] == [0])
    res = run_cli(["hang", out])
    assert res.returncode == 0 and "rank 1 was the first to fail" in " ".join(res.stdout.split())


SEEDED_JOB = """
import os, random
import numpy as np
import torch
import torch.distributed as dist

random.seed(0); np.random.seed(0); torch.manual_seed(0)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
model = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    print(step, f"{loss.item():.6f}", flush=True)
print("torch", torch.randn(4).tolist(), "python", random.random(), "numpy", np.random.rand())
dist.destroy_process_group()
"""


def test_a_seeded_job_draws_the_same_numbers_under_wrap(tmp_path):
    """The probes (the peak calibration included: it runs on CPU in step 0) never draw from the
    job's random streams: a seeded job prints the same losses and draws under wrap."""
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    script = write_script(tmp_path / "job.py", SEEDED_JOB)
    env = {"PORT": str(free_port())}
    bare = subprocess.run([sys.executable, str(script)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0, bare.stderr
    env["PORT"] = str(free_port())
    res = run_cli(["wrap", "--out", tmp_path / "run", "--no-analyze", "--", sys.executable, script],
                  env=env)
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "run/ranks/rank-00000/meta.json").read_text())
    assert "calibration" in meta  # the calibration ran in this job
    assert res.stdout == bare.stdout and "torch" in bare.stdout


COMPILED_JOB = """
import torch
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()), backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    loss = model(torch.randn(4, 16)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
print("done", flush=True)
"""


def test_a_compiled_module_gets_no_warning_about_trainprofs_hooks(tmp_path):
    """torch.compile(module) warns when global module hooks exist; the NaN watch's are trainprof's,
    so the job's stderr does not carry that warning under wrap."""
    script = write_script(tmp_path / "job.py", COMPILED_JOB)
    bare = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert bare.returncode == 0 and "global hooks" not in bare.stderr, bare.stderr
    res = run_cli(["wrap", "--out", tmp_path / "run", "--no-analyze", "--profile-steps", "none", "--",
                   sys.executable, script], timeout=300)
    assert res.returncode == 0 and res.stdout == bare.stdout, res.stderr
    assert "global hooks" not in res.stderr, res.stderr
    steps = (tmp_path / "run/ranks/rank-00000/steps.jsonl").read_text().splitlines()
    assert len(steps) == 4  # the probes ran
