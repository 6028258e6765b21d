"""A job that runs its own profiler (or allocator history, global hooks, anomaly mode) under
trainprof: the job's tools work as without trainprof, trainprof's profiler window steps aside,
and the analysis uses the job's traces and says so."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli, write_script
from trainprof.analysis.run import RunDir

DDP_JOB = """
import gc, sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(mode, trace_dir):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step():
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    CPU = torch.profiler.ProfilerActivity.CPU
    if mode == "schedule":  # as the torch.profiler docs show
        with torch.profiler.profile(
                activities=[CPU],
                schedule=torch.profiler.schedule(wait=1, warmup=1, active=2),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir)) as prof:
            for step in range(8):
                train_step()
                prof.step()
    elif mode == "cutoff":  # 7 steps of a 5-step cycle; rank 1 spends 40 ms a step off torch
        slow = dist.get_rank() == 1
        with torch.profiler.profile(
                activities=[CPU],
                schedule=torch.profiler.schedule(wait=1, warmup=1, active=3),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir)) as prof:
            for step in range(7):
                if slow:
                    time.sleep(0.04)
                train_step()
                prof.step()
    else:  # "mid": started at step 4, while trainprof's default window (3-4) records
        prof = torch.profiler.profile(activities=[CPU],
                                      on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir))
        for step in range(7):
            if step == 4:
                prof.start()
            train_step()
            if step == 5:
                prof.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # DDP's reference cycles keep the gloo group alive until the interpreter's final collection,
    # where its worker threads (profiled, so holding Python state) can abort the process; torch
    # does that without trainprof too (about 1 run in 8 of the "mid" job): collect before exit
    gc.collect()
"""


def _wrap_ddp(tmp_path, mode, *wrap_args, env=None):
    script = write_script(tmp_path / "job.py", DDP_JOB)
    out, traces = tmp_path / "run", tmp_path / "job-traces"
    res = run_cli(["wrap", "--out", out, *wrap_args, "--", sys.executable, "-m",
                   "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, mode,
                   traces], timeout=300, env=env)
    return res, out, traces


def _job_traces(traces: Path) -> dict[int, list[Path]]:
    """The job's trace files by the rank in their distributedInfo."""
    out: dict[int, list[Path]] = {}
    for p in sorted(traces.iterdir()):
        out.setdefault(json.loads(p.read_text())["distributedInfo"]["rank"], []).append(p)
    return out


