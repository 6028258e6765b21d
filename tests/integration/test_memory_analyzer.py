"""Memory: expected model-state bytes from the layout vs what the probes measured.

Single-process cases: tests/unit/analyzers/test_memory_model.py."""

from __future__ import annotations

import pytest

from trainprof.analyzers import memory
from trainprof.analysis.run import RunDir

# The reference model at its defaults (vocab 256, hidden 64, 4 layers), counted by hand:
# embedding 256·64 + 4 blocks · (2 LayerNorms 2·128 + q,k,v,o 4·64·64 + MLP 2·64·256)
# + final norm 128 + head 256·64 = 16384 + 4·49408 + 128 + 16384
N_PARAMS = 230_528
FP32_ADAM = 4 + 4 + 8


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


