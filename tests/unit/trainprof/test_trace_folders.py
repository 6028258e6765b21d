"""`trainprof analyze` on torch.profiler traces that are not a trainprof run directory: a
tensorboard_trace_handler folder, HTA's layout, a single file, several inputs as one job, traces
without distributedInfo or ProfilerStep, and inputs with nothing to analyze (exit 3)."""

from __future__ import annotations

from paths import FIXTURES
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import run_cli, union_length
from trainprof.analysis.run import RunDir
from trainprof.trace._discover import name_rank

HTA = FIXTURES / "hta"
ALEXNET = HTA / "critical_path" / "alexnet" / "benchmark_result_2869224_1695835535_trace.json.gz"

# A real tensorboard_trace_handler folder: one gloo process (world size 1), profiled with a
# schedule that repeats, so the handler writes two windows <host>_<pid>.<ts>.pt.trace.json.
GEN = r"""
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
m = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
sched = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=2)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched,
                            on_trace_ready=torch.profiler.tensorboard_trace_handler(sys.argv[1])) as p:
    for _ in range(6):
        m(torch.randn(8, 16)).sum().backward()
        dist.all_reduce(m.weight.grad)
        opt.step(); opt.zero_grad(); p.step()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def tb_windows(tmp_path_factory) -> list[Path]:
    """The handler's two windows of one process, oldest first."""
    import socket

    d = tmp_path_factory.mktemp("tb")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-c", GEN, str(d / "out"), str(port)], check=True,
                   capture_output=True, timeout=300)
    files = sorted((d / "out").glob("*.pt.trace.json"))
    assert len(files) == 2, files
    return files


def _load(p: Path) -> dict:
    raw = p.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def _write(p: Path, doc: dict) -> Path:
    data = json.dumps(doc).encode()
    p.write_bytes(gzip.compress(data) if p.name.endswith(".gz") else data)
    return p


def _as_rank(src: Path, dst: Path, rank: int | None, world: int | None = 2) -> Path:
    """A copy of a trace with distributedInfo saying ``rank`` of ``world`` (None: removed)."""
    doc = _load(src)
    if rank is None:
        doc.pop("distributedInfo", None)
    else:
        doc["distributedInfo"] = dict(doc["distributedInfo"], rank=rank, world_size=world)
    return _write(dst, doc)


def _summary(path: Path) -> dict:
    return json.loads(path.read_text())


def test_rank_from_file_names():
    assert name_rank("rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz") == 0
    assert name_rank("sampled_rank-1.json.gz") == 1
    assert name_rank("trace_rank_12.json") == 12
    assert name_rank("rank[3].json") == 3
    assert name_rank("rank7.pt.trace.json") == 7
    assert name_rank("vm_23211.1795597090189473128.pt.trace.json") is None
    assert name_rank("frank1.json") is None