def _line(text: str, code: str) -> int:
    """The line number of the first line of ``text`` that starts with ``code`` (indent aside)."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(code))


def _profiler_steps(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})


@pytest.mark.multiproc
def test_ddp_job_with_its_own_scheduled_profiler(tmp_path):
    res, out, traces = _wrap_ddp(tmp_path, "schedule")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "already enabled" not in res.stderr and "step probe error" not in res.stderr
    # the job's traces, as without trainprof: 8 steps of a wait 1 + warmup 1 + active 2 cycle
    # make two traces per rank, the first of ProfilerStep#2-#3, the second of #6-#7
    by_rank = _job_traces(traces)
    assert sorted(by_rank) == [0, 1]
    for files in by_rank.values():
        assert [_profiler_steps(p) for p in files] == [["ProfilerStep#2", "ProfilerStep#3"],
                                                      ["ProfilerStep#6", "ProfilerStep#7"]]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["exit_code"] == 0
    assert (f"job runs its own profiler: trainprof's window skipped; its traces are at {traces} "
            f"(ranks 0, 1)") in summary["problems"]
    run = RunDir(out)
    for r in (0, 1):
        meta = run.rank_meta(r)
        jp = meta["job_profiler"]
        assert jp["window_skipped"] is True and "profile_steps" not in meta
        assert jp["api"].startswith("torch.profiler")
        assert jp["where"] == f"{tmp_path / 'job.py'}:{_line(DDP_JOB, 'prof.step()')}"
        assert jp["traces"] == [str(p) for p in by_rank[r]]
        # the job's last trace stands in for trainprof's (a hard link: the job's file stays)
        used = run.profiler_traces()[r]
        assert used.parent == out / "profiler" and os.path.samefile(used, by_rank[r][-1])
        assert not any(rec.get("profiled") for rec in run.stream(r, "steps"))
    assert not list((out / "profiler").glob("*.gz"))  # trainprof wrote no trace of its own
    cc = summary["metrics"]["comm_compute"]
    assert sorted(p["rank"] for p in cc["per_rank"]) == [0, 1]
    assert {s["step"] for s in cc["per_step"]} == {6, 7}  # ProfilerStep numbers of the job's trace

    # without the links (on another file system than the job's traces) the analysis follows
    # meta.json's paths
    shutil.rmtree(out / "profiler")
    assert all(p.exists() for files in by_rank.values() for p in files)
    assert RunDir(out).profiler_traces() == {r: by_rank[r][-1] for r in (0, 1)}


@pytest.mark.multiproc
def test_ddp_job_whose_profiler_ends_with_a_cut_off_window(tmp_path, monkeypatch):
    """7 steps of a wait 1 + warmup 1 + active 3 schedule: torch writes a full window (steps
    2-4) and, when the profiler exits, a cut-off one (a stub ProfilerStep#7, the one linked into
    RUN/profiler/). The full window is analyzed, the straggler found, the stub named."""
    res, out, traces = _wrap_ddp(tmp_path, "cutoff", env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    by_rank = _job_traces(traces)
    assert sorted(by_rank) == [0, 1]
    for files in by_rank.values():
        assert [_profiler_steps(p) for p in files] == [
            ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"], ["ProfilerStep#7"]]
    summary = json.loads((out / "summary.json").read_text())
    for r, (full, stub) in by_rank.items():
        assert (f"rank {r}: 2 profiler windows; the one holding the most training is analyzed: "
                f"{full.name} (3 step(s) with ops); left out: {stub.name} (no step with an op "
                f"in it, later)") in summary["problems"]
        # every window is linked into the run directory (the last also under the rank's name)
        assert os.path.samefile(out / "profiler" / f"rank-{r:05d}.pt.trace.json", stub)
        linked = out / "profiler" / "job" / f"rank-{r:05d}"
        assert sorted(p.name for p in linked.iterdir()) == sorted([full.name, stub.name])
        assert all(os.path.samefile(linked / p.name, p) for p in (full, stub))
        assert RunDir(out).rank_meta(r)["job_profiler"]["links"] == {
            str(p): f"job/rank-{r:05d}/{p.name}" for p in (full, stub)}
        # the digest (cached at the end of wrap) is of the full window, read from its link
        doc = json.loads((out / "digests" / f"rank-{r:05d}.json").read_text())
        assert doc["trace"]["path"] == f"profiler/job/rank-{r:05d}/{full.name}"
        assert doc["facts"]["steps"] == 3
    assert not any("did not cover training steps" in p for p in summary["problems"])
    assert {s["step"] for s in summary["metrics"]["comm_compute"]["per_step"]} == {2, 3, 4}
    stragglers = [f for f in summary["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[1]], summary["findings"]
    # analyzed again: the same choice, from what the digests kept (no trace parsed to choose)
    from trainprof.analysis import digest

    jobs: list = []
    real = digest.run_jobs
    monkeypatch.setattr(digest, "run_jobs", lambda js, *a, **k: (jobs.extend(js), real(js, *a, **k))[1])
    run = RunDir(out)
    full_links = {r: out / "profiler" / "job" / f"rank-{r:05d}" / files[0].name
                  for r, files in by_rank.items()}
    assert run.profiler_traces() == full_links
    assert {r: len(w) for r, w in run.job_windows().items()} == {0: 2, 1: 2}
    assert run.digest_docs() and jobs == []

    # the run directory is self-contained: copied elsewhere, the job's folder gone, the copy
    # chooses the same windows (from the digests it holds: nothing parsed) and analyzes them
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    # a later --force removes the links (the job's files stay) and nothing of the user's
    from trainprof.launch import outdir

    (out / "profiler" / "job" / "notes.md").write_text("the user's")
    plan = outdir.plan_force(out, json.loads((out / "manifest.json").read_text()))
    for r, files in by_rank.items():
        for p in files:
            assert f"profiler/job/rank-{r:05d}/{p.name}" in plan.remove
    assert plan.keep == ["profiler/job/notes.md"]
    assert outdir.execute(plan) == []
    assert sorted(p.name for p in out.rglob("*")) == ["job", "notes.md", "profiler"]
    assert all(_profiler_steps(p) for files in by_rank.values() for p in files)
    shutil.rmtree(traces)
    copied = RunDir(copy)
    assert copied.profiler_traces() == {r: copy / p.relative_to(out) for r, p in full_links.items()}
    assert copied.digest_docs() and jobs == []
    res = run_cli(["analyze", copy])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((copy / "summary.json").read_text())
    for r, (full, stub) in by_rank.items():
        assert (f"rank {r}: 2 profiler windows; the one holding the most training is analyzed: "
                f"{full.name} (3 step(s) with ops); left out: {stub.name} (no step with an op "
                f"in it, later)") in summary["problems"]
    assert not any("did not cover training steps" in p for p in summary["problems"])
    assert {s["step"] for s in summary["metrics"]["comm_compute"]["per_step"]} == {2, 3, 4}


def test_linking_the_jobs_traces_skips_what_cannot_be_linked(tmp_path, monkeypatch):
    """At exit every recorded trace of the job is hard-linked into RUN/profiler/job/rank-NNNNN/;
    one that cannot be (another file system, gone, not *.json[.gz], a name already taken by
    another file) is left out of meta's ``links``, and nothing is raised into the job."""
    import errno
    import threading
    from types import SimpleNamespace

    from trainprof.probes import session as sess

    job = tmp_path / "tb"
    job.mkdir()
    names = ["a.pt.trace.json", "other-fs.pt.trace.json", "gone.pt.trace.json", "notes.txt",
             "last.pt.trace.json"]
    for n in names:
        (job / n).write_text("{}")
    (job / "gone.pt.trace.json").unlink()
    run = tmp_path / "run"
    real = os.link

    def link(src, dst, *a, **k):
        if Path(src).name == "other-fs.pt.trace.json":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(sess.os, "link", link)
    traces = [str(job / n) for n in names]
    s = SimpleNamespace(meta={"job_profiler": {"traces": traces}}, run_dir=run, rank=3,
                        _meta_lock=threading.Lock())
    s._link_job_traces = lambda t: sess.ProbeSession._link_job_traces(s, t)
    sess.ProbeSession._link_job_trace(s)
    jp = s.meta["job_profiler"]
    assert jp["linked"] == "rank-00003.pt.trace.json"
    assert jp["links"] == {str(job / n): f"job/rank-00003/{n}"
                           for n in ("a.pt.trace.json", "last.pt.trace.json")}
    linked = run / "profiler" / "job" / "rank-00003"
    assert sorted(p.name for p in linked.iterdir()) == ["a.pt.trace.json", "last.pt.trace.json"]
    assert sorted(p.name for p in job.iterdir()) == sorted(set(names) - {"gone.pt.trace.json"})
    # a second exit of the rank (its links there already) links nothing twice, raises nothing;
    # a name another file holds is left alone
    (run / "profiler" / "rank-00003.pt.trace.json").unlink()
    (linked / "a.pt.trace.json").unlink()
    (linked / "a.pt.trace.json").write_text("not the job's")
    s.meta = {"job_profiler": {"traces": traces}}
    sess.ProbeSession._link_job_trace(s)
    assert s.meta["job_profiler"]["links"] == {str(job / "last.pt.trace.json"):
                                               "job/rank-00003/last.pt.trace.json"}
    assert (linked / "a.pt.trace.json").read_text() == "not the job's"
    # nothing linkable: no folder left behind
    s.meta, s.rank = {"job_profiler": {"traces": [str(job / "other-fs.pt.trace.json")]}}, 4
    sess.ProbeSession._link_job_trace(s)
    assert "links" not in s.meta["job_profiler"] and not (run / "profiler" / "job" / "rank-00004").exists()


