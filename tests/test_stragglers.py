"""stragglers analyzer: hand-built 8-rank runs (busy = step − blocked − data wait, scores
hand-computed), and the reference workload with injected ground truth: one straggler for two
different ranks, a clean run silent, stage imbalance and input starvation told apart."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import run_cli
from runs import straggler_delay_ms, straggler_run
from trainprof.analyzers import stragglers
from trainprof.rundir import JsonlWriter, RunDir, rank_dir, write_json_atomic

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
STEP_MS = 1000.0


def coords(r):  # dp2 · pp2 · tp2, row-major like init_device_mesh
    return {"dp": r // 4, "pp": (r // 2) % 2, "tp": r % 2}


def make_run(root, busy, data=None, steps=6):
    """busy[rank][step] = ms of work; the rest of the 1000 ms step is blocked in a collective
    (or waiting for data, data[rank][step] ms)."""
    data = data or {}
    for r in range(8):
        d = rank_dir(root, r)
        write_json_atomic(d / "meta.json", {"rank": r, "world_size": 8, "coords": coords(r),
                                            "host": f"node{r // 4}",
                                            "pipeline": {"stages": [coords(r)["pp"]]}})
        ws, wc, wd = (JsonlWriter(d / f"{n}.jsonl") for n in ("steps", "collectives", "data"))
        for s in range(steps):
            start = T0 + s * int(STEP_MS * MS)
            ws.write({"step": s, "start_ns": start, "end_ns": start + int(STEP_MS * MS),
                      "dur_ms": STEP_MS, "source": "optimizer"})
            wait = data.get(r, {}).get(s, 0.0)
            wd.write({"step": s, "wait_ms": wait, "batches": 1})
            blocked = STEP_MS - busy[r][s] - wait
            wc.write({"step": s, "pg": "0", "seq": s, "op": "all_reduce", "bytes": 8,
                      "enqueue_ns": start + int((STEP_MS - blocked) * MS),
                      "end_ns": start + int(STEP_MS * MS), "blocked_ms": blocked})
        for w in (ws, wc, wd):
            w.close()
    return RunDir(root)


def add_telemetry(root, rank, steps=6, clock=1980, throttle=()):
    w = JsonlWriter(rank_dir(root, rank) / "telemetry.jsonl")
    for s in range(steps):
        w.write({"t_ns": T0 + s * int(STEP_MS * MS), "step": s, "sm_clock_mhz": clock,
                 "temp_c": 60, "power_w": 300.0, "throttle": ["gpu_idle", *throttle]})
    w.close()


def noisy_busy(seed=0, steps=6):
    rng = np.random.default_rng(seed)
    return {r: list(500 + rng.normal(0, 15, steps)) for r in range(8)}


def test_straggler_by_hand(tmp_path):
    busy = noisy_busy()
    for s in range(6):
        busy[5][s] += 200
    res = stragglers.analyze(make_run(tmp_path, busy))
    found = [f for f in res.findings if f.kind == "straggler"]
    assert len(found) == 1 and found[0].ranks == [5]
    ev = found[0].evidence
    assert ev["coords"] == {"dp": 1, "pp": 0, "tp": 1} and ev["host"] == "node1"
    assert ev["peers"] == [0, 1, 4]  # the other pp-0 ranks
    # hand computation of the score over the analysed steps 1..5
    steps = range(1, 6)
    groups = {r: [q for q in range(8) if coords(q)["pp"] == coords(r)["pp"]] for r in range(8)}
    med = {r: float(np.median([busy[r][s] - np.median([busy[q][s] for q in groups[r]]) for s in steps]))
           for r in range(8)}
    v = np.array(list(med.values()))
    scale = max(1.4826 * np.median(np.abs(v - np.median(v))), stragglers.FLOOR * STEP_MS)
    m = res.metrics
    p5 = next(p for p in m["per_rank"] if p["rank"] == 5)
    assert p5["excess_ms"] == pytest.approx(med[5])
    assert p5["score"] == pytest.approx(med[5] / scale)
    assert p5["status"] == "chronic" and p5["straggling_steps"] == [1, 2, 3, 4, 5]
    assert m["steps_analysed"] == [1, 2, 3, 4, 5]
    assert m["busy_ms_by_rank"]["5"][0] == pytest.approx(busy[5][1])
    json.dumps(m)


def test_transient_and_clean_are_silent(tmp_path):
    busy = noisy_busy(1)
    busy[3][2] += 400  # one bad step only: transient, not a finding
    res = stragglers.analyze(make_run(tmp_path, busy))
    assert not res.findings
    assert res.metrics["transient"] == [3] and res.metrics["chronic"] == []


def test_data_wait_is_starvation_not_straggling(tmp_path):
    busy = noisy_busy(2)
    data = {2: {s: 300.0 for s in range(6)}}
    res = stragglers.analyze(make_run(tmp_path, busy, data))
    assert [f.kind for f in res.findings] == ["data_starvation"]
    f = res.findings[0]
    assert f.ranks == [2] and f.evidence["ranks"]["2"]["data_wait_ms"] == pytest.approx(300)


def test_whole_stage_slow_is_not_a_straggler(tmp_path):
    busy = noisy_busy(3)
    for r in range(8):
        if coords(r)["pp"] == 1:
            busy[r] = [b + 300 for b in busy[r]]
    assert not stragglers.analyze(make_run(tmp_path, busy)).findings


DATA_SCRIPT = r"""
import json, sys, time
from pathlib import Path
import torch
from torch.utils.data import DataLoader, Dataset
from trainprof.probes import dataloader
from trainprof.rundir import JsonlWriter

