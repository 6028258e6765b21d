"""A real run directory captured on an H100 (CUDA/NCCL, one rank) with `trainprof wrap
--hang-timeout 8 --on-hang kill` around the reference workload with `hang:rank=0,step=4,mode=sleep`
(tests/fixtures/gpu/README.md). CPU CI analyses it: the GPU paths (CUDA profiler trace, NVML
telemetry, NCCL flight-recorder dump, CUDA memory records) must read without a problem."""

from __future__ import annotations

import json
import shutil

from helpers import run_cli
from trainprof.analyzers import _flight_recorder as fr
from trainprof.trace import parse_trace
from paths import FIXTURES

RUN = FIXTURES / "gpu" / "h100_hang_run"


def test_real_nccl_flight_recorder_dump():
    dump = fr.load(RUN / "ranks" / "rank-00000" / "flight-recorder.pkl")
    entries = dump["entries"]
    # the reference's two world-group collectives per step (loss all_reduce, stats all_gather),
    # steps 0-3 completed before the injected sleep after step 4's optimizer step
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1)) and len(entries) >= 8
    assert {e["op"] for e in entries} == {"all_reduce", "_all_gather_base"}
    assert all(e["state"] == "completed" and e["profiling_name"].startswith("nccl:") for e in entries)


def test_real_cuda_trace_has_kernels_on_streams():
    t = parse_trace(RUN / "profiler" / "rank-00000.pt.trace.json.gz", rank=0)
    gpu = t.gpu_events()
    assert (gpu["cat"] == "kernel").sum() > 1000 and gpu["stream"].notna().all()
    # the profiler window was steps 1-2: both ProfilerStep annotations are there
    assert sorted(t.steps["step"].tolist())[:2] == [1, 2]


def test_analyze_names_the_sleeping_rank_and_reads_every_gpu_stream(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    proc = run_cli(["analyze", run, "--no-report", "--quiet"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["problems"] == [] and s["errors"] == []
    (hang,) = [f for f in s["findings"] if f["kind"] == "hang"]
    culprit = hang["evidence"]["culprit"] if "culprit" in hang["evidence"] else hang["evidence"]
    assert hang["ranks"] == [0] and "_injected_hang_sleep" in culprit["frame"]
    frm = s["metrics"]["hang"]["flight_recorder"]
    assert frm["groups"]["0"]["last_completed"]["0"] == frm["groups"]["0"]["last_enqueued"]["0"]
    cc = s["metrics"]["comm_compute"]["job"]
    assert cc["trace_kind"] == "gpu"
    assert abs(sum(cc[k] for k in ("compute_fraction", "overlapped_fraction", "exposed_comm_fraction",
                                   "data_fraction", "other_fraction", "idle_fraction")) - 1) < 0.01
    # NVML samples from the H100: clocks and power are real readings
    tel = [json.loads(x) for x in (run / "ranks/rank-00000/telemetry.jsonl").read_text().splitlines()]
    assert tel and all(t["sm_clock_mhz"] > 0 and t["power_limit_w"] > 0 for t in tel)
    assert json.loads((run / "manifest.json").read_text())["status"] == "hung"