@pytest.mark.multiproc
def test_ddp_job_starting_its_profiler_inside_trainprofs_window(tmp_path):
    res, out, traces = _wrap_ddp(tmp_path, "mid", "--no-analyze")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "already enabled" not in res.stderr and "step probe error" not in res.stderr
    by_rank = _job_traces(traces)
    assert sorted(by_rank) == [0, 1]
    for files in by_rank.values():  # started before step 4, stopped after step 5: one trace
        events = json.loads(files[0].read_text())["traceEvents"]
        assert len(files) == 1 and sum(e.get("name") == "Optimizer.step#SGD.step" for e in events) == 2
    run = RunDir(out)
    for r in (0, 1):
        jp = run.rank_meta(r)["job_profiler"]
        assert jp["window_skipped"] is True and jp["step"] == 4
        # trainprof's window was recording step 3 when the job's profiler came; it was discarded
        profiled = [rec["step"] for rec in run.stream(r, "steps") if rec.get("profiled")]
        assert profiled == [3]
        assert os.path.samefile(run.profiler_traces()[r], by_rank[r][0])
    assert not list((out / "profiler").glob("*.gz"))
    assert run.problems == [f"job runs its own profiler: trainprof's window skipped; its traces are "
                            f"at {traces} (ranks 0, 1)"]