def test_tensorboard_folder_two_ranks_latest_window(tb_windows, tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    old, new = tb_windows
    host_pid, _, rest = new.name.partition(".")
    # rank 0: both of the handler's windows (the latest is analyzed); rank 1: another process
    for src in (old, new):
        _as_rank(src, d / src.name, 0)
    _as_rank(new, d / f"otherhost_4242.{rest}", 1)
    r = run_cli(["analyze", d, "--no-report"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(d / "summary.json")
    run = s["run"]
    assert [x["rank"] for x in run["ranks"]] == [0, 1]
    assert run["world_size"] == 2 and run["backend"] == "gloo"
    assert run["pg_config"][0]["pg_desc"] == "default_pg"
    assert run["ranks"][1]["host"] == "otherhost"
    assert run["input"] == {"kind": "profiler traces", "inputs": [str(d)], "files": 3,
                            "older_windows_skipped": 1, "traces_read": 3, "unreadable": 0,
                            "ranks": 2, "steps": 2, "rank_steps": 4}  # 2 steps, on each rank
    (older,) = [p for p in s["problems"] if "profiler windows" in p]
    assert older.startswith("rank 0: 2 profiler windows; they hold as much training; the latest")
    assert f"analyzed: {new.name}" in older and f"left out: {old.name}" in older
    assert "partial" not in run
    assert {pr["rank"] for pr in s["metrics"]["comm_compute"]["per_rank"]} == {0, 1}
    assert "nothing_analyzed" not in s
    assert "2 ranks" in r.stdout
    # bare traces carry none of a run directory's streams: said, never "nothing looks wrong"
    cov = s["coverage"]
    assert [m["analysis"] for m in cov["not_analyzed"]] == [
        "step time", "stragglers over every step", "collective desync / mismatch", "NaN origin",
        "hang"]
    assert {"communication vs compute", "stragglers in the profiled steps"} <= set(cov["analyzed"])
    assert s["problems"][0] == cov["text"] and "trainprof wrap" in cov["text"]
    assert "nothing looks wrong" not in r.stdout and "heartbeat.jsonl" in r.stdout


def test_hta_layout_matches_hta_numbers(tmp_path):
    """trace_filter's two ranks renamed the way HTA's examples are: HTA's numbers (README)."""
    d = tmp_path / "hta"
    d.mkdir()
    for r in (0, 1):
        shutil.copy(HTA / "trace_filter" / f"sampled_rank-{r}.json.gz",
                    d / f"rank-{r}.Apr_03_18_51_38.110{r}.pt.trace.json.gz")
    run = RunDir(d)
    assert run.ranks == [0, 1]
    from trainprof.analyzers._comm_breakdown import rank_breakdown

    want = {0: (53.56, 17.71, 28.74, 11.81), 1: (54.72, 22.57, 22.72, 20.05)}
    for r, tr in run.traces().items():
        _, hta, kind = rank_breakdown(tr)
        assert kind == "gpu"
        got = (hta["idle_pct"], hta["compute_pct"], hta["non_compute_pct"], hta["overlap_pct"])
        assert np.allclose(got, want[r], atol=0.5), (r, got)
    assert run.input_facts["traces_read"] == 2 and run.input_facts["steps"] == 2
    assert run.input_facts["rank_steps"] == 4


def test_single_file_and_rank_from_name(tb_windows, tmp_path):
    f = _as_rank(tb_windows[1], tmp_path / "rank-3.Apr_03_18_51_38.1102.pt.trace.json.gz", None)
    r = run_cli(["analyze", f, "--no-report"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path / f"{f.name}.summary.json")
    assert [x["rank"] for x in s["run"]["ranks"]] == [3]
    assert s["run"]["input"]["files"] == 1 and s["run"]["input"]["traces_read"] == 1
    # the summary written beside the trace is not a trace the next analysis reads
    assert RunDir(tmp_path).input_facts["files"] == 1


def test_files_without_rank_one_rank_per_file_in_name_order(tb_windows, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    fb = _as_rank(tb_windows[0], b / "worker_b.json", None)
    fa = _as_rank(tb_windows[1], a / "worker_a.json", None)
    # several files from different folders, one job; outputs in the common folder
    r = run_cli(["analyze", fb, fa, "--no-report"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path / "summary.json")
    assert s["run"]["input"]["files"] == 2 and s["run"]["input"]["ranks"] == 2
    run = RunDir([fb, fa])
    assert {r: t.path.name for r, t in run.traces().items()} == {0: "worker_a.json", 1: "worker_b.json"}
    (line,) = [p for p in s["problems"] if "carry no rank" in p]
    assert "worker_a.json -> rank 0" in line and "worker_b.json -> rank 1" in line


def test_distributed_rank_wins_and_duplicates_keep_latest(tb_windows, tmp_path):
    old, new = tb_windows
    _as_rank(old, tmp_path / "rank-5.json", 1)   # distributedInfo says 1: the name's 5 is not used
    # a second file for rank 1, as much training in it: the latest window is used
    _as_rank(new, tmp_path / "x_1.json", 1)
    import os

    os.utime(tmp_path / "rank-5.json", (1, 1))
    run = RunDir(tmp_path)
    assert run.ranks == [1] and run.traces()[1].path.name == "x_1.json"
    assert any(p.startswith("rank 1: 2 profiler windows") and "left out: rank-5.json" in p
               for p in run.problems)


def test_no_profiler_step_is_one_whole_trace_window(tmp_path):
    shutil.copy(ALEXNET, tmp_path / ALEXNET.name)
    r = run_cli(["analyze", tmp_path, "--no-report"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path / "summary.json")
    (line,) = [p for p in s["problems"] if "no ProfilerStep" in p]
    assert "whole trace" in line and "43458.523 ms" in line
    assert s["run"]["input"]["whole_trace_windows"] == 1
    assert s["run"]["device"] == "NVIDIA A100-PG509-200"
    (pr,) = s["metrics"]["comm_compute"]["per_rank"]
    assert pr["steps"] == [0]
    # hand-computed: every kernel/memcpy/memset of the trace, in whole µs (start up, end down)
    ev = [e for e in _load(ALEXNET)["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    s_us = np.array([np.ceil(e["ts"]) for e in ev])
    e_us = np.array([np.floor(e["ts"] + e["dur"]) for e in ev])
    busy = union_length(zip(s_us, e_us))
    window = e_us.max() - s_us.min()
    assert pr["hta_view"]["idle_pct"] == pytest.approx(100 * (window - busy) / window, abs=0.01)
    assert pr["hta_view"]["idle_pct"] > 99  # a benchmark with long pauses between its kernels


def test_nothing_to_analyze_exits_3(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rank-0.pt.trace.json").write_text('{"traceEvents": [{"ph": "X", "name": "a", ')
    r = run_cli(["analyze", bad, "--no-report"])
    assert r.returncode == 3, r.stdout + r.stderr
    assert "nothing analyzed" in r.stderr and "none of the 1 profiler trace file(s)" in r.stderr
    assert "nothing looks wrong" not in r.stdout

    empty = tmp_path / "empty_events"
    empty.mkdir()
    _write(empty / "rank-0.pt.trace.json", {"traceEvents": [], "distributedInfo": {"rank": 0}})
    r = run_cli(["analyze", empty, "--no-report"])
    assert r.returncode == 3, r.stdout + r.stderr
    assert "hold no events" in r.stderr

    # several inputs, none holding a trace file
    (tmp_path / "d1").mkdir(), (tmp_path / "d2").mkdir()
    r = run_cli(["analyze", tmp_path / "d1", tmp_path / "d2", "--no-report", "-o", tmp_path / "o"])
    assert r.returncode == 3 and "no profiler trace file" in r.stderr, r.stderr

    # a folder with nothing trainprof reads at all is refused as input (exit 2)
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "readme.txt").write_text("x")
    r = run_cli(["analyze", tmp_path / "nothing"])
    assert r.returncode == 2 and "no profiler traces" in r.stderr, r.stderr


def test_gpu_ops_without_launch_are_left_out_of_the_windows(tmp_path):
    """Kernels queued before recording started (no runtime call with their correlation id in the
    trace) are in no step window and counted: HTA's numbers stay those of the trace without them."""
    doc = _load(HTA / "trace_filter" / "sampled_rank-0.json.gz")
    step = next(e for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#551")
    first_kernel = min(e["ts"] for e in doc["traceEvents"] if e.get("cat") == "kernel")
    queued = [{"ph": "X", "cat": "kernel", "name": "queued_kernel", "pid": 0, "tid": 7,
               "ts": step["ts"] + 100 + 40 * i, "dur": 20.0,
               "args": {"stream": 7, "correlation": 10**12 + i, "External id": 10**12 + i}}
              for i in range(50)]
    # inside step 551 and before its first kernel: assigned by time they would widen its window
    assert all(step["ts"] < q["ts"] and q["ts"] + q["dur"] < first_kernel for q in queued)
    doc["traceEvents"] += queued
    _write(tmp_path / "rank-0.pt.trace.json.gz", doc)
    run = RunDir(tmp_path)
    tr = run.traces()[0]
    assert tr.stats["gpu_ops_without_launch"] == 50
    assert (tr.events.loc[tr.events["name"] == "queued_kernel", "step"] == -1).all()
    assert any("50 GPU op(s) have no launching runtime call" in p for p in run.problems)
    from trainprof.analyzers._comm_breakdown import rank_breakdown

    rows, hta, _ = rank_breakdown(tr)
    got = (hta["idle_pct"], hta["compute_pct"], hta["non_compute_pct"], hta["overlap_pct"])
    assert got == (53.56, 17.71, 28.74, 11.81)  # HTA on the original trace (fixtures' README)
    original = RunDir(HTA / "trace_filter")
    want = {r["step"]: r["window_ms"] for r in rank_breakdown(original.traces()[0])[0]}
    assert {r["step"]: r["window_ms"] for r in rows} == want


def test_a_file_trainprof_did_not_write_is_never_overwritten(tmp_path):
    shutil.copy(HTA / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", tmp_path)
    (tmp_path / "summary.json").write_text('{"mine": 1}')
    r = run_cli(["analyze", tmp_path, "--no-report"])
    assert r.returncode == 2 and "not overwritten" in r.stderr, r.stderr
    assert (tmp_path / "summary.json").read_text() == '{"mine": 1}'
    r = run_cli(["analyze", tmp_path, "-o", tmp_path / "out"])
    assert r.returncode == 0, r.stderr
    r = run_cli(["analyze", tmp_path, "-o", tmp_path / "out"])  # its own outputs: rewritten
    assert r.returncode == 0, r.stderr
    assert [x["rank"] for x in _summary(tmp_path / "out" / "summary.json")["run"]["ranks"]] == [34]


def test_traces_moved_into_a_profiler_folder(tb_windows, tmp_path):
    """X/profiler/ holding torch-named traces (no manifest, no ranks/): analyzed, outputs in X."""
    (tmp_path / "profiler").mkdir()
    shutil.copy(tb_windows[1], tmp_path / "profiler" / tb_windows[1].name)
    r = run_cli(["analyze", tmp_path, "--no-report"])
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path / "summary.json")
    assert [x["rank"] for x in s["run"]["ranks"]] == [0] and s["run"]["input"]["traces_read"] == 1
    assert not any("not named" in p for p in s["problems"])


def test_two_ranks_of_a_128_rank_job_keep_its_declared_world_size(tmp_path):
    """trace_filter: 2 sampled ranks of a 128-rank job (distributedInfo world_size 128). The
    analysis loops over the ranks it trusts (2); summary.json and the report header still say
    the job had 128 ranks (they said "world size 2")."""
    from trainprof.analysis.runner import run_info

    run = RunDir(HTA / "trace_filter")
    info = run_info(run)
    assert info["world_size"] == 2 and info["declared_world_size"] == 128
    out = tmp_path / "out"
    proc = run_cli(["analyze", HTA / "trace_filter", "--out", out, "-q"])
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["run"]["declared_world_size"] == 128
    assert "128 (2 with files)" in (out / "report.html").read_text()