class Clock:
    step = 0

class Session:  # the parts of ProbeSession the probe uses
    def __init__(s, d):
        s.d, s.clock, s.steps, s.closes, s.w = Path(d), Clock(), [], [], {}
    def stream(s, n):
        return s.w.setdefault(n, JsonlWriter(s.d / f"{n}.jsonl"))
    def on_step(s, f): s.steps.append(f)
    def on_close(s, f): s.closes.append(f)

class Slow(Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        time.sleep(0.03)
        return torch.zeros(2)

session = Session(sys.argv[1])
it = iter(DataLoader(Slow(), batch_size=2))  # 60 ms per batch
next(it)  # before the probe: not timed
dataloader.attach(session)
for step, n in enumerate([1, 2, 0, 1]):  # batches drawn in each step
    Clock.step = step
    for _ in range(n):
        next(it)
    time.sleep(0.01)  # the step's own work: not data wait
    for f in session.steps:
        f({"step": step})
for f in session.closes:
    f()
"""


def test_dataloader_probe_times_waits(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "data.py"
    script.write_text(DATA_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(x) for x in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert [(r["step"], r["batches"]) for r in recs] == [(0, 1), (1, 2), (2, 0), (3, 1)]
    assert recs[2]["wait_ms"] == 0  # the step's own 10 ms of work is not data wait
    for r in recs:  # 60 ms per batch, plus scheduling noise on a loaded host
        assert 60 * r["batches"] <= r["wait_ms"] < 60 * r["batches"] + 150


# --------------------------------------------------------------------- reference workload

MESH8 = ["--dp", "2", "--pp", "2", "--tp", "2"]
NO_PROFILE = ["--profile-steps", "none"]


def _analyze(run, tmp_path):
    proc = run_cli(["analyze", run, "--out", tmp_path, "--no-report"])
    assert proc.returncode == 0, proc.stderr
    return json.loads((tmp_path / "summary.json").read_text())


def _kinds(summary, *kinds):
    return [f for f in summary["findings"] if f["kind"] in kinds]


@pytest.mark.multiproc
@pytest.mark.parametrize("rank", [5, 2])
def test_injected_straggler_found(reference_run, tmp_path, rank):
    delay = straggler_delay_ms(reference_run)
    run = straggler_run(reference_run, rank)
    injected = json.loads((run / "injected.json").read_text())["injections"][0]
    s = _analyze(run, tmp_path)
    found = _kinds(s, "straggler")
    per = {p["rank"]: p for p in s["metrics"]["stragglers"]["per_rank"]}
    print(f"delay {delay} ms, step {s['metrics']['stragglers']['median_step_ms']:.0f} ms:",
          {r: (round(p["excess_ms"] or 0), round(p["score"] or 0, 2)) for r, p in per.items()})
    assert len(found) == 1, [f["message"] for f in found]
    assert found[0]["ranks"] == [rank]
    assert found[0]["evidence"]["coords"] == injected["coords"]
    assert str(injected["coords"]["dp"]) in found[0]["message"]
    assert not _kinds(s, "stage_imbalance", "data_starvation")


@pytest.mark.multiproc
def test_clean_run_is_silent(reference_run, tmp_path):
    s = _analyze(reference_run("clean8"), tmp_path)
    per = s["metrics"]["stragglers"]["per_rank"]
    print({p["rank"]: (round(p["excess_ms"] or 0), round(p["score"] or 0, 2)) for p in per})
    assert not _kinds(s, "straggler", "stage_imbalance", "data_starvation"), s["findings"]
    html = __import__("trainprof.reports.sections.stragglers", fromlist=["render"]).render(
        s["metrics"]["stragglers"], s)
    assert html.count("<svg") >= 2  # busy and wait heatmaps


@pytest.mark.multiproc
def test_stage_imbalance_and_slow_data_told_apart(reference_run, tmp_path):
    # one 4-rank run (dp1 · pp2 · tp2) with both faults: stage 1 holds 4 extra layers, and
    # rank 0's dataset sleeps 300 ms per batch
    run = reference_run("imbalance-slowdata", nproc=4,
                        args=["--dp", "1", "--pp", "2", "--tp", "2", "--steps", "6",
                              "--inject", "imbalance:stage=1,extra_layers=4",
                              "--inject", "slow_data:rank=0,delay_ms=300"],
                        wrap_args=NO_PROFILE)
    s = _analyze(run, tmp_path)
    imb = _kinds(s, "stage_imbalance")
    assert len(imb) == 1 and imb[0]["evidence"]["stage"] == 1 and imb[0]["ranks"] == [2, 3]
    starve = _kinds(s, "data_starvation")
    assert len(starve) == 1 and starve[0]["ranks"] == [0]
    assert not _kinds(s, "straggler")


def test_telemetry_and_p2p_evidence(tmp_path):
    busy = noisy_busy(4)
    for s in range(6):
        busy[6][s] += 250
    run = make_run(tmp_path, busy)
    for r in range(8):  # rank 6 thermally throttled at a lower clock; gpu_idle is not a throttle
        add_telemetry(tmp_path, r, clock=1410 if r == 6 else 1980,
                      throttle=("sw_thermal",) if r == 6 else ())
    # rank 3 blocks 40 ms per step in a pipeline recv, besides its all_reduce
    w = JsonlWriter(rank_dir(tmp_path, 3) / "collectives.jsonl")
    for s in range(6):
        start = T0 + s * int(STEP_MS * MS)
        w.write({"step": s, "pg": "9", "seq": s, "op": "recv", "bytes": 8, "peer": 1,
                 "enqueue_ns": start, "end_ns": start + 40 * MS, "blocked_ms": 40.0})
    w.close()
    res = stragglers.analyze(RunDir(tmp_path))
    assert [f.ranks for f in res.findings if f.kind == "straggler"] == [[6]]
    f = res.findings[0]
    assert f.evidence["telemetry"]["throttle"] == ["sw_thermal"]
    assert f.evidence["telemetry"]["sm_clock_mhz"] == 1410
    assert "sw_thermal" in f.message and "1410 vs 1980 MHz" in f.message
    per = {p["rank"]: p for p in res.metrics["per_rank"]}
    assert "throttle" not in per[0]["telemetry"]
    assert per[3]["p2p_ms"] == pytest.approx(40.0) and per[2]["p2p_ms"] == 0.0
    # the recv is time blocked too: rank 3's busy time drops by 40 ms
    assert per[3]["busy_ms"] == pytest.approx(np.median(busy[3][1:]) - 40.0)