WARMUP_FIRST_JOB = """
import sys, torch

model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
P = torch.profiler
with P.profile(activities=[P.ProfilerActivity.CPU], schedule=P.schedule(wait=0, warmup=3, active=1),
               on_trace_ready=P.tensorboard_trace_handler(sys.argv[1])) as prof:
    for step in range(6):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        prof.step()
"""


def test_job_profiler_in_warmup_before_the_probes_activate(tmp_path):
    """A single-process job's probes activate at its first optimizer step, inside the job's
    profiler, which is already prepared (warm-up) though not yet on: torch has no flag for that,
    so the start is caught when torch is imported. Without that, trainprof's window 1-2 would
    run inside the job's warm-up and the job's own trace would silently not be written."""
    script = write_script(tmp_path / "job.py", WARMUP_FIRST_JOB)
    out, traces = tmp_path / "run", tmp_path / "job-traces"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "1-2", "--no-analyze", "--",
                   sys.executable, script, traces], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (trace,) = traces.iterdir()  # warm-up over steps 0-2, recorded step 3
    assert _profiler_steps(trace) == ["ProfilerStep#3"]
    run = RunDir(out)
    jp = run.rank_meta(0)["job_profiler"]
    assert jp["before_probes"] is True and jp["window_skipped"] is True
    assert jp["api"] == "torch.profiler.profiler.profile.__enter__"
    assert jp["where"] == f"{script}:{_line(WARMUP_FIRST_JOB, 'with P.profile(')}"
    assert jp["traces"] == [str(trace)] and os.path.samefile(run.profiler_traces()[0], trace)


