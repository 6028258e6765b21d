"""The job's own profilers, hooks, anomaly mode and memory history beside trainprof's, in one
process."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import write_script
from job_profiler_shared import _line
from trainprof.analysis.run import RunDir


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

    # the time each job profiler ran and exported is in meta.json overhead_spans, and step
    # statistics leave out the steps it overlaps
    from trainprof.analyzers import step_time

    def spans(name):
        return [(x["kind"], x["start_ns"], x["end_ns"])
                for x in RunDir(tmp_path / name).rank_meta(0)["overhead_spans"]]

    def steps_of(name):
        return {r["step"]: (r["start_ns"], r["end_ns"]) for r in RunDir(tmp_path / name).stream(0, "steps")}

    for name in ("before", "legacy-mid"):
        (k1, a1, b1), (k2, a2, b2) = spans(name)
        assert (k1, k2) == ("job_profiler", "job_trace_export") and a1 <= b1 <= a2 <= b2
    # 1: on before the session: from the session's start (the guard's install) to its exit
    st = steps_of("before")
    assert spans("before")[0][1] <= st[0][0] and st[5][1] <= spans("before")[0][2]
    # 2: entered in step 3 (after step 2's boundary), exited and exported in step 5
    st = steps_of("legacy-mid")
    (_, a1, b1), (_, a2, b2) = spans("legacy-mid")
    assert st[2][1] <= a1 <= st[3][1] and st[4][1] <= b1 <= b2 <= st[5][1]
    m = step_time.analyze(RunDir(tmp_path / "legacy-mid")).metrics
    assert m["excluded_steps"]["job_profiler"] == [3, 4, 5]
    # 3: started in step 0, stopped in step 2 (after step 1's boundary), no export
    ((k, a, b),) = spans("start-stop")
    st = steps_of("start-stop")
    assert k == "job_profiler" and st[0][0] <= a <= st[0][1] and st[1][1] <= b <= st[2][1]
    m = step_time.analyze(RunDir(tmp_path / "start-stop")).metrics
    assert m["excluded_steps"]["job_profiler"] == [0, 1, 2]

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
