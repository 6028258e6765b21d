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


def test_overlap_bound_credits_chained_waits_and_host_delay_under_idle_time():
    """What the peer-arrival rule left out of the rank's own exposed share (0.1 of 0.5): waits
    for a peer still in its previous collective's transfer (0.1) and host delay (0.15). The last
    collective's 0.05 stays. Fails on a bound that reads neither."""
    row = {"rank": 0, "step_window_ms": 200.0, "exposed_comm_fraction": 0.5,
           "tail_exposed_fraction": 0.05, "compute_fraction": 0.1,
           "chained_transfer_fraction": 0.1, "host_delay_fraction": 0.15, "idle_host_fraction": 0.3}
    # transfer 0.1 − 0.05 + 0.1 = 0.15; the delay 0.15 only under idle (0.3): hidden
    # min(0.15 + min(0.15, 0.3), 0.1 + 0.3) = 0.3 → 200 − 60
    e = est.exposed_comm_hidden(row, 0.1)
    assert e["step_ms_after"] == pytest.approx(140.0)
    assert any("host sleeps or waits" in a for a in e["assumptions"])
    # busy compute only: the delay stays (the cores stay contended); the transfer fills the
    # compute: min(0.15, 0.1) → 200 − 20
    assert est.exposed_comm_hidden(dict(row, idle_host_fraction=0.0), 0.1)["step_ms_after"] == \
        pytest.approx(180.0)
    # never more than the time to hide under: compute 0 and idle 0.05 → 10 ms
    assert est.exposed_comm_hidden(dict(row, compute_fraction=0.0, idle_host_fraction=0.05),
                                   0.1)["step_ms_after"] == pytest.approx(190.0)
    # credits beyond what the rule left out (0.5 − 0.05 − 0.05 = 0.4) are scaled to it:
    # chained 0.4 and delay 0.4 → 0.2 each; plenty of time: 0.05 + 0.2 + 0.2 = 0.45 → 110
    big = dict(row, chained_transfer_fraction=0.4, host_delay_fraction=0.4, idle_host_fraction=0.9)
    assert est.exposed_comm_hidden(big, 0.1)["step_ms_after"] == pytest.approx(110.0)
    # a peer's delay it waited for counts as delay: hidden only under idle time
    row2 = dict(row, chained_transfer_fraction=0.0, chained_delay_fraction=0.1,
                host_delay_fraction=0.0, idle_host_fraction=0.0, compute_fraction=0.5)
    assert est.exposed_comm_hidden(row2, 0.1)["step_ms_after"] == pytest.approx(190.0)
    assert est.exposed_comm_hidden(dict(row2, idle_host_fraction=0.2), 0.1)["step_ms_after"] == \
        pytest.approx(170.0)
    # the pure assignment: transfer under compute or idle, delay under idle only
    assert est.overlap_hidden(10, 10, 5, 3) == pytest.approx(8)      # all the cover
    assert est.overlap_hidden(2, 10, 5, 3) == pytest.approx(5)       # 2 + the idle 3
    assert est.overlap_hidden(0, 10, 50, 0) == 0.0                   # delay under busy: none


