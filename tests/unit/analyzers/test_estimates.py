"""The estimate models (analyzers/estimates.py) on hand-computed timelines, the data-loading rule
by saving and start-up windows on GPU traces (analyzers/launch.py), and fix/estimate/actions on
every finding (analyzers/advice.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from trainprof.analyzers import advice, estimates as est

from paths import FIXTURES
H100 = FIXTURES / "gpu" / "h100_item_sync.pt.trace.json.gz"
ALEXNET = FIXTURES / "hta" / "critical_path" / "alexnet"


def _strag(busy, data, wait):
    n = len(next(iter(busy.values())))
    return {"steps": list(range(1, n + 1)), "steps_analysed": list(range(1, n + 1)),
            "busy_ms_by_rank": busy, "data_ms_by_rank": data, "wait_ms_by_rank": wait,
            "peer_groups": {r: "all" for r in busy}}


def test_estimate_record_and_clipping():
    e = est.estimate(100.0, 60.0, "m", ["a"], "b")
    assert e == {"step_ms_before": 100.0, "step_ms_after": 60.0, "saving_ms": 40.0,
                 "saving_fraction": 0.4, "model": "m", "assumptions": ["a"], "basis": "b"}
    assert est.estimate(100.0, 130.0, "m", [], "b")["saving_ms"] == 0.0  # never longer
    assert est.estimate(None, 1.0, "m", [], "b") is None
    assert est.estimate(0.0, 0.0, "m", [], "b") is None


def test_data_wait_removed_replays_the_lockstep_steps():
    # rank 1 waits 50 ms for input each step; rank 0 waits for rank 1 in the all-reduce
    busy = {"0": [60.0, 62.0, 61.0], "1": [58.0, 59.0, 63.0]}
    data = {"0": [0.0, 0.0, 0.0], "1": [50.0, 50.0, 50.0]}
    wait = {"0": [50.0, 49.0, 54.0], "1": [2.0, 2.0, 2.0]}
    e = est.data_wait_removed(_strag(busy, data, wait), 112.0)
    # per step: max(own) − max(busy): 108−60, 109−62, 113−63 → 48, 47, 50: median 48
    assert e["saving_ms"] == pytest.approx(48.0)
    assert e["step_ms_after"] == pytest.approx(64.0)
    assert e["saving_fraction"] == pytest.approx(48 / 112, abs=1e-4)


def test_straggler_removed_keeps_its_variation_and_waits_for_the_slowest():
    busy = {"0": [60.0, 70.0, 60.0], "1": [100.0, 101.0, 99.0]}  # rank 1: +40 ms own time
    zero = {"0": [0.0] * 3, "1": [0.0] * 3}
    e = est.straggler_removed(_strag(busy, zero, zero), 103.0, {"rank": 1, "peers": [0]})
    # excess per step 40, 31, 39 → median 39; after: max(61, 60), max(62, 70), max(60, 60)
    # → savings 39, 31, 39 → median 39
    assert e["saving_ms"] == pytest.approx(39.0)
    assert e["step_ms_after"] == pytest.approx(64.0)
    # without the matrices: the median excess from the evidence
    e = est.straggler_removed({}, 103.0, {"rank": 1, "peers": [0], "excess_ms": 40.0})
    assert e["step_ms_after"] == pytest.approx(63.0)


def test_host_side_fixes_are_bounded_by_the_device():
    row = {"rank": 0, "host_ms_per_step": 100.0, "gpu_busy_ms_per_step": 61.0, "data_share": 0.334,
           "sync_share": 0.0, "kernels_per_step": 500}
    e = est.data_loading_trace(row)
    assert e["step_ms_after"] == pytest.approx(66.6) and e["saving_fraction"] == pytest.approx(0.334)
    row["data_share"] = 0.6  # the device's busy time bounds it
    assert est.data_loading_trace(row)["step_ms_after"] == pytest.approx(61.0)
    row.update(data_share=0.0)
    g = est.cuda_graphs(row)  # device busy + 500 kernels × 2 µs
    assert g["step_ms_after"] == pytest.approx(62.0)


def test_exposed_comm_overlap_bound_and_pipeline_micro_batches():
    e = est.exposed_comm_hidden({"rank": 0, "step_window_ms": 200.0, "exposed_comm_fraction": 0.5,
                                 "compute_fraction": 0.3})
    assert e["step_ms_after"] == pytest.approx(140.0)  # at most the compute: 0.3 × 200
    # the last collective's exposed 25 % stays: 0.5 − 0.25 hidden, under 0.3 of compute
    e = est.exposed_comm_hidden({"rank": 0, "step_window_ms": 200.0, "exposed_comm_fraction": 0.5,
                                 "compute_fraction": 0.3, "tail_exposed_fraction": 0.25})
    assert e["step_ms_after"] == pytest.approx(150.0)
    pipe = {"bubble_fraction": 0.4, "decomposition": {"handovers": 0.1},
            "config": {"micro_batches": 4}, "per_stage": [{"window_ms": 100.0}, {"window_ms": 100.0}]}
    e = est.more_micro_batches(pipe, 120.0)
    # busy 60, fill/drain 30 → 15, hand-overs 10 → 20: window 95, step 120 − 5
    assert e["step_ms_after"] == pytest.approx(115.0)


def _dataloader_trace(tmp_path: Path, share: float) -> Path:
    """The H100 trace with an enumerate(DataLoader) span over `share` of each host step (the
    device's work and idle unchanged: 45 % idle, under the 50 % the idle rule needed)."""
    d = json.loads(gzip.open(H100).read())
    extra = []
    for e in d["traceEvents"]:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#"):
            extra.append({**e, "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                          "dur": e["dur"] * share, "args": {}})
    d["traceEvents"] += extra
    out = tmp_path / "dl.pt.trace.json"
    out.write_text(json.dumps(d))
    return out


def _analyze(path, tmp_path):
    from trainprof.analysis.runner import analyze
    from trainprof.analysis.run import RunDir

    return analyze(RunDir(path))


def test_a_third_of_the_step_in_the_dataloader_is_a_finding_whatever_the_idle(tmp_path):
    s = _analyze(_dataloader_trace(tmp_path, 1 / 3), tmp_path)
    assert s["metrics"]["launch"]["per_rank"][0]["idle_fraction"] < 0.5
    f = [x for x in s["findings"] if x["kind"] == "device_starved"]
    assert len(f) == 1 and f[0]["evidence"]["cause"] == "data_loader", s["findings"]
    e = f[0]["estimate"]
    assert e["saving_fraction"] == pytest.approx(1 / 3, abs=0.02)
    assert "num_workers" in f[0]["fix"]
    assert s["actions"][0]["kind"] == "device_starved" and s["actions"][0]["finding"] == 0
    # 2 % in the data loader saves too little: no finding, no action
    s = _analyze(_dataloader_trace(tmp_path, 0.02), tmp_path)
    assert not [x for x in s["findings"] if x["kind"] == "device_starved"] and not s["actions"]


def test_start_up_window_is_recognised_not_diagnosed(tmp_path):
    s = _analyze(ALEXNET, tmp_path)
    # a 30 s runtime call in the only profiled step: context set-up, not a launch-bound step
    assert not [x for x in s["findings"] if x["kind"] == "device_starved"]
    su = s["metrics"]["launch"]["job"]["start_up"]
    assert su["ranks"] == [0] and su["longest_call_ms"] > 10_000 and "start-up" in su["text"]


def test_every_finding_gets_a_fix_and_actions_are_ranked_by_saving():
    metrics = {"step_time": {"job": {"median_ms": 100.0, "mean_ms": 130.0}},
               "comm_compute": {"per_rank": [{"rank": 0, "step_window_ms": 100.0,
                                              "sync_ms_per_step": 20.0, "idle_fraction": 0.1}]}}
    findings = [{"kind": "host_stall", "severity": "warning", "ranks": [0], "message": "m1; more",
                 "evidence": {}, "analyzer": "comm_compute"},
                {"kind": "slow_steps", "severity": "warning", "ranks": [], "message": "m2 — more",
                 "evidence": {}, "analyzer": "slow_steps"},
                {"kind": "nan_origin", "severity": "critical", "ranks": [1], "message": "m3",
                 "evidence": {}, "analyzer": "nan_origin"}]
    acts = advice.advise(metrics, findings)
    assert all(f["fix"] for f in findings)
    assert findings[2]["estimate"] is None  # a NaN is not about speed
    assert [a["kind"] for a in acts] == ["slow_steps", "host_stall"]  # 23 % before 20 %
    assert acts[0]["saving_ms"] == pytest.approx(30.0) and acts[0]["evidence"] == "m2"
    assert acts[1]["step_ms_after"] == pytest.approx(90.0) and acts[1]["evidence"] == "m1"
    assert acts[1]["section"] == "s-comm_compute"
    # a finding whose fix saves < 5 % is info, and no action
    metrics["comm_compute"]["per_rank"][0]["sync_ms_per_step"] = 2.0
    f = [{"kind": "host_stall", "severity": "warning", "ranks": [0], "message": "m", "evidence": {}}]
    assert advice.advise(metrics, f) == [] and f[0]["severity"] == "info"


def test_amp_for_fp32_tensor_core_work_is_priced_and_raised():
    # the plugin's example: 68 % of kernel time in tensor-core-eligible fp32 ops, on an H100
    metrics = {"gpu_overview": {"job": {"step_ms": 100.0, "kernel_ms": 80.0, "tc_eligible_fp32_share": 0.68,
                                        "devices": ["NVIDIA H100 80GB HBM3"]}},
               "launch": {"per_rank": [{"rank": 0, "host_ms_per_step": 30.0}]}}
    findings: list[dict] = []
    acts = advice.advise(metrics, findings)
    (f,) = findings
    assert f["kind"] == "roofline" and "autocast" in f["fix"]
    # 80 × 0.68 = 54.4 ms of eligible kernels; fp32/bf16 peak 67/989 < 0.5 → half of it saved
    assert f["estimate"]["step_ms_after"] == pytest.approx(72.8)
    assert acts[0]["kind"] == "roofline"
    # nearly host-bound (host 98 ms): the same kernels buy 2 %, under the 5 % worth raising
    metrics["launch"]["per_rank"][0]["host_ms_per_step"] = 98.0
    findings = []
    assert advice.advise(metrics, findings) == [] and findings == []


def test_ddp_buckets_merged_replay_by_hand():
    """Two ranks, two steps, four 1 KB buckets launched 1 ms apart; each all-reduce takes 3 ms
    (the process group runs them one after the other): span = launch 0 → 3 + 3 + 3 + 3 = 12 ms
    (the queue never empties). Merged into one bucket of 4 KB launched at 3 ms (its last
    member): 3 + alpha 3 ms = 6 ms. Saving 6 ms of a 50 ms step."""
    import pandas as pd

    from trainprof.analyzers import _ddp_buckets

    recs = []
    for rank in (0, 1):
        for step in (1, 2):
            t0 = step * 1_000_000_000
            for i in range(4):
                recs.append({"rank": rank, "step": step, "api": "ddp.bucket", "bucket": i,
                             "bytes": 1024, "enqueue_ns": t0 + i * 1_000_000,
                             "end_ns": t0 + (i + 1) * 3_000_000})
    # one 16 KB bucket elsewhere in step 1 of rank 0 is not a DDP bucket: ignored
    recs.append({"rank": 0, "step": 1, "api": None, "bucket": None, "bytes": 16384,
                 "enqueue_ns": 1_000_000_000, "end_ns": 1_050_000_000})
    m = _ddp_buckets.measure(pd.DataFrame(recs), [1, 2], cap_bytes=100)
    assert m["buckets_per_step"] == 4 and m["buckets_after"] == 1
    assert m["alpha_ms"] == pytest.approx(3.0) and m["beta_ms_per_mb"] == 0.0
    assert m["gap_ms"] == pytest.approx(1.0) and m["cap_bytes"] == 100
    assert m["target_cap_bytes"] == 25 << 20
    row = m["per_rank_step"][0]
    assert row["span_ms"] == pytest.approx(12.0) and row["span_ms_after"] == pytest.approx(6.0)
    e = est.ddp_buckets_merged(m, 50.0)
    assert e["step_ms_after"] == pytest.approx(44.0) and e["saving_ms"] == pytest.approx(6.0)
    # with the steps' own times, each step replayed: max over ranks of step − 12 + 6
    steps = pd.DataFrame([{"rank": r, "step": s, "dur_ms": d} for r, s, d in
                          ((0, 1, 50.0), (1, 1, 53.0), (0, 2, 47.0), (1, 2, 46.0))])
    m = _ddp_buckets.measure(pd.DataFrame(recs), [1, 2], cap_bytes=100, steps=steps)
    e = est.ddp_buckets_merged(m, 50.0)  # steps 47 and 41: median 44
    assert e["step_ms_after"] == pytest.approx(44.0)
    e = est.ddp_buckets_merged(m, 53.0)
    assert e["step_ms_before"] == 53.0 and e["saving_ms"] == pytest.approx(9.0)
    # the plan: first bucket capped at 1 MiB, then the cap; a bucket over the cap stays whole
    sizes = np.array([600_000.0, 600_000.0, 30e6, 10.0])
    assert _ddp_buckets.plan(sizes, 25 << 20) == [(0, 600_000.0), (1, 600_000.0), (2, 30e6), (3, 10.0)]
    assert _ddp_buckets.plan(np.array([1e5] * 4), 25 << 20) == [(3, 4e5)]
    # buckets already as large as the cap makes them: nothing to estimate
    one = [dict(r, bucket=0) for r in recs if r["api"] and r["bucket"] == 0]
    m1 = _ddp_buckets.measure(pd.DataFrame(one), [1, 2])
    assert m1["buckets_after"] == 1 and est.ddp_buckets_merged(m1, 50.0) is None


def test_ddp_bucket_service_time_fit():
    """alpha + beta × bytes through the median service time of each size."""
    from trainprof.analyzers import _ddp_buckets

    sizes = np.array([1e3] * 5 + [1e6] * 5)
    service = 2e5 + 3.0 * sizes  # 0.2 ms + 3 ns per byte
    service[0] *= 40  # a stall: the medians keep it out
    alpha, beta = _ddp_buckets._fit(sizes, service)
    assert beta == pytest.approx(3.0) and alpha == pytest.approx(2e5)
