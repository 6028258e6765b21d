"""Statistics of `trainprof compare` on synthetic samples (fixed seeds): real shifts are flagged,
noise and small shifts are not, run-to-run noise is the error term when there are several runs,
too few samples are inconclusive, and the multiple-comparison control holds the A/A false-alarm
rate at alpha."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from trainprof.gate.facts import fingerprint_mismatches
from trainprof.gate.metrics import run_problems, step_samples
from trainprof.gate.regression import (Settings, compare_per_rank, compare_runs, compare_samples,
                                       compare_summaries, compare_values)
from trainprof.gate.stats import benjamini_hochberg, bootstrap_ratio_ci, t_test
from trainprof.gate.threshold import Threshold, ThresholdError, parse_threshold
from trainprof.gate.verdict import (DIFFERS, IMPROVEMENT, INSUFFICIENT, MISSING, REGRESSION, TEST_RUNS,
                                    TEST_STEPS, UNCHANGED, Comparison, overall_verdict)

STEP = Threshold(+1, 0.05)  # step time: up is bad, 5 % minimum effect


def samples(median_ms, n=20, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    return list(median_ms * (1 + noise * rng.standard_normal(n)))


def runs(median_ms, k=3, n=12, within=0.01, between=0.01, seed=0):
    """k runs of n steps: each run's level moves by `between` (relative SD), steps by `within`."""
    rng = np.random.default_rng(seed)
    return [list(median_ms * np.exp(between * rng.standard_normal()) * (1 + within * rng.standard_normal(n)))
            for _ in range(k)]


# --- one run per side: within-run test; a difference cannot be pinned on the code ---------------

@pytest.mark.parametrize("seed", range(5))
def test_one_run_per_side_ten_percent_shift_says_the_runs_differ(seed):
    r = compare_samples("step_time", samples(100, seed=seed), samples(110, seed=seed + 100), STEP)
    assert r.test == TEST_STEPS and r.runs == [1, 1]
    assert r.verdict == DIFFERS and r.moved == REGRESSION  # inconclusive, never a regression
    assert r.p_value < 1e-4
    assert r.ci[0] > 1.05 and r.ci[0] < 1.10 < r.ci[1] < 1.15  # CI brackets the true ratio 1.10
    assert r.change == pytest.approx(0.10, abs=0.02)
    assert "run-to-run noise" in r.reason


@pytest.mark.parametrize("seed", range(5))
def test_two_percent_shift_is_not_a_regression_even_when_significant(seed):
    r = compare_samples("step_time", samples(100, seed=seed), samples(102, seed=seed + 100), STEP)
    assert r.verdict == UNCHANGED
    assert r.p_value < 0.01  # detectable at this noise, but below the minimum effect
    assert "within" in r.reason


@pytest.mark.parametrize("seed", range(5))
def test_identical_distributions_are_not_flagged(seed):
    r = compare_samples("step_time", samples(100, seed=seed), samples(100, seed=seed + 100), STEP)
    assert r.verdict == UNCHANGED and r.p_value > 0.01
    assert r.ci[0] < 1.0 < r.ci[1]


def test_large_shift_drowned_in_noise_is_not_flagged():
    # +8 % median but 40 % noise over 8 samples: not significant
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


def test_one_short_run_among_several_is_insufficient():
    b = runs(100, k=3)
    c = runs(150, k=3, seed=1)
    c[1] = c[1][:3]
    r = compare_samples("step_time", b, c, STEP)
    assert r.verdict == INSUFFICIENT and "candidate run 2 has 3" in r.detail


def test_improvement_with_one_run_is_an_improvement_with_a_caveat():
    r = compare_samples("step_time", samples(100, seed=3), samples(80, seed=4), STEP)
    assert r.verdict == IMPROVEMENT and "run-to-run" in r.reason


