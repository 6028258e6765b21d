"""Statistics of `trainprof compare` on synthetic samples (fixed seeds): real shifts are flagged,
noise and small shifts are not, too few samples are inconclusive."""

from __future__ import annotations

import numpy as np
import pytest

from trainprof.regression import (IMPROVEMENT, INSUFFICIENT, MISSING, REGRESSION, UNCHANGED,
                                  Comparison, Settings, Threshold, ThresholdError,
                                  bootstrap_ratio_ci, compare_per_rank, compare_samples,
                                  compare_summaries, compare_values, fingerprint_mismatches,
                                  overall_verdict, parse_threshold, step_samples)

STEP = Threshold(+1, 0.05)  # step time: up is bad, 5 % minimum effect


def samples(median_ms, n=20, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    return list(median_ms * (1 + noise * rng.standard_normal(n)))


@pytest.mark.parametrize("seed", range(5))
def test_ten_percent_shift_with_low_noise_is_a_regression(seed):
    r = compare_samples("step_time", samples(100, seed=seed), samples(110, seed=seed + 100), STEP)
    assert r.verdict == REGRESSION
    assert r.p_value < 1e-4
    assert r.ci[0] > 1.05 and r.ci[0] < 1.10 < r.ci[1] < 1.15  # CI brackets the true ratio 1.10
    assert r.change == pytest.approx(0.10, abs=0.02)


@pytest.mark.parametrize("seed", range(5))
def test_two_percent_shift_is_not_a_regression_even_when_significant(seed):
    r = compare_samples("step_time", samples(100, seed=seed), samples(102, seed=seed + 100), STEP)
    assert r.verdict == UNCHANGED
    assert r.p_value < 0.01  # detectable at this noise, but below the minimum effect
    assert "within" in r.detail


@pytest.mark.parametrize("seed", range(5))
def test_identical_distributions_are_not_flagged(seed):
    r = compare_samples("step_time", samples(100, seed=seed), samples(100, seed=seed + 100), STEP)
    assert r.verdict == UNCHANGED and r.p_value > 0.01
    assert r.ci[0] < 1.0 < r.ci[1]


def test_large_shift_drowned_in_noise_is_not_a_regression():
    # +8 % median but 40 % noise over 8 samples: not significant, so not a regression
    r = compare_samples("step_time", samples(100, n=8, noise=0.4, seed=1),
                        samples(108, n=8, noise=0.4, seed=2), STEP)
    assert r.p_value >= 0.01 and r.verdict == UNCHANGED


def test_run_compared_with_itself():
    s = samples(100)
    r = compare_samples("step_time", s, s, STEP)
    assert r.verdict == UNCHANGED and r.p_value > 0.5 and r.ratio == 1.0


def test_constant_samples_do_not_crash():
    r = compare_samples("step_time", [5.0] * 8, [5.0] * 8, STEP)
    assert r.verdict == UNCHANGED and r.p_value == 1.0


@pytest.mark.parametrize("nb,nc", [(5, 20), (20, 5), (3, 3), (0, 10)])
def test_fewer_than_six_samples_is_insufficient(nb, nc):
    r = compare_samples("step_time", samples(100, n=nb), samples(150, n=nc, seed=1), STEP)
    assert r.verdict == INSUFFICIENT and r.n == [nb, nc]


def test_six_samples_each_can_decide():
    r = compare_samples("step_time", samples(100, n=6), samples(140, n=6, seed=1), STEP)
    assert r.verdict == REGRESSION  # the exact test reaches p = 2/924 with 6 vs 6


def test_direction_awareness():
    down_bad = Threshold(-1, 0.05)  # throughput
    slower = samples(90, seed=3)
    base = samples(100, seed=4)
    assert compare_samples("throughput", base, slower, down_bad).verdict == REGRESSION
    assert compare_samples("throughput", slower, base, down_bad).verdict == IMPROVEMENT
    assert compare_samples("step_time", slower, base, STEP).verdict == REGRESSION


def test_bootstrap_ci_is_reproducible_and_covers_the_ratio():
    b, c = samples(100, seed=5), samples(120, seed=6)
    assert bootstrap_ratio_ci(b, c) == bootstrap_ratio_ci(b, c)
    lo, hi = bootstrap_ratio_ci(b, c)
    assert lo < np.median(c) / np.median(b) < hi


@pytest.mark.parametrize("text,direction,value,relative", [
    ("+5%", 1, 0.05, True), ("-3%", -1, 0.03, True), ("5%", -1, 0.05, True),
    ("+2pp", 1, 0.02, False), ("+512MiB", 1, 512 * 2**20, False), ("+0.5", 1, 0.5, False),
    ("+1.5GB", 1, 1.5e9, False)])
def test_parse_threshold(text, direction, value, relative):
    th = parse_threshold(text, default_direction=-1)
    assert (th.direction, th.relative) == (direction, relative)
    assert th.value == pytest.approx(value)


@pytest.mark.parametrize("bad", ["", "5", "x%", "+5 parsecs", "++5%"])
def test_bad_thresholds_are_rejected(bad):
    if bad == "5":  # a bare number is a valid absolute threshold
        assert parse_threshold(bad, 1).value == 5
        return
    with pytest.raises(ThresholdError):
        parse_threshold(bad, 1)


def test_value_thresholds_relative_and_absolute():
    mem = parse_threshold("+2%", 1)
    assert compare_values("peak_memory", 1000, 1030, mem).verdict == REGRESSION
    assert compare_values("peak_memory", 1000, 1015, mem).verdict == UNCHANGED
    assert compare_values("peak_memory", 1000, 900, mem).verdict == IMPROVEMENT
    mfu = parse_threshold("3%", -1)  # no sign: MFU's own bad direction (down)
    assert compare_values("mfu", 0.40, 0.38, mfu).verdict == REGRESSION
    assert compare_values("mfu", 0.40, 0.45, mfu).verdict == IMPROVEMENT
    pp = parse_threshold("+2pp", 1)
    assert compare_values("exposed_comm", 0.10, 0.13, pp).verdict == REGRESSION
    assert compare_values("exposed_comm", 0.10, 0.115, pp).verdict == UNCHANGED
    assert compare_values("mfu", 0.4, None, mfu).verdict == MISSING


def test_per_rank_memory_names_the_worst_rank():
    th = parse_threshold("+5%", 1)
    base = {"0": 100.0, "1": 100.0, "2": 200.0}
    cand = {"0": 101.0, "1": 120.0, "2": 205.0}
    r = compare_per_rank("peak_memory", base, cand, th)
    assert r.verdict == REGRESSION and "rank 1" in r.detail
    assert (r.baseline, r.candidate) == (100.0, 120.0)


def test_overall_verdict_priorities():
    def c(verdict, gate=True):
        return Comparison("m", "m", "", "value", verdict, gate=gate)

    assert overall_verdict([c(UNCHANGED), c(IMPROVEMENT)]) == (0, "pass")
    assert overall_verdict([c(INSUFFICIENT), c(UNCHANGED)]) == (3, "inconclusive")
    assert overall_verdict([c(INSUFFICIENT), c(REGRESSION)]) == (1, "regression")
    assert overall_verdict([c(REGRESSION, gate=False)]) == (0, "pass")


def summary(step_ms, tokens=1024, mem=None, run=None):
    return {"run": {"world_size": 2, "mesh": {"dp": 2, "pp": 1, "tp": 1}, "device": "cpu",
                    "torch_version": "2.13.0+cpu", **(run or {})},
            "metrics": {"step_time": {"job": {"tokens_per_step": tokens},
                                      "per_step": [{"step": i + 1, "max_ms": v} for i, v in enumerate(step_ms)]},
                        **({"memory": {"per_rank": mem}} if mem else {})}}


def test_compare_summaries_reads_step_time_throughput_and_memory():
    base = summary(samples(100), mem=[{"rank": 0, "peak_rss_bytes": 1e9}, {"rank": 1, "peak_rss_bytes": 1e9}])
    cand = summary(samples(130, seed=1), mem=[{"rank": 0, "peak_rss_bytes": 1e9}, {"rank": 1, "peak_rss_bytes": 1.01e9}])
    results, absent = compare_summaries(base, cand, Settings())
    by = {r.metric: r for r in results}
    assert absent == []
    assert by["step_time"].verdict == REGRESSION
    assert by["throughput"].verdict == REGRESSION and by["throughput"].change == pytest.approx(1 / 1.3 - 1, abs=0.03)
    assert by["peak_memory"].verdict == UNCHANGED and "peak_rss_bytes" in by["peak_memory"].detail
    assert "mfu" not in by  # absent from both: not compared


def test_step_samples_fall_back_to_step_ms_by_rank_without_excluded_steps():
    s = {"metrics": {"step_time": {"first_step": 0, "excluded_steps": {"warmup": [0], "profiler": [2]},
                                   "step_ms_by_rank": {"0": [900, 10, 50, 12], "1": [905, 11, 60, None]}}}}
    assert step_samples(s) == [11.0, 12.0]


def test_fingerprint_mismatch_names_the_field():
    a, b = summary([1] * 6), summary([1] * 6, run={"world_size": 4})
    diff = fingerprint_mismatches(a, b)
    assert len(diff) == 1 and diff[0].startswith("world_size") and "2" in diff[0] and "4" in diff[0]