def test_overlap_credit_pieces_on_hand_timelines():
    from trainprof.analyzers import _overlap_credit as oc
    # intersections with a set [10, 20) ∪ [30, 50): [15, 35) → 5 + 5; [0, 100) → 30; key 9: none
    sets = {1: (np.array([10, 30]), np.array([20, 50]))}
    assert oc.covered([15, 0, 0, 40], [35, 100, 100, 40], sets, [1, 1, 9, 1]).tolist() == [10, 30, 0, 0]
    # the split: waits until the last other arrival; past it, the time beyond the 10th
    # percentile of the same kind (6 records of 100 µs past the arrival but one of 150) is the
    # host's delay
    total = [0.1, 0.15, 0.15, 0.1, 0.1, 0.1, 0.05]
    t_enq = [0.0, 0.0, 1.0, 1.05, 2.0, 2.0, 3.0]
    t_last = [0.0, 0.0, 1.05, 1.0, 2.0, 2.0, 3.0]
    wait, late = oc.split_waits(total, t_enq, t_last, ["g"] * 7, ["all_reduce"] * 6 + ["send"], [1024] * 7)
    assert wait == pytest.approx([0, 0, 0.05, 0, 0, 0, 0])
    assert late == pytest.approx([0, 0.05, 0, 0, 0, 0, 0])  # "b": one record, no quantile
    # who a record waits for: 3 members arriving at 5 (rank 2), 3 (rank 0), 1 (rank 1)
    top = oc.last_arrivals(["g"] * 3, [0, 0, 0], [0, 1, 2], [3.0, 1.0, 5.0])
    row = top.loc[("g", 0)]
    assert (row["r1"], row["t1"], row["r2"], row["t2"], row["r3"], row["t3"]) == (2, 5.0, 0, 3.0, 1, 1.0)
    last_r, last_t, second = oc.waited_for(
        [0, 1, 2], *[[row[k]] * 3 for k in ("r1", "t1", "r2", "t2", "r3", "t3")])
    assert last_r.tolist() == [2, 2, 0] and last_t.tolist() == [5.0, 5.0, 3.0]
    assert second.tolist() == [1.0, 3.0, 1.0]  # rank 1 waits for rank 2 alone only after 3
    # chained: rank 0 waits [1.0, 1.5) ms for rank 1, which was in its previous collective's
    # transfer until 1.2 ms and its host's delay until 1.4 ms, then ran its own code
    ms = lambda a, b: (np.array([round(a * 1e6)]), np.array([round(b * 1e6)]))  # noqa: E731
    ch_t, ch_d = oc.chained([1.0], [0.5], [1], [-np.inf], {1: ms(0.5, 1.2)}, {1: ms(1.2, 1.4)})
    assert (ch_t.tolist(), ch_d.tolist()) == ([200_000], [200_000])
    # the same wait for a peer that was computing (a straggler): nothing chained
    ch_t, ch_d = oc.chained([1.0], [0.5], [1], [-np.inf], {1: ms(0.2, 0.8)}, {1: ms(0.8, 0.9)})
    assert (ch_t.tolist(), ch_d.tolist()) == ([0], [0])
    # idle host: 800 µs off the CPU less 400 exposed and 50 input → 350, at most "other"
    assert oc.idle_host_ms(0.8, 0.4, 0.05, 0.43) == pytest.approx(0.35)
    assert oc.idle_host_ms(0.8, 0.4, 0.0, 0.3) == pytest.approx(0.3)
    assert oc.idle_host_ms(0.3, 0.4, 0.0, 0.5) == 0.0
    # off-CPU time from step records weighted by overlap: a 10 ms step (6 on CPU, 1 waiting
    # for one) half inside the window → 1.5 ms
    assert oc.off_cpu_ms(5, 15, [(0, 10, 10.0, 6.0, 1.0)]) == pytest.approx(1.5)
    assert oc.off_cpu_ms(5, 15, [(0, 10, 10.0, float("nan"), 1.0)]) is None


def _cpu_job(root: Path, ranks: dict, cpu_ms: float | None):
    """Two CPU ranks, one 1000 µs profiled step each (T µs on the trace's and the log's clock):
    per rank, a 400 µs sleep in backward (a Python function: neither compute nor
    communication), 50 µs of compute, blocking all-reduces (enqueue, end µs; the log's records;
    the trace's c10d/gloo spans), extra compute spans, and 120 µs of compute at the end;
    steps.jsonl's on-CPU time for the step (``cpu_ms``; none when None)."""
    from trainprof.analysis.run import RunDir
    from trainprof.rundir.files import profiler_trace_path, rank_dir, write_json_atomic
    T = 1_000_000
    X = lambda n, c, ts, dur, tid=1: {"ph": "X", "name": n, "cat": c, "ts": ts, "dur": dur,  # noqa: E731
                                      "pid": 1, "tid": tid, "args": {}}
    for r, (colls, extra) in ranks.items():
        ev = [X("ProfilerStep#1", "user_annotation", T, 1000),
              X("autograd::engine::evaluate_function: SlowBackwardBackward", "cpu_op", T, 400),
              X("aten::mm", "cpu_op", T + 400, 50), X("aten::mm", "cpu_op", T + 880, 120)]
        ev += [X("aten::mm", "cpu_op", T + a, b - a) for a, b in extra]
        for a, b, _ in colls:
            ev += [X("c10d::allreduce_", "cpu_op", T + a, b - a),
                   X("gloo:all_reduce", "user_annotation", T + a, b - a, tid=2)]
        p = profiler_trace_path(root, r)
        p.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(p, "wt") as fh:
            json.dump({"distributedInfo": {"rank": r, "world_size": 2, "backend": "gloo"},
                       "traceEvents": ev}, fh)
        d = rank_dir(root, r)
        write_json_atomic(d / "meta.json", {"rank": r, "world_size": 2})
        log = [{"step": 1, "pg": "0", "seq": i, "op": "all_reduce", "bytes": nb,
                "enqueue_ns": (T + a) * 1000, "end_ns": (T + b) * 1000, "blocked_ms": (b - a) / 1000,
                "async": False} for i, (a, b, nb) in enumerate(colls)]
        (d / "collectives.jsonl").write_text("".join(json.dumps(c) + "\n" for c in log))
        (d / "groups.jsonl").write_text(json.dumps({"pg": "0", "ranks": [0, 1], "size": 2,
                                                    "backend": "gloo"}) + "\n")
        if cpu_ms is not None:
            (d / "steps.jsonl").write_text(json.dumps(
                {"step": 1, "start_ns": T * 1000, "end_ns": (T + 1000) * 1000, "dur_ms": 1.0,
                 "source": "optimizer", "cpu_ms": cpu_ms, "cpu_wait_ms": 0.0}) + "\n")
    return RunDir(root)


