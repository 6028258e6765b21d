"""trainprof.session() and the probes' API in one process: optimizer hook, markers, inert without
probes, probes off, standing aside, off-thread writes, sys.exit pickling."""

from __future__ import annotations

import json
import subprocess
import sys

from trainprof.analysis.run import RunDir


def _claim(monkeypatch, run_dir, pid, rank, world, env):
    from trainprof.probes import rank_claim

    monkeypatch.setenv(rank_claim.ENV, json.dumps({"pid": pid, "run_dir": str(run_dir), "rank": rank,
                                                   "world": world, "env": env}))


def run_py(code: str, cwd) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res


def test_session_optimizer_hook_and_run_info(tmp_path):
    run_py("""
import torch, trainprof
m = torch.nn.Linear(8, 8); a = torch.optim.SGD(m.parameters(), lr=0.1)
b = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)   # a second optimizer per step
trainprof.set_run_info(tokens_per_step=128)
with trainprof.session("run", profile_steps="none"):
    for _ in range(5):
        m(torch.randn(2, 8)).sum().backward(); a.step(); b.step()
for _ in range(3):   # after the session: nothing is recorded any more
    a.step()
""", tmp_path)
    run = RunDir(tmp_path / "run")
    steps = run.steps()
    assert list(steps["step"]) == [0, 1, 2, 3, 4]  # one per training step, not per optimizer
    assert set(steps["source"]) == {"optimizer"}
    meta = run.rank_meta(0)
    assert meta["run_info"] == {"tokens_per_step": 128} and meta["activated_by"] == "session"
    assert meta["steps_recorded"] == 5 and "ended_ns" in meta
    assert not (tmp_path / "run" / "profiler").exists()


def test_explicit_marker_wins_over_optimizer_hook(tmp_path):
    run_py("""
import torch, trainprof
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with trainprof.session("run", profile_steps="none"):
    for step in range(4):
        for micro in range(3):               # gradient accumulation: 3 optimizer calls per step
            m(torch.randn(2, 8)).sum().backward(); opt.step()
        trainprof.step()
""", tmp_path)
    steps = RunDir(tmp_path / "run").steps()
    # the 3 optimizer steps before the first marker count; from the first marker on, only markers
    assert list(steps["source"]) == ["optimizer"] * 3 + ["marker"] * 4


def test_api_is_inert_without_probes(tmp_path):
    res = run_py("""
import trainprof, sys
trainprof.step(); trainprof.set_run_info(x=1)
print('torch' in sys.modules)
""", tmp_path)
    assert res.stdout.strip() == "False"  # no torch import, no files
    assert list(tmp_path.iterdir()) == []


