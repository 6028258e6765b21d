"""Which bare torch.profiler traces `trainprof analyze` keeps: the window of each process that
holds the most training (never the cut-off one torch writes when the loop ends), trailing stub
steps dropped, one job of several, traces in a subfolder, JSON files that are not traces.
Synthetic Kineto-shaped traces: each full step is an aten::mm of 5 ms, then gloo:all_reduce."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_cli
from trainprof.analysis.run import RunDir

BASE = 1_700_000_000_000_000_000  # baseTimeNanoseconds; ts are µs after it
STEP_US = 57_000


def trace(rank, world, pid, steps, sleep_ms=0.0, wait_ms=0.0, backend="gloo") -> dict:
    """steps: (N, start µs) for a full step, (N, start µs, "stub") for a ProfilerStep with
    nothing in it (13 µs, as torch writes when the profiler stops). A full step: ProfilerStep
    from t; ``sleep_ms`` idle; aten::mm 5 ms; gloo:all_reduce 1 ms + ``wait_ms``; 10 µs."""
    ev = []
    for s in steps:
        n, t = s[0], s[1]
        if len(s) > 2:
            ev.append(_x("ProfilerStep#%d" % n, "user_annotation", pid, 1, t, 13.0))
            continue
        t1 = t + 10 + sleep_ms * 1000
        ar = 1000.0 + wait_ms * 1000
        end = t1 + 5010 + ar + 10
        ev += [_x("ProfilerStep#%d" % n, "user_annotation", pid, 1, t, end - t),
               _x("aten::mm", "cpu_op", pid, 1, t1, 5000.0),
               _x("gloo:all_reduce", "user_annotation", pid, 2, t1 + 5010, ar)]
    return {"schemaVersion": 1, "baseTimeNanoseconds": BASE,
            "distributedInfo": {"backend": backend, "rank": rank, "world_size": world},
            "traceEvents": ev}


def _x(name, cat, pid, tid, ts, dur) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def steps(first: int, n: int, t0: float) -> list:
    return [(first + i, t0 + i * STEP_US) for i in range(n)]


def write(d: Path, name: str, doc: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(doc))
    return d / name


def straggler_job(d: Path, t0: float = 1e6, pids=(100, 101), stamp: int = 1000000000001,
                  windows=("full",)) -> dict[int, list[Path]]:
    """A 2-rank job where rank 1 sleeps 50 ms before each step and rank 0 waits for it in
    all_reduce. windows: "full" (steps 2-4), "cut" (step 7 and a stub step 8: the window torch
    cuts off when the loop ends), "stub" (a stub step 7 alone), each 1 s after the previous."""
    out: dict[int, list[Path]] = {0: [], 1: []}
    for k, kind in enumerate(windows):
        t = t0 + k * 1e6
        st = {"full": steps(2, 3, t), "cut": steps(7, 1, t) + [(8, t + STEP_US, "stub")],
              "stub": [(7, t, "stub")]}[kind]
        for rank, pid, kw in ((0, pids[0], {"wait_ms": 50}), (1, pids[1], {"sleep_ms": 50})):
            out[rank].append(write(d, f"host_{pid}.{stamp + k}.pt.trace.json",
                                   trace(rank, 2, pid, st, **kw)))
    return out


def summary(p: Path) -> dict:
    return json.loads((p / "summary.json").read_text())


# --------------------------------------------------------------------------- windows
def test_cut_off_window_never_beats_the_full_one(tmp_path):
    """schedule(wait=1, warmup=1, active=3) over 8 steps: torch writes steps 2-4, then steps 7
    and a stub 8 when the loop ends. The full window is analyzed and the straggler found."""
    d = tmp_path / "cut"
    files = straggler_job(d, windows=("full", "cut"))
    r = run_cli(["analyze", d, "--no-report", "-o", tmp_path / "out"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = summary(tmp_path / "out")
    run = RunDir(d)
    assert run.profiler_traces() == {0: files[0][0], 1: files[1][0]}
    inp = s["run"]["input"]
    assert (inp["files"], inp["traces_read"], inp["older_windows_skipped"],
            inp["later_windows_skipped"], inp["steps"], inp["rank_steps"]) == (4, 4, 0, 2, 3, 6)
    for rank in (0, 1):
        (line,) = [p for p in s["problems"] if p.startswith(f"rank {rank}: 2 profiler windows")]
        assert f"{files[rank][0].name} (3 step(s) with ops)" in line
        assert f"left out: {files[rank][1].name} (1 step(s) with ops, later)" in line
    (f,) = [f for f in s["findings"] if f["kind"] == "straggler"]
    assert "rank 1 spends" in f["message"] and "with no op recorded in the trace" in f["message"]
    assert "in 3 profiled steps" in f["message"]
    # hand-computed: rank 1 idles 50 ms + 10 µs before its mm, rank 0 10 µs (see trace())
    assert "spends 50.0 ms/step more than its peers with no op recorded in the trace" in f["message"]


def test_stub_window_alone_is_left_out(tmp_path):
    """7 steps: the second window holds only a stub ProfilerStep#7."""
    d = tmp_path / "stub"
    files = straggler_job(d, windows=("full", "stub"))
    run = RunDir(d)
    assert run.profiler_traces() == {0: files[0][0], 1: files[1][0]}
    assert (run.input_facts["steps"], run.input_facts["rank_steps"]) == (3, 6)
    assert any("no step with an op in it, later" in p and files[0][1].name in p
               for p in run.problems)


