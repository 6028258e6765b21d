"""Memory: expected model-state bytes from the layout vs what the probes measured."""

from __future__ import annotations

import pytest

from trainprof.analyzers import memory
from trainprof.rundir.files import JsonlWriter, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir

# The reference model at its defaults (vocab 256, hidden 64, 4 layers), counted by hand:
# embedding 256·64 + 4 blocks · (2 LayerNorms 2·128 + q,k,v,o 4·64·64 + MLP 2·64·256)
# + final norm 128 + head 256·64 = 16384 + 4·49408 + 128 + 16384
N_PARAMS = 230_528
FP32_ADAM = 4 + 4 + 8


def test_expected_state_by_hand():
    info = {"n_params": 1000, "dp": 2, "pp": 1, "tp": 1, "dp_mode": "fsdp"}
    e = memory.expected_state(info, {})
    assert e["params"] == 500 and e["params_bytes"] == 2000 and e["optimizer_state_bytes"] == 4000
    assert memory.expected_state({**info, "dp_mode": "replicate"}, {})["params"] == 1000
    mixed = memory.expected_state({**info, "param_dtype": "bf16"}, {})
    assert (mixed["params_bytes"], mixed["grads_bytes"], mixed["optimizer_state_bytes"]) == (1000, 1000, 6000)
    # declared stages: 600 params on stage 1 of which 400 are TP-sharded over tp=2, FSDP over dp=2
    staged = {"n_params": 1000, "dp": 2, "pp": 2, "tp": 2, "my_stages": [1],
              "stage_params": [{"stage": 0, "params": 400, "tp_sharded_params": 0},
                               {"stage": 1, "params": 600, "tp_sharded_params": 400}]}
    assert memory.expected_state(staged, {})["params"] == (200 + 400 / 2) / 2


def test_mismatch_is_a_finding(tmp_path):
    d = rank_dir(tmp_path, 0)
    write_json_atomic(d / "meta.json", {
        "rank": 0, "run_info": {"n_params": 1000, "dp": 1, "pp": 1, "tp": 1},
        "memory_breakdown": {"params_bytes": 4000, "grads_bytes": 4000, "optimizer_state_bytes": 16000}})
    w = JsonlWriter(d / "memory.jsonl")
    w.write({"step": 0, "rss_bytes": 10, "peak_rss_bytes": 10})
    w.close()
    res = memory.analyze(RunDir(tmp_path))
    assert [f.kind for f in res.findings] == ["memory"]
    assert "optimizer_state +100%" in res.findings[0].message
    assert res.metrics["per_rank"][0]["measured_vs_expected"]["params_bytes"] == 0.0


@pytest.mark.multiproc
def test_fsdp_halves_model_state_per_rank(reference_run):
    one = RunDir(reference_run("single", nproc=1, args=["--steps", "3", "--loss-file", "{out}/loss.jsonl"]))
    two = RunDir(reference_run("dp2", nproc=2, args=["--dp", "2", "--steps", "3"],
                               wrap_args=["--profile-steps", "none"]))
    r1 = memory.analyze(one).metrics["per_rank"]
    r2 = memory.analyze(two).metrics["per_rank"]
    assert r1[0]["expected"]["params_bytes"] == N_PARAMS * 4
    assert r1[0]["expected"]["optimizer_state_bytes"] == N_PARAMS * 8
    assert r1[0]["measured"]["params_bytes"] == N_PARAMS * 4
    assert r1[0]["measured"]["optimizer_state_bytes"] == N_PARAMS * 8
    for row in r2:  # FSDP2 over dp=2: each rank holds half of every tensor
        assert row["expected"]["params_bytes"] == N_PARAMS * 4 // 2
        assert row["measured"]["params_bytes"] == pytest.approx(N_PARAMS * 4 / 2, rel=0.01)
        assert row["measured"]["optimizer_state_bytes"] == pytest.approx(N_PARAMS * 8 / 2, rel=0.01)
    assert not memory.analyze(two).findings


@pytest.mark.multiproc
def test_3d_layout_matches_exactly(reference_run):
    res = memory.analyze(RunDir(reference_run("clean8")))
    assert len(res.metrics["per_rank"]) == 8 and not res.findings
    # Summed over the 8 ranks: TP-sharded weights (q,k,v,o,up,down: 4·49152) once, the rest
    # (embedding, norms, head) once per TP rank — FSDP shards both over dp.
    tp_sharded = 4 * (4 * 64 * 64 + 2 * 64 * 256)
    total = sum(r["measured"]["n_params_local"] for r in res.metrics["per_rank"])
    assert total == tp_sharded + 2 * (N_PARAMS - tp_sharded)


def test_snapshot_timeline_replayed_backwards(tmp_path):
    """The trace may have lost its oldest entries; replaying back from the exact end state
    still gives the right levels."""
    import pickle

    MiB = 1 << 20
    snap = {"segments": [{"device": 0, "address": 0, "total_size": 8 * MiB, "stream": 0,
                          "segment_type": "large", "blocks": [
                              {"address": 0, "size": 2 * MiB, "state": "active_allocated"},
                              {"address": 2 * MiB, "size": 6 * MiB, "state": "inactive"}]}],
            "device_traces": [[  # the segment_alloc of the 8 MiB segment fell out of the ring buffer
                {"action": "alloc", "addr": 0, "size": 2 * MiB, "time_us": 1000},
                {"action": "alloc", "addr": 2 * MiB, "size": 5 * MiB, "time_us": 2000},
                {"action": "free_requested", "addr": 2 * MiB, "size": 5 * MiB, "time_us": 3000},
                {"action": "free_completed", "addr": 2 * MiB, "size": 5 * MiB, "time_us": 3000}]]}
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(snap))
    (s,) = memory.analyze(RunDir(tmp_path / "s.pickle")).metrics["snapshots"]
    assert s["allocated_bytes_now"] == 2 * MiB and s["reserved_bytes_now"] == 8 * MiB
    assert s["allocated_bytes"] == [2 * MiB, 7 * MiB, 7 * MiB, 2 * MiB]  # after each entry
    assert s["peak_allocated_bytes_traced"] == 7 * MiB and s["t_ms"][0] == 0