def test_probes_off_leaves_named_probes_out_and_says_so(tmp_path):
    code = """
import torch, trainprof
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with trainprof.session("{d}", profile_steps="none"):
    for _ in range(3):
        m(torch.randn(2, 8)).sum().backward(); opt.step()
"""
    run_py(code.format(d="on"), tmp_path)
    env = {**__import__("os").environ, "TRAINPROF_PROBES_OFF": "nan_watch, heartbeat,bogus"}
    res = subprocess.run([sys.executable, "-c", code.format(d="off")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "no probe named bogus" in res.stderr
    on, off = RunDir(tmp_path / "on"), RunDir(tmp_path / "off")
    assert on.stream(0, "nan") and on.stream(0, "heartbeat")  # the control: both probes write
    assert not off.stream(0, "nan") and not off.stream(0, "heartbeat")
    assert list(off.steps()["step"]) == [0, 1, 2]              # the others still run
    assert off.rank_meta(0)["probes_off"] == ["heartbeat", "nan_watch"]
    from trainprof.analysis.runner import analyze
    summary = analyze(off)
    assert summary["run"]["probes_off"] == {"heartbeat": [0], "nan_watch": [0]}
    assert any("nan_watch was left out" in p for p in summary["problems"])
    assert "probes_off" not in analyze(on)["run"]


def test_process_that_stands_aside_starts_no_probes(tmp_path, monkeypatch):
    import os

    from trainprof.probes import rank_claim, runtime

    run = tmp_path / "run"
    monkeypatch.setenv(runtime.ENV_RUN_DIR, str(run))
    monkeypatch.delenv(runtime.ENV_DISABLE, raising=False)
    monkeypatch.setattr(runtime, "_aside", False)
    for k in rank_claim.ID_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0"); monkeypatch.setenv("WORLD_SIZE", "2")
    _claim(monkeypatch, run, os.getpid() + 1, 0, 2, {"RANK": "0", "WORLD_SIZE": "2"})
    assert runtime.activate("optimizer_step") is None
    assert not runtime.enabled() and runtime.active() is None
    assert not run.exists()  # nothing written, not even a rank directory


def test_step_records_are_written_off_the_jobs_thread(tmp_path):
    """Ticker.call_soon returns at once and runs the call on the probes' thread: a step boundary
    never waits on the disk (a stalled network file system)."""
    import threading

    from trainprof.probes.ticker import THREAD_NAME, Ticker

    release, ran = threading.Event(), []
    t = Ticker()
    t.start()
    try:
        def slow_flush():
            ran.append(threading.current_thread().name)
            release.wait(30)

        t.call_soon(slow_flush)          # returns while slow_flush still waits on `release`
        assert not release.is_set()
        release.set()
        for _ in range(300):
            if ran:
                break
            threading.Event().wait(0.01)
        assert ran == [THREAD_NAME]
    finally:
        t.stop()


def test_wrapped_sys_exit_still_pickles_as_sys_exit():
    """A spawned process's target may be sys.exit itself: it is pickled by reference (in a
    child process: the hooks stay out of the test session's own)."""
    import subprocess
    import sys

    code = ("import pickle, sys; from trainprof.probes import heartbeat_exit; "
            "heartbeat_exit.install(); "
            "assert getattr(sys.exit, '__trainprof_previous__', None) is not None; "
            "assert pickle.loads(pickle.dumps(sys.exit)) is sys.exit; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_rank_claim_decides_who_is_a_rank(tmp_path, monkeypatch):
    import os

    from trainprof.probes import rank_claim

    for k in rank_claim.ID_KEYS:
        monkeypatch.delenv(k, raising=False)
    run = tmp_path / "run"
    monkeypatch.setenv("RANK", "0"); monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    torchrun_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    assert not rank_claim.stands_aside(run)                       # no claim: the first process
    _claim(monkeypatch, run, os.getpid(), 0, 2, torchrun_env)
    assert not rank_claim.stands_aside(run)                       # its own claim
    _claim(monkeypatch, run, 1, 0, 2, torchrun_env)
    assert rank_claim.stands_aside(run)                           # a rank's child, same variables
    assert not rank_claim.stands_aside(tmp_path / "other")        # a run of its own (nested wrap)
    monkeypatch.setenv("LOCAL_RANK", "1")                         # Lightning's child for rank 1
    _claim(monkeypatch, run, 1, 0, 2, {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "0"})
    monkeypatch.setenv("NODE_RANK", "0")
    assert not rank_claim.stands_aside(run)
    for k in rank_claim.ID_KEYS:                                  # `python train.py`, no variables
        monkeypatch.delenv(k, raising=False)
    _claim(monkeypatch, run, 1, 0, 1, {})
    assert rank_claim.stands_aside(run)                           # its child would be 0 of 1 too
    monkeypatch.setenv("RANK", "1"); monkeypatch.setenv("WORLD_SIZE", "2")
    assert not rank_claim.stands_aside(run)                       # a spawned rank 1 of 2
    monkeypatch.setenv(rank_claim.ENV, "not json")
    assert not rank_claim.stands_aside(run)                       # unreadable: decides nothing


def test_a_job_a_rank_launches_itself_is_not_a_rank_of_the_run(tmp_path, monkeypatch):
    """A nested torchrun started by a rank: its workers carry another TORCHELASTIC_RUN_ID and
    stand aside whatever their rank variables (its rank 1 is not this run's rank 1)."""
    import json
    import os

    from trainprof.probes import rank_claim

    run = tmp_path / "run"
    monkeypatch.setenv(rank_claim.ENV, json.dumps({
        "pid": 1, "run_dir": str(run), "rank": 0, "world": 2,
        "env": {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "launch": "outer"}))
    monkeypatch.setenv("RANK", "1"); monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    assert not rank_claim.stands_aside(run)      # a rank of the same launch: its own rank 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "inner")
    assert rank_claim.stands_aside(run)          # the nested launch's rank 1
    assert os.getpid() != 1


def test_overhead_spans_open_close_and_keep_the_last_of_each_kind():
    """ProbeSession.note_span: a span noted open (end null) is closed by the call that names its
    kind and start; at most MAX_SPANS of one kind are kept (the last ones), other kinds untouched;
    meta.json is left to the ticker thread (one write queued, never on the caller's thread)."""
    import threading
    from types import SimpleNamespace

    from trainprof.probes import session as sess

    queued = []
    s = SimpleNamespace(meta={}, _meta_lock=threading.Lock(),
                        ticker=SimpleNamespace(call_soon=queued.append), write_meta=lambda: None)
    note = sess.ProbeSession.note_span.__get__(s)
    note("trace_export", 100, None)
    note("nan_replay", 150, 160)
    assert s.meta["overhead_spans"][0] == {"kind": "trace_export", "start_ns": 100, "end_ns": None}
    note("trace_export", 100, 900)
    assert s.meta["overhead_spans"] == [{"kind": "trace_export", "start_ns": 100, "end_ns": 900},
                                        {"kind": "nan_replay", "start_ns": 150, "end_ns": 160}]
    for i in range(sess.MAX_SPANS + 5):
        note("job_profiler", 1000 + 10 * i, 1005 + 10 * i)
    jp = [x["start_ns"] for x in s.meta["overhead_spans"] if x["kind"] == "job_profiler"]
    assert jp == [1000 + 10 * i for i in range(5, sess.MAX_SPANS + 5)]
    assert [x["kind"] for x in s.meta["overhead_spans"][:2]] == ["trace_export", "nan_replay"]
    assert queued and all(f is s.write_meta for f in queued)
