"""A job that runs its own profiler (or allocator history, global hooks, anomaly mode) under
trainprof: the job's tools work as without trainprof, trainprof's profiler window steps aside,
and the analysis uses the job's traces and says so.

Single-process cases: tests/unit/probes/test_job_profiler_coexistence.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers import run_cli, write_script
from trainprof.analysis.run import RunDir
from job_profiler_shared import _line

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
    # the job's profiler ran from its first cycle's warm-up (prepared by prof.step() after step
    # 0, i.e. in trainprof's step 1) to its stop, and exported, twice: spans in meta.json, and
    # the steps they overlap left out of step statistics, with the reason
    for r in (0, 1):
        spans = [(x["kind"], x["start_ns"], x["end_ns"]) for x in run.rank_meta(r)["overhead_spans"]]
        assert [k for k, _, _ in spans] == ["job_profiler", "job_trace_export"] * 2
        assert all(a <= b for _, a, b in spans) and all(spans[i][2] <= spans[i + 1][1] for i in range(3))
        step1 = next(x for x in run.stream(r, "steps") if x["step"] == 1)
        assert step1["start_ns"] <= spans[0][1] <= step1["end_ns"]
    st = summary["metrics"]["step_time"]
    assert st["excluded_steps"]["job_profiler"] == list(range(1, 8))  # every step but the warm-up
    assert st["excluded_reasons"]["job_profiler"].startswith("the job's own profiler")
    assert not [f for f in summary["findings"] if f["kind"] == "slow_steps"]
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


