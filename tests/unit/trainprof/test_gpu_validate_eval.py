"""The GPU validation suite's criteria (benchmarks/gpu/veval.py): on real H100 data the CUDA
criteria hold, and each one fails on a wrong answer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

ROOT = REPO
GPU = ROOT / "tests" / "fixtures" / "gpu"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import veval  # noqa: E402
from vcore import Verdict  # noqa: E402


def _run(tmp_path: Path, injections: list[dict], meta: dict | None = None) -> Path:
    run = tmp_path / "run"
    (run / "ranks" / "rank-00000").mkdir(parents=True)
    (run / "injected.json").write_text(json.dumps({"schema_version": 1, "injections": injections}))
    (run / "ranks" / "rank-00000" / "meta.json").write_text(json.dumps(meta or {"device": "cuda:0"}))
    return run


def _summary(findings=(), **metrics) -> dict:
    return {"run": {"exit_code": 0, "world_size": 1, "backend": "nccl"}, "errors": [], "problems": [],
            "findings": list(findings), "metrics": metrics}


NAN = {"kind": "nan", "performed": True, "ranks": [0],
       "params": {"rank": 0, "step": 3, "module": "layers.1.mlp", "phase": "forward", "value": "nan"}}


def _nan_finding(**ev) -> dict:
    e = {"step": 3, "phase": "forward", "module": "layers.1.mlp", "op": "aten::log", "value": "nan",
         "method": "replay"}
    e.update(ev)
    return {"kind": "nan_origin", "severity": "critical", "ranks": [0], "evidence": e}


@pytest.mark.parametrize("change,ok", [({}, True), ({"module": "layers.1.attn"}, False),
                                       ({"op": "aten::mul"}, False), ({"step": 4}, False)])
def test_nan_criterion_needs_module_op_and_step(tmp_path, change, ok):
    v = Verdict()
    veval.eval_nan(v, _run(tmp_path, [NAN]), _summary([_nan_finding(**change)]), cuda=True)
    assert v.ok is ok, v.failed()


def test_nan_criterion_fails_without_a_finding(tmp_path):
    v = Verdict()
    veval.eval_nan(v, _run(tmp_path, [NAN]), _summary([]), cuda=True)
    assert not v.ok and any("one nan_origin finding" in c for c in v.failed())


def test_snapshot_split_share_of_the_real_h100_oom_snapshot():
    # make_snapshot.py: every 1 GiB segment split into [600 MiB live | 424 MiB free]
    assert veval.snapshot_split_share(GPU / "h100_oom_snapshot.pickle") == 424 / 1024


def test_fragmentation_criterion_on_cuda_needs_the_finding_and_the_snapshot(tmp_path):
    inj = [{"kind": "fragment", "performed": True, "ranks": [0], "params": {"rank": 0}}]
    run = _run(tmp_path, inj)
    found = {"kind": "fragmentation", "severity": "warning", "ranks": [0], "evidence": {}}
    frag = {"job": {"max_score": 0.68}}
    v = Verdict()
    veval.eval_fragmentation(v, run, _summary([found], fragmentation=frag), cuda=True)
    assert v.failed() == ["allocator snapshot written (TRAINPROF_MEMORY_HISTORY=1)"]
    shutil.copy(GPU / "h100_oom_snapshot.pickle", run / "ranks" / "rank-00000" / "memory_snapshot.pickle")
    v = Verdict()
    veval.eval_fragmentation(v, run, _summary([found], fragmentation=frag), cuda=True)
    assert v.ok, v.failed()
    v = Verdict()
    veval.eval_fragmentation(v, run, _summary([], fragmentation={"job": {"max_score": 0.1}}), cuda=True)
    assert len(v.failed()) == 2


def test_job_trace_criterion_on_the_real_h100_trace():
    v = Verdict()
    veval.eval_job_trace(v, GPU / "h100_item_sync.pt.trace.json.gz", cuda=True)
    assert v.ok, v.failed()
    v = Verdict()
    veval.eval_job_trace(v, GPU / "h100_item_sync.pt.trace.json.gz", cuda=True, syncs=5)
    assert not v.ok
    v = Verdict()  # a CUDA trace is no dry-run (CPU) trace
    veval.eval_job_trace(v, GPU / "h100_item_sync.pt.trace.json.gz", cuda=False)
    assert not v.ok


def test_mfu_criterion_recomputes_mfu_with_the_datasheet_peak(tmp_path):
    run = _run(tmp_path, [], {"device": "cuda:0", "device_name": "NVIDIA H200"})
    info = {"layers": 4, "heads": 4, "seq_len": 128, "hidden": 256, "n_params_non_embedding": 3_000_000,
            "tokens_per_step": 2048, "dtype": "bf16"}
    flops = (6 * 3_000_000 + 12 * 4 * 4 * 64 * 128) * 2048
    peak = 989e12  # H200 bf16 dense, the datasheet

    def summary(mfu, peak_total):
        s = _summary(roofline={"job": {"mfu": mfu, "peak_flops_per_s_total": peak_total}},
                     step_time={"job": {"median_ms": 20.0}})
        s["run"]["run_info"] = info
        return s

    v = Verdict()
    veval.eval_mfu(v, run, summary(flops / (0.02 * peak), peak), cuda=True)
    assert v.ok, v.failed()
    v = Verdict()  # a calibrated (lower) peak is not the device's
    veval.eval_mfu(v, run, summary(flops / (0.02 * 700e12), 700e12), cuda=True)
    assert not v.ok


def test_telemetry_criteria_on_the_real_h100_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(GPU / "h100_hang_run", run)
    r = subprocess.run([sys.executable, "-m", "trainprof", "analyze", str(run), "--no-report", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((run / "summary.json").read_text())
    v = Verdict()
    veval.eval_telemetry(v, run, s, cuda=True)
    # real NVML samples at steps 1, 3, 5 (1 Hz); the one analysed step (4: the others are
    # warm-up, profiled or hung) has none, so nothing is joined: the only criterion not held
    assert [c.split(" (")[0] for c in v.failed()] == ["analysis joins samples to the analysed steps"]
    assert s["metrics"]["stragglers"]["steps_analysed"] == [4]
    # samples whose step no step record has: not joined to steps
    tel = run / "ranks" / "rank-00000" / "telemetry.jsonl"
    recs = [json.loads(x) for x in tel.read_text().splitlines()]
    tel.write_text("".join(json.dumps({**x, "step": 1000 + i}) + "\n" for i, x in enumerate(recs)))
    v = Verdict()
    veval.eval_telemetry(v, run, s, cuda=True)
    assert any("every sample's step" in c for c in v.failed())


def _validate(*args, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "validate.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_validate_refuses_before_running_anything(tmp_path):
    import torch

    # no CUDA and no --dry-run: exit 2 naming --dry-run (on a GPU machine this would run the suite)
    if not torch.cuda.is_available():
        r = _validate("--out", "o", tmp_path=tmp_path)
        assert r.returncode == 2 and "--dry-run" in r.stderr
    # a dry run never writes into the repo's tests/
    r = _validate("--dry-run", "--out", "o", "--fixtures", str(GPU / "validated"), tmp_path=tmp_path)
    assert r.returncode == 2 and "never writes into the repo" in r.stderr
    r = _validate("--dry-run", "--out", "o", "--only", "nan,bogus", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown check(s) bogus" in r.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_two_rank_criterion_wants_data_starvation_of_that_rank_alone(tmp_path):
    run = tmp_path / "run"
    for r in (0, 1):
        (run / "ranks" / f"rank-{r:05d}").mkdir(parents=True)
        (run / "ranks" / f"rank-{r:05d}" / "meta.json").write_text(json.dumps({"device": "cuda:0",
                                                                               "device_name": "NVIDIA H200"}))
    inj = {"kind": "slow_data", "performed": True, "ranks": [1], "params": {"rank": 1, "delay_ms": 100}}
    (run / "injected.json").write_text(json.dumps({"injections": [inj]}))

    def summary(*found):
        s = _summary([{"kind": k, "ranks": rs, "severity": "warning", "evidence": {}} for k, rs in found])
        s["run"].update(world_size=2, backend="gloo")
        return s

    for found, ok in [([("data_starvation", [1])], True), ([("data_starvation", [0, 1])], False),
                      ([("data_starvation", [1]), ("straggler", [1])], False), ([("straggler", [1])], False)]:
        v = Verdict()
        veval.eval_two_ranks(v, run, summary(*found), cuda=True, rank=1)
        assert v.ok is ok, (found, v.failed())


def test_reference_criterion_fails_on_a_fault_finding_or_a_cpu_trace(tmp_path):
    run = _run(tmp_path, [], {"device": "cuda:0", "device_name": "NVIDIA H200"})
    metrics = {"comm_compute": {"job": {"trace_kind": "gpu"}}, "step_time": {"job": {"steps_recorded": 12,
                                                                                      "median_ms": 40.0}},
               "ops": {"job": {"kernels_per_step": 900.0}}}
    v = Verdict()
    veval.eval_reference(v, run, _summary([], **metrics), cuda=True, steps=12)
    assert v.ok, v.failed()
    v = Verdict()
    veval.eval_reference(v, run, _summary([{"kind": "hang", "ranks": [0]}], **metrics), cuda=True, steps=12)
    assert [c.split(" (")[0] for c in v.failed()] == ["clean run: no fault finding"]
    metrics["comm_compute"]["job"]["trace_kind"] = "cpu"
    v = Verdict()
    veval.eval_reference(v, run, _summary([], **metrics), cuda=True, steps=12)
    assert [c.split(" (")[0] for c in v.failed()] == ["profiler trace of kind gpu"]