IN_PROCESS_JOBS = """
import json, sys, torch, trainprof
from pathlib import Path
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

root = Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step():
    with torch.autograd.profiler.record_function("job_region"):
        loss = model(torch.randn(16, 32)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


# 1. a legacy autograd profiler enabled before trainprof exists, exported gzip-named
p = torch.autograd.profiler.profile()
p.__enter__()
with trainprof.session(root / "before", profile_steps="2-3"):
    for step in range(6):
        train_step()
    p.__exit__(None, None, None)
    p.export_chrome_trace(str(root / "before.pt.trace.json.gz"))

# 2. torch.autograd.profiler.profile entered at step 3, while trainprof's window 2-3 records
with trainprof.session(root / "legacy-mid", profile_steps="2-3"):
    for step in range(6):
        if step == 3:
            q = torch.autograd.profiler.profile()
            q.__enter__()
        train_step()
        if step == 4:
            q.__exit__(None, None, None)
            q.export_chrome_trace(str(root / "legacy-mid.json"))

# 3. prof.start()/stop() over steps 0-1, before trainprof's window 3-4: the window still steps
#    aside (never both), and a job that exports nothing leaves no trace to analyze
with trainprof.session(root / "start-stop", profile_steps="3-4"):
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    for step in range(6):
        if step == 0:
            prof.start()
        train_step()
        if step == 1:
            prof.stop()
    n_events = len(prof.events())

# 4. record_function, global hooks and anomaly mode but no profiler: trainprof's window runs,
#    the job's hooks all fire and its anomaly mode stays as it set it
calls = {"fwd": 0, "pre": 0, "post": 0}
def fwd_hook(m, i, o): calls["fwd"] += 1
def pre_hook(o, a, k): calls["pre"] += 1
def post_hook(o, a, k): calls["post"] += 1
h = [torch.nn.modules.module.register_module_forward_hook(fwd_hook),
     register_optimizer_step_pre_hook(pre_hook),
     register_optimizer_step_post_hook(post_hook)]
torch.autograd.set_detect_anomaly(True)
with trainprof.session(root / "plain", profile_steps="1-2"):
    for step in range(5):
        train_step()
    anomaly_inside = torch.is_anomaly_enabled()
    calls_inside = dict(calls)
train_step()  # after trainprof closed (and removed its own hooks): the job's still fire
json.dump({"n_events": n_events, "calls_inside": calls_inside, "calls": calls,
           "anomaly_inside": anomaly_inside,
           "anomaly_after": torch.is_anomaly_enabled()}, open(root / "result.json", "w"))
"""


