"""MFU and host-core sharing on real multi-process runs of the reference job."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainprof.analysis.run import RunDir
from trainprof.analyzers import roofline


# The reference model at its defaults, by hand: vocab 256, hidden 64, 4 layers, 4 heads, seq 32.
N_NON_EMBEDDING = 4 * (2 * 128 + 4 * 64 * 64 + 2 * 64 * 256) + 128 + 256 * 64


@pytest.mark.multiproc
def test_mfu_recomputed_by_hand(reference_run):
    run_dir = reference_run("single", nproc=1, args=["--steps", "3", "--loss-file", "{out}/loss.jsonl"])
    run = RunDir(run_dir)
    meta = run.rank_meta(0)
    info, calib = meta["run_info"], meta["calibration"]
    assert calib["at"] == "activation" and calib["ms"] < 1000       # inside step 0, short
    assert info["n_params_non_embedding"] == N_NON_EMBEDDING
    per_token = 6 * N_NON_EMBEDDING + 12 * 4 * 4 * 16 * 32      # 6N + 12·L·H·Q·T
    tokens = 16 * 32                                             # global batch × seq len
    durs = [json.loads(x)["dur_ms"] for x in (run_dir / "ranks/rank-00000/steps.jsonl").read_text().splitlines()]
    step_s = float(np.median(durs[1:])) / 1e3                    # step 0 (set-up) excluded
    threads, cores = calib["threads"], calib["cpu_count"]
    peak = calib["matmul"]["flops_per_s"] / threads * min(threads, cores)
    expected = per_token * tokens / (step_s * peak)
    job = roofline.analyze(run).metrics["job"]
    assert job["mfu"] == pytest.approx(expected, rel=1e-9)
    assert 0 < job["mfu"] <= 1
    assert job["hfu"] == job["mfu"]                              # no activation checkpointing


@pytest.mark.multiproc
def test_ranks_sharing_a_host_share_its_cores(reference_run):
    run = RunDir(reference_run("clean8"))
    calib = [run.rank_meta(r).get("calibration") for r in run.ranks]
    (c,) = [x for x in calib if x]                                 # local_rank 0 measured, once
    res = roofline.analyze(run)
    job = res.metrics["job"]
    per_thread = c["matmul"]["flops_per_s"] / c["threads"]
    host = per_thread * min(8 * c["threads"], c["cpu_count"])      # 8 ranks on this host's cores
    assert job["devices"] == 8 and job["peak_flops_per_s_total"] == pytest.approx(host)
    assert 0 < job["mfu"] <= 1
    # Every rank's trace was costed, with the local (not DTensor-global) shapes: TP/PP/DP split
    # the model, so the ranks' sum is one model's FLOPs, plus the LM head that both TP ranks
    # compute in full (6·64·256·512 = 50 MFLOP, 7 % of 708) and norm/elementwise FLOPs.
    assert len(res.metrics["per_rank"]) == 8
    assert 1.0 < job["trace_over_model"] < 1.15