def test_overlap_bound_of_back_to_back_all_reduces_on_a_run(tmp_path):
    """Four back-to-back all-reduces after a 400 µs sleep in backward (µs): rank 1's first one
    ends 50 µs after rank 0's (its host's delay: 150 µs past the arrival where the others of
    that size take 100), so rank 0 waits in the second from 560 until rank 1 arrives at 610:
    40 µs of it while rank 1 is still in that delay (chained), 10 while it runs its own code.

        rank 0: A 450-550, B 560-710, C 720-820, D 830-880 (4 KiB, the last: no other of its size)
        rank 1: A 450-600, B 610-710, C 720-820, D 830-880

    Each rank: exposed 400 µs (40 %), the last collective 50 (5 %), compute 170 (17 %); the
    peer-arrival rule leaves out rank 0's 50 µs wait and rank 1's 50 µs delay: 35 % its own.
    The bound without credits: min(35 − 5, 17) = 17 %. steps.jsonl: 200 µs on a CPU, none
    waiting for one → off-CPU 800 − exposed 400 = 400 µs idle (the sleep; ≤ the trace's other
    430 µs). Rank 0: transfer 30 %, delay 4 % (chained) → min(30 + 4, 17 + 40) = 34 %; rank 1:
    30 % + its own delay 5 % → 35 %; the job takes the lower: 34 %."""
    colls = {0: ([(450, 550, 4), (560, 710, 4), (720, 820, 4), (830, 880, 4096)], []),
             1: ([(450, 600, 4), (610, 710, 4), (720, 820, 4), (830, 880, 4096)], [])}
    from trainprof.analyzers import comm_compute
    res = comm_compute.analyze(_cpu_job(tmp_path / "idle", colls, cpu_ms=0.2))
    per = {r["rank"]: r for r in res.metrics["per_rank"]}
    assert [per[r]["exposed_comm_fraction"] for r in (0, 1)] == pytest.approx([0.4, 0.4])
    assert [per[r]["peer_arrival_wait_fraction"] for r in (0, 1)] == pytest.approx([0.05, 0.05])
    assert per[0]["chained_delay_fraction"] == pytest.approx(0.04)
    assert per[0]["chained_transfer_fraction"] == 0.0 and per[0]["host_delay_fraction"] == 0.0
    assert per[1]["host_delay_fraction"] == pytest.approx(0.05) and per[1]["chained_delay_fraction"] == 0.0
    assert [per[r]["idle_host_fraction"] for r in (0, 1)] == pytest.approx([0.4, 0.4])
    (f,) = [f for f in res.findings if f.kind == "exposed_comm"]
    assert f.estimate["saving_fraction"] == pytest.approx(0.34, abs=1e-3)
    assert f.estimate["step_ms_after"] == pytest.approx(0.66, abs=1e-3)
    # the same job busy the whole step (on a CPU all the time it is not blocked): no idle time,
    # the delays stay; the compute bounds it: 17 %
    res = comm_compute.analyze(_cpu_job(tmp_path / "busy", colls, cpu_ms=0.6))
    (f,) = [f for f in res.findings if f.kind == "exposed_comm"]
    assert f.estimate["saving_fraction"] == pytest.approx(0.17, abs=1e-3)
    # rank 1 late from its own work (it computes 550-610 after an A that ends with rank 0's):
    # rank 0's 50 µs wait is a straggler's, not communication: nothing chained, nothing
    # delayed (every 4-byte all-reduce takes 100 µs past the arrival): 30 % + 0 → 30 % (rank
    # 0's), and rank 1 computes 60 µs more
    strag = {0: colls[0], 1: ([(450, 550, 4), (610, 710, 4), (720, 820, 4), (830, 880, 4096)], [(550, 610)])}
    res = comm_compute.analyze(_cpu_job(tmp_path / "straggler", strag, cpu_ms=0.2))
    per = {r["rank"]: r for r in res.metrics["per_rank"]}
    assert per[0]["peer_arrival_wait_fraction"] == pytest.approx(0.05)
    assert not any(per[0].get(k) for k in ("chained_transfer_fraction", "chained_delay_fraction",
                                            "host_delay_fraction"))
    (f,) = [f for f in res.findings if f.kind == "exposed_comm"]
    assert f.estimate["saving_fraction"] == pytest.approx(0.30, abs=1e-3)


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
    # the NaN first (the job computes wrong values), then 23 % before 20 %
    assert [a["kind"] for a in acts] == ["nan_origin", "slow_steps", "host_stall"]
    assert acts[0]["saving_ms"] is None and acts[0]["severity"] == "critical"
    assert acts[0]["blocked"] == "the training computes non-finite values"
    acts = acts[1:]
    assert acts[0]["saving_ms"] == pytest.approx(30.0) and acts[0]["evidence"] == "m2"
    assert acts[1]["step_ms_after"] == pytest.approx(90.0) and acts[1]["evidence"] == "m1"
    assert acts[1]["section"] == "s-comm_compute" and "blocked" not in acts[1]
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