def test_windows_holding_as_much_training_keep_the_latest(tmp_path):
    d = tmp_path / "repeat"
    files = straggler_job(d, windows=("full", "full"))
    run = RunDir(d)
    assert run.profiler_traces() == {0: files[0][1], 1: files[1][1]}
    assert run.input_facts["older_windows_skipped"] == 2
    assert "later_windows_skipped" not in run.input_facts
    assert any(p.startswith("rank 0: 2 profiler windows; they hold as much training; the latest")
               and files[0][0].name in p for p in run.problems)


def test_trailing_stub_step_is_dropped_from_the_steps(tmp_path):
    """One window of steps 2-4 and the stub step 5 torch writes when the profiler stops: the
    stub is left out of the steps, so it does not dilute per-step figures."""
    d = tmp_path / "one"
    for rank, pid in ((0, 100), (1, 101)):
        write(d, f"host_{pid}.1000000000001.pt.trace.json",
              trace(rank, 2, pid, steps(2, 3, 1e6) + [(5, 1e6 + 3 * STEP_US, "stub")]))
    run = RunDir(d)
    assert run.input_facts["steps"] == 3 and run.input_facts["stub_steps_dropped"] == 2
    assert sum("ProfilerStep#5 (0.013 ms) holds no op" in p for p in run.problems) == 2
    rows = run.trace_digests("comm_compute")[0]["rows"]
    assert [r["step"] for r in rows] == [2, 3, 4]
    # hand-computed: 10 µs + mm 5000 + 10 + all_reduce 1000 + 10 µs = 6.03 ms a step (with the
    # stub's 0.013 ms as a fourth step the mean would be 4.526 ms)
    assert sum(r["window_ms"] for r in rows) / len(rows) == 6.03
    tr = run.traces()[0]  # the parsed trace agrees with its digest
    assert tr.tables.steps["step"].tolist() == [2, 3, 4]
    assert not (tr.tables.events["step"] == 5).any()


