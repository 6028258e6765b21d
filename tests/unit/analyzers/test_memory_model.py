"""The memory analyzer's expected state by hand, mismatches as findings, snapshot timelines
replayed backwards."""

from __future__ import annotations

from trainprof.analysis.run import RunDir
from trainprof.analyzers import memory
from trainprof.rundir.files import JsonlWriter, rank_dir, write_json_atomic


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