def test_a_failed_job_leads_and_info_never_leads_a_warning():
    """A crashed run (a rank failed, the others waited in a desynchronized collective) with a
    host-contention straggler (info: a shared host's doing) that prices at 24 % and a slow-steps
    warning at 10 %: the failure leads, then the warning, then the info finding."""
    metrics = {"step_time": {"job": {"median_ms": 100.0, "mean_ms": 110.0}}}
    strag = {"step_ms_before": 25.3, "step_ms_after": 19.3, "saving_ms": 6.0,
             "saving_fraction": 0.238, "model": "m", "assumptions": [], "basis": "b"}
    findings = [{"kind": "rank_failure", "severity": "error", "ranks": [0],
                 "message": "Rank failure: rank 0 was the first to fail; more", "evidence": {},
                 "analyzer": "hang"},
                {"kind": "straggler", "severity": "info", "ranks": [1], "message": "rank 1 is slow",
                 "evidence": {}, "analyzer": "stragglers", "estimate": strag},
                {"kind": "slow_steps", "severity": "warning", "ranks": [], "message": "m2",
                 "evidence": {}, "analyzer": "slow_steps"},
                {"kind": "hang", "severity": "critical", "ranks": [1], "message": "rank 1 hung",
                 "evidence": {}, "analyzer": "hang"}]
    acts = advice.advise(metrics, findings)
    assert [(a["kind"], a["severity"]) for a in acts] == [
        ("hang", "critical"), ("rank_failure", "error"), ("slow_steps", "warning"),
        ("straggler", "info")]
    assert [a["finding"] for a in acts] == [3, 0, 2, 1]
    assert acts[0]["blocked"] == "the job hung" and acts[1]["blocked"] == "the job did not finish"
    assert acts[1]["fix"].startswith("read the failed rank's error")
    assert acts[1]["evidence"] == "Rank failure: rank 0 was the first to fail"
    assert acts[2]["saving_fraction"] == pytest.approx(10 / 110, abs=1e-3)
    assert acts[3]["saving_fraction"] == pytest.approx(0.238)
    # a recovered hang (warning, no saving) is no action
    findings[3]["severity"] = "warning"
    assert [a["kind"] for a in advice.actions(findings)] == ["rank_failure", "slow_steps", "straggler"]
