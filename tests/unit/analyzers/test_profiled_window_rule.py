"""The off-training rule on the profiled window's breakdown."""

from __future__ import annotations


def test_off_training_rule_on_the_breakdown():
    """The rule on comm_compute's per-rank figures: < 50 µs of ops and no communication per
    profiled step on every rank is no training step; one rank with work keeps the figures."""
    from trainprof.analyzers._profiled_window import off_training

    class Run:
        trace_inputs = ["traces"]

    def rank(r, compute, comm, window=50.0):
        return {"rank": r, "compute_fraction": compute, "overlapped_fraction": 0.0,
                "comm_fraction": comm, "step_window_ms": window}

    idle = [rank(0, 0.0, 0.0, 4.0), rank(1, 0.0005, 0.0, 8.0)]  # ≤ 4 µs of ops per step
    assert "no training work" in off_training(Run(), idle)
    assert off_training(Run(), [rank(0, 0.01, 0.0), rank(1, 0.0, 0.0)]) is None  # 0.5 ms of ops
    assert off_training(Run(), [rank(0, 0.0, 0.3), rank(1, 0.0, 0.0)]) is None   # communication