# --------------------------------------------------------------------------- jobs
def test_a_later_partial_job_in_one_folder_is_left_out(tmp_path):
    """Job A (ranks 0, 1) and, 54 s later, job B's rank 0 (another process): A is analyzed
    (the latest complete job), B's file is named; never B's rank 0 with A's rank 1."""
    d = tmp_path / "mixed"
    a = straggler_job(d)
    b = write(d, "host_200.1000000054001.pt.trace.json",
              trace(0, 2, 200, steps(2, 3, 1e6 + 54e6)))
    r = run_cli(["analyze", d, "--no-report", "-o", tmp_path / "out"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = summary(tmp_path / "out")
    assert RunDir(d).profiler_traces() == {0: a[0][0], 1: a[1][0]}
    assert s["run"]["input"]["other_job_files"] == 1
    (line,) = [p for p in s["problems"] if "another job" in p]
    assert f"recorded 54.0 s after the analyzed one, world size 2, gloo, 1 of 2 rank(s): {b.name}" in line
    assert "latest complete job" in line
    assert not any("claim this rank" in p for p in s["problems"])


def test_a_later_complete_job_wins_and_a_different_world_size_is_another_job(tmp_path):
    d = tmp_path / "mixed"
    straggler_job(d)
    b = straggler_job(d, t0=1e6 + 54e6, pids=(200, 201), stamp=1000000054001)
    # at the same time as job B, a trace of a 4-rank job: not merged into B
    c = write(d, "host_300.1000000054001.pt.trace.json",
              trace(0, 4, 300, steps(2, 3, 1e6 + 54e6)))
    run = RunDir(d)
    assert run.profiler_traces() == {0: b[0][0], 1: b[1][0]}
    assert run.input_facts["other_job_files"] == 3
    lines = [p for p in run.problems if "another job" in p]
    assert len(lines) == 2 and any(f"world size 4, gloo, 1 of 4 rank(s): {c.name}" in p
                                   for p in lines)
    assert any("54.0 s before the analyzed one" in p for p in lines)


def test_windows_of_one_job_far_apart_stay_one_job(tmp_path):
    """A slow job's two windows 60 s apart: the same processes, so one job."""
    d = tmp_path / "slow"
    files = straggler_job(d, windows=("full",))
    later = straggler_job(d, t0=1e6 + 60e6, stamp=1000000060001, windows=("full",))
    run = RunDir(d)
    assert run.profiler_traces() == {0: later[0][0], 1: later[1][0]}
    assert not any("another job" in p for p in run.problems)
    assert run.input_facts["older_windows_skipped"] == 2 and files


def test_two_jobs_given_as_two_inputs_are_refused(tmp_path):
    a = straggler_job(tmp_path / "a")
    b = straggler_job(tmp_path / "b", t0=1e6 + 60e6, pids=(200, 201))
    r = run_cli(["analyze", tmp_path / "a", tmp_path / "b", "--no-report", "-o", tmp_path / "o"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "2 different jobs" in r.stderr
    for p in a[0] + a[1] + b[0] + b[1]:
        assert p.name in r.stderr


# --------------------------------------------------------------------------- finding the traces
def test_traces_in_one_subfolder_are_analyzed_several_are_named(tmp_path):
    top = tmp_path / "pl"
    straggler_job(top / "lightning_logs" / "version_0")
    (top / "checkpoints").mkdir()
    r = run_cli(["analyze", top, "--no-report"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = summary(top)  # the outputs go into the folder given
    assert [x["rank"] for x in s["run"]["ranks"]] == [0, 1]
    assert any("analyzed the traces in lightning_logs/version_0/, the only subfolder" in p
               for p in s["problems"])
    straggler_job(top / "lightning_logs" / "version_1", t0=1e6 + 60e6, pids=(200, 201))
    r = run_cli(["analyze", top, "--no-report", "-o", tmp_path / "o"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("traces found in 2 subfolders: lightning_logs/version_0/, lightning_logs/version_1/"
            in r.stderr)


def test_json_that_is_not_a_trace_is_not_counted_as_one(tmp_path):
    d = tmp_path / "d"
    straggler_job(d)
    write(d, "config.json", {"model_type": "gpt2", "n_layer": 2})
    run = RunDir(d)
    f = run.input_facts
    assert (f["files"], f["traces_read"], f["unreadable"], f["not_traces"]) == (2, 2, 0, 1)
    (line,) = [p for p in run.problems if "config.json" in p]
    assert "1 JSON file(s) are not profiler traces (no traceEvents), not analyzed: config.json" == line

    only = tmp_path / "only"
    write(only, "config.json", {"a": 1})
    r = run_cli(["analyze", only, "--no-report"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no profiler trace: config.json is JSON but not a Chrome trace" in r.stderr

    # a truncated trace beside it is a trace that failed: nothing analyzed (exit 3)
    full = (d / next(p.name for p in d.glob("*.pt.trace.json"))).read_text()
    (only / "host_1.1000000000001.pt.trace.json").write_text(full[: len(full) // 2])
    r = run_cli(["analyze", only, "--no-report"])
    assert r.returncode == 3, r.stdout + r.stderr
    f = summary(only)["run"]["input"]
    assert (f["files"], f["unreadable"], f["not_traces"]) == (1, 1, 1)