# --- several runs per side: the run is the unit ---------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_several_runs_thirty_percent_slowdown_is_a_regression(seed):
    # 3 % run-to-run noise: 4 runs per side (3 per side leave Welch's test 2-4 degrees of freedom)
    r = compare_samples("step_time", runs(100, k=4, between=0.03, seed=seed),
                        runs(130, k=4, between=0.03, seed=seed + 50), STEP)
    assert r.test == TEST_RUNS and r.runs == [4, 4] and r.n == [48, 48]
    assert r.verdict == REGRESSION
    assert r.ci[0] < 1.3 < r.ci[1] and r.ci[0] > 1.05


@pytest.mark.parametrize("seed", range(5))
def test_run_to_run_shift_with_tight_steps_is_not_a_regression(seed):
    # within-run noise 1 %, run-to-run 15 %: steps pooled over runs would call any two sets of
    # runs different; the runs' medians vary as much as the sides do
    b, c = runs(100, within=0.01, between=0.15, seed=seed), runs(100, within=0.01, between=0.15, seed=seed + 50)
    pooled = stats.mannwhitneyu(np.concatenate(b), np.concatenate(c)).pvalue
    r = compare_samples("step_time", b, c, STEP)
    assert r.verdict != REGRESSION and r.p_value > 0.01
    assert pooled < r.p_value  # the naive test understates the noise


def test_runs_test_is_welchs_t_test_on_log_run_medians():
    b, c = runs(100, between=0.05, seed=7), runs(112, k=4, between=0.05, seed=8)
    r = compare_samples("step_time", b, c, STEP)
    lb, lc = np.log([np.median(x) for x in b]), np.log([np.median(x) for x in c])
    assert r.p_value == pytest.approx(stats.ttest_ind(lb, lc, equal_var=False).pvalue, rel=1e-9)
    assert r.ratio == pytest.approx(np.exp(lc.mean() - lb.mean()), rel=1e-12)
    assert r.baseline == pytest.approx(np.exp(lb.mean()))


def test_outlier_runs_on_one_side_do_not_borrow_the_other_sides_spread():
    # 8 tight baseline runs; 3 candidate runs hit by load bursts of different sizes: a pooled
    # variance (dominated by the tight side) would call it significant, Welch's does not
    tight = [[100.0 * f] * 8 for f in (1.00, 1.01, 0.99, 1.005, 0.995, 1.0, 1.002, 0.998)]
    bursts = [[110.0] * 8, [140.0] * 8, [175.0] * 8]
    r = compare_samples("step_time", tight, bursts, STEP)
    lb, lc = np.log([x[0] for x in tight]), np.log([x[0] for x in bursts])
    assert stats.ttest_ind(lb, lc, equal_var=True).pvalue < 0.01
    assert r.p_value > 0.05 and r.verdict == UNCHANGED


def test_history_of_several_baselines_against_candidate_runs():
    hist = runs(100, k=8, between=0.02, seed=1)
    one_slow = compare_samples("step_time", hist, runs(130, k=1, between=0.02, seed=2), STEP)
    assert one_slow.test == TEST_RUNS and one_slow.p_value < 1e-4
    assert one_slow.verdict == DIFFERS and "a single candidate run" in one_slow.reason
    assert compare_samples("step_time", hist, runs(130, k=2, between=0.02, seed=2), STEP).verdict == REGRESSION
    assert compare_samples("step_time", hist, runs(100, k=2, between=0.02, seed=3), STEP).verdict == UNCHANGED


def test_one_outlier_run_is_not_a_regression():
    # a history of tight runs and one candidate run hit as a whole by a load burst (+60 %):
    # significant against the history, yet one run cannot be pinned on the code
    hist = runs(100, k=5, between=0.03, seed=4)
    r = compare_samples("step_time", hist, runs(160, k=1, between=0.0, seed=5), STEP)
    assert r.p_value < 0.01 and r.verdict == DIFFERS
    assert overall_verdict([r]) == (3, "inconclusive")