def test_in_process_job_profilers_hooks_and_anomaly_mode(tmp_path):
    script = write_script(tmp_path / "jobs.py", IN_PROCESS_JOBS)
    res = subprocess.run([sys.executable, script, tmp_path], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "already enabled" not in res.stderr and "step probe error" not in res.stderr
    result = json.loads((tmp_path / "result.json").read_text())

    # 1: detected as already on when the window was due; its gzip-named plain-JSON export linked
    run = RunDir(tmp_path / "before")
    jp = run.rank_meta(0)["job_profiler"]
    assert jp["window_skipped"] is True and jp["api"] is None and jp["step"] == 1
    assert jp["traces"] == [str(tmp_path / "before.pt.trace.json.gz")]
    used = run.profiler_traces()[0]
    assert used.name == "rank-00000.pt.trace.json"  # named by content: the export is not gzip
    assert os.path.samefile(used, tmp_path / "before.pt.trace.json.gz")
    assert "job_region" in {e["name"] for e in json.loads(used.read_text())["traceEvents"]}

    # 2: trainprof's window was recording (step 2 profiled) and was discarded at step 3
    run = RunDir(tmp_path / "legacy-mid")
    jp = run.rank_meta(0)["job_profiler"]
    assert jp["window_skipped"] is True and jp["step"] == 3
    assert jp["api"].startswith("torch.autograd.profiler.profile")
    assert jp["where"] == f"{script}:{_line(IN_PROCESS_JOBS, 'q.__enter__()')}"
    assert [r["step"] for r in run.stream(0, "steps") if r.get("profiled")] == [2]
    assert os.path.samefile(run.profiler_traces()[0], tmp_path / "legacy-mid.json")
    assert not list((tmp_path / "legacy-mid" / "profiler").glob("*.gz"))

    # 3: the job's profiler collected (it kept working) but exported nothing: said, loud
    assert result["n_events"] > 0
    run = RunDir(tmp_path / "start-stop")
    jp = run.rank_meta(0)["job_profiler"]
    assert jp["window_skipped"] is True and jp["step"] == 0 and jp["traces"] == []
    assert run.profiler_traces() == {}
    assert run.problems == ["job runs its own profiler: trainprof's window skipped; it exported "
                            "no trace: no profiler analysis (ranks 0)"]

    # 4: trainprof's own window, with the job's annotation in it; the job's hooks and mode intact
    run = RunDir(tmp_path / "plain")
    assert "job_profiler" not in run.rank_meta(0) and run.rank_meta(0)["profile_steps"] == [1, 2]
    trace = run.profiler_traces()[0]
    assert trace.name == "rank-00000.pt.trace.json.gz" and run.problems == []
    with gzip.open(trace) as f:
        assert "job_region" in {e["name"] for e in json.load(f)["traceEvents"]}
    # 2 Linear + ReLU + Sequential forward calls a step; one optimizer step a step
    assert result["calls_inside"] == {"fwd": 4 * 5, "pre": 5, "post": 5}
    assert result["calls"] == {"fwd": 4 * 6, "pre": 6, "post": 6}
    assert result["anomaly_inside"] is True and result["anomaly_after"] is True


class _FakeSession:
    def __init__(self, step):
        self.meta: dict = {}
        self.clock = type("Clock", (), {"step": step})()

    def update_meta(self, **fields):
        self.meta.update(fields)


@pytest.fixture
def history(monkeypatch):
    """The memory probe's allocator-history logic against a recording stand-in for
    torch.cuda.memory._record_memory_history (CPU-only machines have no CUDA allocator)."""
    import torch
    import torch.cuda.memory as tcm

    from trainprof.probes import memory, runtime

    calls: list = []
    snapshot = {"segments": [], "device_traces": []}
    monkeypatch.setattr(tcm, "_record_memory_history", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(tcm, "_snapshot", lambda *a, **k: snapshot)
    monkeypatch.delattr(torch._C, "_cuda_isHistoryEnabled", raising=False)  # (CUDA builds)
    monkeypatch.setattr(memory, "_history", {"ours": False, "job": False})
    session = _FakeSession(step=7)
    monkeypatch.setattr(runtime, "active", lambda: session)
    memory._watch_job_history()  # (monkeypatch restores the real function afterwards)
    return memory, tcm, calls, snapshot, session


def test_job_memory_history_started_while_trainprofs_records(history):
    memory, tcm, calls, _, session = history
    memory._start_history(session)
    assert calls == [((), {"max_entries": 100000})]
    session.clock.step = 9
    tcm._record_memory_history(max_entries=500, context="alloc")  # the job's own recording
    # trainprof's is switched off first (which drops its entries), then the job's call as made
    assert calls[1:] == [((None,), {}), ((), {"max_entries": 500, "context": "alloc"})]
    assert session.meta["job_memory_history"] == {"step": 9, "trainprof_history": "stopped"}
    tcm._record_memory_history(None)  # later calls of the job's pass straight through
    assert calls[3:] == [((None,), {})]


def test_job_memory_history_before_trainprofs_is_left_alone(history):
    memory, tcm, calls, snapshot, session = history
    tcm._record_memory_history(max_entries=10)  # after the watch, before trainprof would start
    memory._start_history(session)
    assert calls == [((), {"max_entries": 10})]
    assert session.meta["job_memory_history"]["trainprof_history"] == "not started"


def test_job_memory_history_on_before_the_watch_is_detected(history):
    memory, tcm, calls, snapshot, session = history
    snapshot["device_traces"] = [[{"action": "alloc", "size": 512}]]  # the job's recording
    memory._start_history(session)
    assert calls == [] and session.meta["job_memory_history"]["trainprof_history"] == "not started"


def test_job_memory_history_on_is_read_from_the_allocator_flag(history, monkeypatch):
    import torch

    memory, tcm, calls, snapshot, session = history
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: True, raising=False)
    memory._start_history(session)
    assert calls == [] and session.meta["job_memory_history"]["trainprof_history"] == "not started"
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: False, raising=False)
    monkeypatch.setattr(memory, "_history", {"ours": False, "job": False})
    snapshot["device_traces"] = [[{"action": "alloc", "size": 512}]]  # the flag wins
    memory._start_history(session)
    assert calls == [((), {"max_entries": 100000})]
