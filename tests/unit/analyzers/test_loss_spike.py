"""Loss spikes (analyzers/nan_origin.py, loss-spike part): at least 10 steps of history, the
jump measured in units of the loss's own variation (log scale for positive losses), judged on
the mean over the ranks; rank-local outliers are info; clean random-target training is silent."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from trainprof.analyzers import nan_origin
from trainprof.analysis.run import RunDir


def test_spike_z_hand_computed():
    losses = [1.0, 0.98, 0.97, 0.99, 0.96, 0.95, 0.97, 0.96, 0.98, 0.97, 5.0, 0.94]
    spikes = nan_origin.detect_spikes({3: [[i, x] for i, x in enumerate(losses)]})
    assert [(s["rank"], s["step"]) for s in spikes] == [(3, 10)]
    w = [math.log(x) for x in losses[:10]]
    med = statistics.median(w)
    mad = statistics.median(abs(x - med) for x in w)
    diff = 1.4826 * statistics.median(abs(b - a) for a, b in zip(w, w[1:])) / math.sqrt(2)
    q90 = float(np.quantile(w, 0.9))  # linear interpolation, as the analyzer
    scale = max(1.4826 * mad, diff, (q90 - med) / 1.2816, 1e-3)
    assert spikes[0]["log"] is True and spikes[0]["median"] == pytest.approx(0.97)
    assert spikes[0]["scale"] == pytest.approx(scale)
    assert spikes[0]["z"] == pytest.approx((math.log(5.0) - med) / scale)


def test_needs_ten_steps_of_history():
    # the same jump after 5 steps is not judged
    losses = [1.0, 0.98, 0.97, 0.99, 0.96, 5.0, 0.95]
    assert nan_origin.detect_spikes({0: [[i, x] for i, x in enumerate(losses)]}) == []


def test_linear_scale_for_losses_that_are_not_positive():
    losses = [-1.0, -1.02, -0.99, -1.01, -1.0, -0.98, -1.01, -1.0, -0.99, -1.02, 3.0]
    (s,) = nan_origin.detect_spikes({0: [[i, x] for i, x in enumerate(losses)]})
    w = losses[:10]
    med = statistics.median(w)
    assert s["log"] is False and s["median"] == pytest.approx(med)
    assert s["z"] == pytest.approx((3.0 - med) / nan_origin.spike_scale(w)[2])


def test_spike_ignores_smooth_descent_noise_and_drops():
    import random

    rng = random.Random(1)
    smooth = [[i, 3.0 * 0.97 ** i + rng.gauss(0, 0.01)] for i in range(80)]
    smooth[40][1] = 0.2  # a sudden *drop* is not a spike
    assert nan_origin.detect_spikes({0: smooth}) == []


def _random_target_losses(rng, steps, batch):
    """Per-step MSE of an untrained model on random targets: a chi-square-like series with a
    long upper tail (small batches), decaying a little as the model learns the mean."""
    return [float((rng.normal(size=batch) ** 2).mean() * (1 + 0.5 * math.exp(-i / 30)))
            for i in range(steps)]


@pytest.mark.parametrize("batch", [4, 16, 256])
def test_random_target_training_is_silent(batch):
    # 50 runs of 2-8 ranks: no spike in the mean, no rank-local outlier
    for seed in range(50):
        rng = np.random.default_rng(seed)
        nranks = int(rng.choice([2, 4, 8]))
        series = {r: [[i, x] for i, x in enumerate(_random_target_losses(rng, 120, batch))]
                  for r in range(nranks)}
        assert nan_origin.detect_spikes({"mean": nan_origin.mean_series(series)}) == [], seed
        assert nan_origin.detect_spikes(series) == [], seed


def _write_nan_stream(root: Path, rank: int, losses):
    d = root / "ranks" / f"rank-{rank:05d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"rank": rank, "world_size": 2}))
    with open(d / "nan.jsonl", "w") as f:
        for i, x in enumerate(losses):
            f.write(json.dumps({"kind": "step", "step": i, "t_ns": i, "loss": x, "loss_finite": True,
                                "grad_finite": True, "params_finite": True, "modules_finite": True}) + "\n")


def _analyze(tmp_path, per_rank):
    for r, losses in enumerate(per_rank):
        _write_nan_stream(tmp_path, r, losses)
    (tmp_path / "manifest.json").write_text(json.dumps({"ranks": list(range(len(per_rank)))}))
    res = nan_origin.analyze(RunDir(tmp_path))
    assert not [f for f in res.findings if f.kind == "nan_origin"]
    return res, [f for f in res.findings if f.kind == "loss_spike"]


def test_spike_in_the_mean_names_steps_and_ranks(tmp_path):
    base = [2.0 - 0.01 * i for i in range(30)]
    r1 = list(base)
    r1[12] = 9.0
    r1[25] = 6.0
    res, (f,) = _analyze(tmp_path, [base, r1])
    assert f.severity == "warning" and f.ranks == [1] and f.evidence["steps"] == [12, 25]
    assert f.evidence["series"] == "mean over ranks"
    mean = dict(map(tuple, res.metrics["mean_loss"]))
    assert mean[12] == pytest.approx((base[12] + 9.0) / 2)
    assert "mean loss over 2 ranks" in f.message and "carried by rank 1" in f.message


def test_rank_outlier_not_in_the_mean_is_info(tmp_path):
    # eight ranks with noisy per-batch losses but rank 5's steady; its loss doubles at step 30:
    # far outside its own variation, within the mean's
    rng = np.random.default_rng(2)
    per_rank = [list(1.0 + 0.3 * np.abs(rng.normal(size=40))) for _ in range(8)]
    per_rank[5] = list(1.0 + 0.01 * rng.normal(size=40))
    per_rank[5][30] = 2.0
    res, found = _analyze(tmp_path, per_rank)
    assert res.metrics["spikes"] == []
    (f,) = found
    assert f.severity == "info" and f.ranks == [5] and f.evidence["steps"] == [30]
    assert res.metrics["rank_spikes"][0]["rank"] == 5


def test_non_finite_step_left_out_of_the_mean():
    series = {0: [[0, 1.0], [1, None], [2, 1.2]], 1: [[0, 3.0], [1, 2.0], [2, 1.0]]}
    assert nan_origin.mean_series(series) == [[0, 2.0], [2, 1.1]]