def test_t_test_matches_scipy_and_handles_no_spread():
    a, b = [1.0, 2.0, 3.5], [2.0, 4.0, 5.0, 6.5]
    p, d, ci = t_test(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert p == pytest.approx(ref.pvalue) and d == pytest.approx(np.mean(b) - np.mean(a))
    lo, hi = ref.confidence_interval(0.95)  # of mean(a) - mean(b)
    assert ci == pytest.approx([-hi, -lo])
    one = [4.0]  # a single value on a side: Student's pooled test (the other side's variance)
    assert t_test(a, one)[0] == pytest.approx(stats.ttest_ind(a, one, equal_var=True).pvalue)
    assert t_test([5, 5], [5]) == (1.0, 0.0, [0.0, 0.0])
    assert t_test([5, 5], [6])[0] == 0.0  # deterministic values that differ


def test_direction_awareness():
    down_bad = Threshold(-1, 0.05)  # throughput
    slower, base = runs(90, seed=3), runs(100, seed=4)
    assert compare_samples("throughput", base, slower, down_bad).verdict == REGRESSION
    assert compare_samples("throughput", slower, base, down_bad).verdict == IMPROVEMENT
    assert compare_samples("step_time", slower, base, STEP).verdict == REGRESSION


def test_bootstrap_ci_is_reproducible_and_covers_the_ratio():
    b, c = samples(100, seed=5), samples(120, seed=6)
    assert bootstrap_ratio_ci(b, c) == bootstrap_ratio_ci(b, c)
    lo, hi = bootstrap_ratio_ci(b, c)
    assert lo < np.median(c) / np.median(b) < hi


# --- multiple comparisons ---------------------------------------------------------------------

def test_benjamini_hochberg_by_hand_and_against_scipy():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4p/rank = 0.02, 0.02, 0.04, 0.04 (running minimum from the top)
    assert benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    rng = np.random.default_rng(0)
    for _ in range(20):
        ps = list(rng.uniform(0, 0.2, 7))
        assert benjamini_hochberg(ps) == pytest.approx(list(stats.false_discovery_control(ps)))
    assert benjamini_hochberg([]) == [] and benjamini_hochberg([0.3]) == [0.3]


def _six_metric_summary(rng):
    """One synthetic run: six independent per-step metrics — step time and m1..m5 — as
    exp-normal samples (log medians close to normal) with a run-level offset."""
    def steps():
        return list(100 * np.exp(0.05 * rng.standard_normal() + 0.02 * rng.standard_normal(8)))

    return {"run": {}, "metrics": {"step_time": {"per_step": [{"max_ms": v} for v in steps()]},
                                   **{f"m{i}": steps() for i in range(1, 6)}}}


def _simulate(n_sims, alpha, seed=0):
    """A/A comparisons of 3 vs 3 runs, all six metrics gated with no minimum effect: the exit-1
    count with the BH control, and the count a per-metric test at alpha (no control) would fail."""
    rng = np.random.default_rng(seed)
    settings = Settings(alpha=alpha, min_effect=0.0, thresholds={f"metrics.m{i}": "+0%" for i in range(1, 6)})
    controlled = uncontrolled = 0
    for _ in range(n_sims):
        bases = [_six_metric_summary(rng) for _ in range(3)]
        cands = [_six_metric_summary(rng) for _ in range(3)]
        results, absent = compare_runs(bases, cands, settings)
        assert not absent and len(results) == 6 and all(r.gate and r.test == TEST_RUNS for r in results)
        controlled += overall_verdict(results)[0] == 1
        uncontrolled += any(r.p_value < alpha and r.moved == REGRESSION for r in results)
    return controlled, uncontrolled


def test_a_a_false_alarm_rate_of_six_gated_metrics_is_at_most_alpha():
    n, alpha = 1000, 0.05
    controlled, uncontrolled = _simulate(n, alpha)
    upper = stats.binom.ppf(0.999, n, alpha)  # 0.1 % one-sided binomial bound at rate alpha
    assert controlled <= upper, (controlled, upper)
    # the control is what keeps it there: six uncorrected tests (one bad direction each) fail
    # up to 1 - (1 - alpha/2)^6 = 14 % of identical comparisons (Welch's test with 3 runs per
    # side is slightly conservative: about 10 % here)
    assert uncontrolled > upper, (uncontrolled, upper)


# --- thresholds and values -----------------------------------------------------------------------

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
    assert pp.describe("fraction") == "+2pp"
    assert compare_values("exposed_comm", 0.10, 0.13, pp).verdict == REGRESSION
    assert compare_values("exposed_comm", 0.10, 0.115, pp).verdict == UNCHANGED
    assert compare_values("mfu", 0.4, None, mfu).verdict == MISSING


def test_values_over_several_runs_need_significance_too():
    pp = parse_threshold("+5pp", 1)
    noisy = compare_values("bubble", [0.30, 0.40, 0.35], [0.38, 0.45, 0.33], pp)
    assert noisy.test == TEST_RUNS and noisy.verdict == UNCHANGED  # +3.7pp mean, not significant
    real = compare_values("bubble", [0.30, 0.31, 0.30], [0.40, 0.41, 0.40], pp)
    assert real.verdict == REGRESSION and real.p_value < 1e-4
    gone = compare_values("bubble", [0.30, None, 0.30], [0.40, 0.41], pp)
    assert gone.verdict == MISSING and "baseline" in gone.detail


def test_values_without_threshold_are_shown_not_gated():
    r = compare_values("exposed_comm", 0.10, 0.50, None)
    assert r.gate is False and r.verdict == UNCHANGED and r.change == pytest.approx(4.0)


def test_per_rank_memory_names_the_worst_rank():
    th = parse_threshold("+5%", 1)
    base = {"0": 100.0, "1": 100.0, "2": 200.0}
    cand = {"0": 101.0, "1": 120.0, "2": 205.0}
    r = compare_per_rank("peak_memory", base, cand, th)
    assert r.verdict == REGRESSION and "rank 1" in r.detail
    assert (r.baseline, r.candidate) == (100.0, 120.0)


def test_per_rank_ranks_missing_from_a_run_is_inconclusive():
    th = parse_threshold("+5%", 1)
    r = compare_per_rank("peak_memory", [{"0": 1.0, "1": 1.0}], [{"0": 1.0}], th)
    assert r.verdict == MISSING and "['1']" in r.detail


def test_overall_verdict_priorities():
    def c(verdict, gate=True):
        return Comparison("m", "m", "", "value", verdict, gate=gate)

    assert overall_verdict([c(UNCHANGED), c(IMPROVEMENT)]) == (0, "pass")
    assert overall_verdict([c(INSUFFICIENT), c(UNCHANGED)]) == (3, "inconclusive")
    assert overall_verdict([c(DIFFERS), c(UNCHANGED)]) == (3, "inconclusive")
    assert overall_verdict([c(INSUFFICIENT), c(REGRESSION)]) == (1, "regression")
    assert overall_verdict([c(REGRESSION, gate=False)]) == (0, "pass")


# --- reading summaries ---------------------------------------------------------------------------

def summary(step_ms, tokens=1024, mem=None, run=None, extra=None, ranks=None):
    s = {"run": {"world_size": 2, "mesh": {"dp": 2, "pp": 1, "tp": 1}, "device": "cpu",
                 "torch_version": "2.13.0+cpu", **(run or {})},
         "metrics": {"step_time": {"job": {"tokens_per_step": tokens, **({"ranks_reporting": ranks} if ranks else {})},
                                   "per_step": [{"step": i + 1, "max_ms": v} for i, v in enumerate(step_ms)]},
                     **({"memory": {"per_rank": mem}} if mem else {}), **(extra or {})}}
    return s


def test_compare_summaries_reads_step_time_throughput_and_memory():
    base = summary(samples(100), mem=[{"rank": 0, "peak_rss_bytes": 1e9}, {"rank": 1, "peak_rss_bytes": 1e9}])
    cand = summary(samples(130, seed=1), mem=[{"rank": 0, "peak_rss_bytes": 1e9}, {"rank": 1, "peak_rss_bytes": 1.01e9}])
    results, absent = compare_summaries(base, cand, Settings())
    by = {r.metric: r for r in results}
    assert absent == []
    assert by["step_time"].verdict == DIFFERS  # one run per side
    assert by["throughput"].moved == REGRESSION and by["throughput"].change == pytest.approx(1 / 1.3 - 1, abs=0.03)
    assert by["peak_memory"].verdict == UNCHANGED and "peak_rss_bytes" in by["peak_memory"].detail
    assert by["peak_memory"].gate is False  # informational by default
    assert "mfu" not in by  # absent from both: not compared


def test_single_valued_metrics_never_gate_by_default():
    extra = {"comm_compute": {"exposed_comm_fraction": 0.10}, "pipeline": {"bubble_fraction": 0.20}}
    worse = {"comm_compute": {"exposed_comm_fraction": 0.60}, "pipeline": {"bubble_fraction": 0.70}}
    mem = [{"rank": 0, "peak_rss_bytes": 1e9}]
    bases = [summary(samples(100, seed=i), extra=extra, mem=mem) for i in range(3)]
    cands = [summary(samples(100, seed=10 + i), extra=worse, mem=[{"rank": 0, "peak_rss_bytes": 9e9}])
             for i in range(3)]
    for b, c in ((bases, cands), (bases[:1], cands[:1])):
        results, _ = compare_runs(b, c, Settings())
        by = {r.metric: r for r in results}
        assert {"exposed_comm", "bubble", "peak_memory"} <= set(by)
        assert not any(by[m].gate for m in ("exposed_comm", "bubble", "peak_memory"))
        assert overall_verdict(results) == (0, "pass")
    # an explicit threshold gates them
    results, _ = compare_runs(bases, cands, Settings(thresholds={"bubble": "+5pp", "peak_memory": "+5%"}))
    by = {r.metric: r for r in results}
    assert by["bubble"].gate and by["bubble"].verdict == REGRESSION
    assert by["peak_memory"].gate and by["peak_memory"].verdict == REGRESSION
    assert not by["exposed_comm"].gate


def test_mfu_per_step_at_a_common_calibrated_peak():
    def roof(mfus, peak):
        return {"roofline": {"job": {"mfu": float(np.median(mfus)), "peak_flops_per_s_total": peak,
                                     "per_step": [{"step": i, "mfu": v} for i, v in enumerate(mfus)]},
                             "peak": {"basis": "calibration on cpu: ...", "dtype": "fp32"}}}
    # same step times; the second run's calibration measured a 20 % higher peak, so its MFU
    # per step reads 1/1.2 lower: at a common peak they are equal again
    base = summary(samples(100), extra=roof(samples(0.30, seed=1), 1e11))
    cand = summary(samples(100, seed=2), extra=roof(list(np.array(samples(0.30, seed=3)) / 1.2), 1.2e11))
    results, _ = compare_summaries(base, cand, Settings())
    mfu = {r.metric: r for r in results}["mfu"]
    assert mfu.kind == "sampled" and mfu.verdict == UNCHANGED and abs(mfu.change) < 0.02
    assert "calibrated peak" in mfu.detail


def test_a_run_with_too_few_steps_makes_every_metric_insufficient():
    extra = {"comm_compute": {"exposed_comm_fraction": 0.10}}
    base = summary(samples(100), extra=extra, mem=[{"rank": 0, "peak_rss_bytes": 1e9}])
    cand = summary(samples(200, n=3), extra={"comm_compute": {"exposed_comm_fraction": 0.9}},
                   mem=[{"rank": 0, "peak_rss_bytes": 9e9}])
    results, _ = compare_summaries(base, cand, Settings(thresholds={"peak_memory": "+1%", "exposed_comm": "+1pp"}))
    assert {r.metric for r in results} == {"step_time", "throughput", "exposed_comm", "peak_memory"}
    assert all(r.verdict == INSUFFICIENT and "candidate run 1: 3 analysed steps" in r.detail for r in results)
    assert overall_verdict(results) == (3, "inconclusive")


def test_ranks_missing_make_every_metric_insufficient():
    base = summary(samples(100), ranks=2)
    cand = summary(samples(100, seed=1), ranks=1)
    assert run_problems(cand) == ["step times from 1 of 2 ranks"]
    results, _ = compare_summaries(base, cand, Settings())
    assert all(r.verdict == INSUFFICIENT for r in results)


def test_metric_missing_from_some_runs_is_missing():
    with_bubble = {"pipeline": {"bubble_fraction_by_step": {str(i): 0.3 for i in range(8)}}}
    bases = [summary(samples(100, seed=i), extra=with_bubble) for i in range(2)]
    cands = [summary(samples(100, seed=5), extra=with_bubble), summary(samples(100, seed=6))]
    results, _ = compare_runs(bases, cands, Settings(thresholds={"bubble": "+5pp"}))
    bubble = {r.metric: r for r in results}["bubble"]
    assert bubble.verdict == MISSING and "candidate run 2" in bubble.detail
    assert overall_verdict(results) == (3, "inconclusive")


def test_step_samples_fall_back_to_step_ms_by_rank_without_excluded_steps():
    s = {"metrics": {"step_time": {"first_step": 0, "excluded_steps": {"warmup": [0], "profiler": [2]},
                                   "step_ms_by_rank": {"0": [900, 10, 50, 12], "1": [905, 11, 60, None]}}}}
    assert step_samples(s) == [11.0, 12.0]


def test_fingerprint_mismatch_names_the_field():
    a, b = summary([1] * 6), summary([1] * 6, run={"world_size": 4})
    diff = fingerprint_mismatches(a, b)
    assert len(diff) == 1 and diff[0].startswith("world_size") and "2" in diff[0] and "4" in diff[0]


# --- CPU time per step: the measure of work that a neighbour's load barely moves -----------------

def contended(level_ms, cpu_ms, k, seed, burst_p=0.3):
    """k runs of 13 steps as on a shared 2-core machine: a neighbour's load slows whole runs
    (one-sided: ×1.3–1.7 with probability burst_p, besides a 10 % run-to-run level noise and
    8 % step noise) while the busiest rank's CPU time per step moves by a few percent (with its
    own rarer, smaller one-sided inflation: caches and cores shared with the neighbour)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        burst = rng.uniform(1.3, 1.7) if rng.random() < burst_p else 1.0
        level = level_ms * burst * np.exp(0.10 * rng.standard_normal())
        steps = list(level * np.exp(0.08 * rng.standard_normal(13)))
        cpu = cpu_ms * np.exp(0.04 * rng.standard_normal()) * (1.15 if rng.random() < burst_p / 3 else 1.0)
        ranks = [{"rank": r, "cpu_ms": cpu * (1.0 if r == 1 else 0.9)} for r in range(2)]
        out.append(summary(steps, extra={"stragglers": {"per_rank": ranks}}))
    return out


def test_cpu_time_value_is_the_busiest_ranks_and_absent_safe():
    from trainprof.gate.metrics import cpu_time_value

    s = summary(samples(100), extra={"stragglers": {"per_rank": [{"rank": 0, "cpu_ms": 30.0},
                                                                 {"rank": 1, "cpu_ms": 42.5}]}})
    assert cpu_time_value(s) == 42.5
    assert cpu_time_value(summary(samples(100))) is None  # no scheduler statistics recorded
    partial = summary(samples(100), extra={"stragglers": {"per_rank": [{"rank": 0, "cpu_ms": 30.0},
                                                                       {"rank": 1, "cpu_ms": None}]}})
    assert cpu_time_value(partial) is None  # a rank without it: the busiest may be the one missing


@pytest.mark.parametrize("seed", range(6))
def test_cpu_time_finds_a_thirty_percent_slowdown_that_contention_hides_from_step_time(seed):
    bases = contended(150, 36, 4, seed)
    cands = contended(150 * 1.3, 36 * 1.3, 4, seed + 100)  # 30 % more work per step
    results, _ = compare_runs(bases, cands, Settings())
    by = {r.metric: r for r in results}
    assert by["cpu_time"].verdict == REGRESSION and by["cpu_time"].test == TEST_RUNS
    assert by["cpu_time"].ratio == pytest.approx(1.3, abs=0.1)
    assert by["cpu_time"].p_value < by["step_time"].p_value  # the same change, less noise
    assert overall_verdict(results) == (1, "regression")


def test_cpu_time_under_contention_gives_no_more_false_alarms_than_alpha():
    """A/A with one-sided contention bursts on both sides, the whole gate (four gated metrics,
    Benjamini–Hochberg): the false-alarm rate stays within the binomial range of alpha."""
    alpha, n = 0.05, 300
    alarms = sum(overall_verdict(compare_runs(contended(150, 36, 3, 2 * i), contended(150, 36, 3, 2 * i + 1),
                                              Settings(alpha=alpha, min_effect=0.0))[0])[0] == 1
                 for i in range(n))
    assert alarms <= stats.binom.ppf(0.999, n, alpha), alarms


def test_cpu_time_one_run_each_is_shown_never_gated_and_one_candidate_only_differs():
    bases, cands = contended(150, 36, 8, 0, burst_p=0), contended(150, 72, 1, 1, burst_p=0)
    results, _ = compare_runs(bases[:1], cands, Settings())
    by = {r.metric: r for r in results}
    assert by["cpu_time"].gate is False and by["cpu_time"].verdict == REGRESSION  # shown as worse
    assert by["cpu_time"].p_value is None and by["cpu_time"].change == pytest.approx(72 / 36 - 1, rel=0.2)
    results, _ = compare_runs(bases, cands, Settings())  # a history of 8 against one candidate run
    by = {r.metric: r for r in results}
    assert by["cpu_time"].verdict == DIFFERS and by["cpu_time"].gate
    assert overall_verdict(results)[0] == 3


def test_runs_without_cpu_time_still_compare():
    with_cpu = contended(150, 36, 3, 0, burst_p=0)
    without = [summary(samples(150, n=13, seed=i)) for i in range(3)]
    results, _ = compare_runs(without, without[::-1], Settings())
    assert "cpu_time" not in {r.metric for r in results}  # absent from every run: left out
    results, _ = compare_runs(without, with_cpu, Settings())  # e.g. a history of older runs
    by = {r.metric: r for r in results}
    assert by["cpu_time"].verdict == MISSING and by["cpu_time"].gate is False
    assert overall_verdict(results)[0] == 0
    assert "not in baseline run 1, baseline run 2, baseline run 3" in by["cpu_time"].detail
    results, _ = compare_runs(without, with_cpu, Settings(thresholds={"cpu_time": "+5%"}))
    assert overall_verdict(results)[0] == 3  # asked for: missing data is inconclusive


def test_throughput_and_mfu_are_one_hypothesis_with_step_time():
    """They are step time in other units: Benjamini–Hochberg counts the three once, so a fourth
    metric is adjusted over 2 hypotheses, not 4 (0.003 × 2 / 1 = 0.006 < 0.01; × 4 would fail)."""
    from trainprof.gate.verdict import adjust

    def made(metric, p, kind="sampled"):
        return Comparison(metric, metric, "", kind, UNCHANGED, p_value=p, moved=REGRESSION, runs=[3, 3],
                          test=TEST_RUNS, change=0.3)

    family = [made("step_time", 0.5), made("throughput", 0.5), made("mfu", 0.6), made("cpu_time", 0.003, "value")]
    adjust(family, 0.01)
    q = {r.metric: r.p_adjusted for r in family}
    assert q["cpu_time"] == pytest.approx(0.006) and family[3].verdict == REGRESSION
    assert q["step_time"] == q["throughput"] == pytest.approx(0.5)  # BH over (0.003, 0.5): 0.5
    assert q["mfu"] == pytest.approx(0.6)  # scaled as its hypothesis's smallest p-value was
    assert family[0].verdict == UNCHANGED and "not significant" in family[0].reason
    lone = [made("step_time", 0.5), made("cpu_time", 0.003, "value"), made("metrics.x", 0.5), made("metrics.y", 0.5)]
    adjust(lone, 0.01)  # four distinct hypotheses: 0.003 × 4 = 0.012
    assert lone[1].p_adjusted == pytest.approx(0.012) and lone[1].verdict == UNCHANGED


# --- a large change the runs cannot confirm: underpowered, with the detectable change -----------

BASE_LEVELS = [100.0, 80.0, 125.0, 95.0, 110.0, 90.0]  # six runs, ±15 % run to run
CAND_LEVELS = [130.0, 105.0, 160.0]  # three runs, +30 %


def test_large_but_not_significant_change_is_underpowered_with_its_detectable_change():
    from scipy.stats import t as t_dist

    from trainprof.gate.regression import compare_run_values
    from trainprof.gate.verdict import min_detectable_change

    r = compare_run_values("cpu_time", BASE_LEVELS, CAND_LEVELS, STEP)
    assert r.verdict == UNCHANGED and r.moved == REGRESSION and r.underpowered
    assert r.change > 0.25 and r.p_value >= 0.01
    # by hand: Welch on the logs, then (t(1-α/2) + t(0.8)) standard errors
    lb, lc = np.log(BASE_LEVELS), np.log(CAND_LEVELS)
    vb, vc = lb.var(ddof=1) / 6, lc.var(ddof=1) / 3
    se = np.sqrt(vb + vc)
    df = (vb + vc) ** 2 / (vb ** 2 / 5 + vc ** 2 / 2)
    mde = np.expm1((t_dist.ppf(0.995, df) + t_dist.ppf(0.8, df)) * se)
    assert r.mde == pytest.approx(mde, rel=1e-9) and min_detectable_change(r, 0.01) == r.mde
    assert r.mde > r.change  # the gate could not have seen this change
    assert "not significant with 3 candidate vs 6 baseline runs" in r.reason
    assert f"~{mde * 100:.0f}%" in r.reason and r.reason.endswith("add runs")
    assert overall_verdict([r]) == (0, "pass")  # exit 0 (docs/ci-gate.md): a warning, not a failure


def test_significant_regression_and_small_moves_are_not_underpowered():
    from trainprof.gate.regression import compare_run_values

    big = compare_run_values("cpu_time", [100, 101, 99, 100, 102, 98], [130, 131, 129], STEP)
    assert big.verdict == REGRESSION and not big.underpowered and big.mde is None
    small = compare_run_values("cpu_time", BASE_LEVELS, [101.0, 99.0, 100.0], STEP)
    assert not small.underpowered  # within the threshold: nothing to warn about
    faster = compare_run_values("cpu_time", BASE_LEVELS, [70.0, 85.0, 60.0], STEP)
    assert not faster.underpowered  # an improvement that is not significant is no warning


def test_job_facts_differ_only_where_both_runs_know_them():
    from trainprof.gate.facts import job_differences, same_fact

    a = {"run": {"command": ["torchrun", "--nproc-per-node", "2", "/x/pl_tiny.py", "--lr", "1"],
                 "run_info": {"framework": "lightning", "n_params_non_embedding": 4740}}}
    b = {"run": {"command": ["torchrun", "hf_gpt2.py"],
                 "run_info": {"framework": "transformers", "global_batch": 16}}}
    assert job_differences(a, b) == [("script", "pl_tiny.py", "hf_gpt2.py"),
                                     ("framework", "lightning", "transformers")]
    assert job_differences(a, a) == [] and job_differences(a, {"run": {}}) == []
    assert same_fact("mesh", {}, {"dp": 2, "pp": 1, "tp": 1})  # an older summary's unknown mesh
    assert not same_fact("mesh", {"dp": 2}, {"dp": 1})


def test_job_script_is_the_same_under_torchrun_and_python_m_torch_distributed_run():
    # `python -m torch.distributed.run` is torchrun: the job is the script it launches, so a run
    # launched either way is the same job (compare refused them as "different jobs")
    from trainprof.gate.facts import job_differences, job_facts

    tr = {"run": {"command": ["torchrun", "--nproc-per-node", "2", "job.py", "--accum", "4"]}}
    pm = {"run": {"command": ["python", "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "/tmp/job.py", "--accum", "4"]}}
    old = {"run": {"command": ["python", "-m", "torch.distributed.launch", "job.py"]}}
    mod = {"run": {"command": ["python", "-m", "torch.distributed.run", "-m", "pkg.train"]}}
    assert job_facts(pm)["script"] == job_facts(old)["script"] == "job.py"
    assert job_differences(tr, pm) == []
    assert job_facts(mod)["script"] == "-m pkg.train"
    assert job_facts({"run": {"command": ["python", "-m", "pkg.train"]}})["script"] == "-m pkg.train"
