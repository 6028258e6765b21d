"""The periodic search reports the fundamental period, not a sparser harmonic of it
(analyzers/_periodic.py ``fundamental``): checkpoints every 8 steps whose cost varies are
"every 8 steps" even when the class of every 16th step has the larger mean excess; a true
period of 16 with typical steps in between stays 16; pure noise finds no period."""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _periodic

MIN_N = 3
CAP = 10_000


def search(steps, x, edges=()):
    """The search as slow_steps calls it: m the median, lo = m + max(2σ, 0.5·m, 10 ms)."""
    x = np.asarray(x, dtype=float)
    m = float(np.median(x))
    lo = m + max(2 * 1.4826 * float(np.median(np.abs(x - m))), 0.5 * m, 10.0)
    return _periodic.slow_class(list(steps), x, set(edges), m, lo, MIN_N, CAP)


# A recorded FSDP2 job (2 ranks, gloo) saving a DCP checkpoint every 8 steps: the analysed
# steps 1 and 6..49 (warm-up and profiler window excluded), the slowest rank's step in ms.
# The checkpoint steps 8, 16, 24, 32, 40, 48 take 636, 68, 142, 65, 180, 279 ms; steps 16 and
# 32 are barely over the median (59 ms) but 27-30 ms over their neighbours (~38 ms).
RECORDED_STEPS = [1] + list(range(6, 50))
RECORDED_MS = [411.0, 110.5, 62.3, 635.9, 100.6, 120.8, 81.9, 63.4, 91.0, 56.1, 38.5, 68.3,
               37.0, 37.0, 40.9, 40.9, 36.0, 43.1, 59.9, 142.5, 39.8, 43.3, 35.7, 47.4, 38.7,
               33.8, 36.8, 64.8, 38.1, 38.0, 37.1, 42.1, 39.3, 35.7, 40.4, 180.0, 64.4, 110.7,
               93.7, 84.7, 59.5, 129.3, 155.2, 279.0, 132.8]


def test_recorded_checkpoint_every_8_steps_is_every_8():
    # without the edges (1, 6: after the warm-up and the profiler window) as slow_steps passes
    got = search(RECORDED_STEPS, RECORDED_MS, edges={1, 6})
    assert got == (8, 0, [8, 16, 24, 32, 40, 48])
    # the largest mean excess alone: every 16th step (8, 24, 40: mean 319 ms vs 228 ms)
    x = np.asarray(RECORDED_MS)
    m = float(np.median(x))
    lo = m + max(2 * 1.4826 * float(np.median(np.abs(x - m))), 0.5 * m, 10.0)
    assert _periodic.reference(RECORDED_STEPS, x, {1, 6}, m, lo, MIN_N, CAP) == (16, 8, [8, 24, 40])


def _period_8_varied(rng, n):
    steps = np.arange(1, n + 1)
    x = 100 + rng.normal(0, 3, n)
    ck = steps % 8 == 0
    # every other checkpoint large (160-300 ms extra), the others small (35-60 ms extra)
    big = (steps % 16 == 8) & ck
    x[big] += rng.uniform(160, 300, big.sum())
    x[ck & ~big] += rng.uniform(35, 60, (ck & ~big).sum())
    return steps, x


def test_period_8_with_varied_excess():
    rng = np.random.default_rng(3)
    for n in (50, 97, 400, 3500):  # 3500: the pruned search (past SMALL_SPAN)
        steps, x = _period_8_varied(rng, n)
        got = search(steps, x)
        assert got is not None and got[:2] == (8, 0), n
        assert got[2] == [int(s) for s in steps if s % 8 == 0]


def test_period_8_with_one_step_missing():
    rng = np.random.default_rng(4)
    steps, x = _period_8_varied(rng, 60)
    keep = steps != 32  # a checkpoint step not recorded
    steps, x = steps[keep], x[keep]
    got = search(steps, x, edges={48})  # and one an edge step: never counted
    assert got == (8, 0, [8, 16, 24, 40, 56])


def test_true_period_16_stays_16():
    """Every 16th step slow and the steps 8 after them typical: the class of every 8th step
    holds the slow class, yet its other steps are not slow (over the median by chance half the
    time, but not over their neighbours) — period 16, over many noisy series."""
    rng = np.random.default_rng(5)
    for i in range(300):
        n = int(rng.integers(50, 400))
        steps = np.arange(1, n + 1)
        x = 100 + (rng.normal(0, 5, n) if i % 2 else 5 * rng.standard_t(3, n))
        slow = steps % 16 == 8
        x[slow] += rng.uniform(60, 300, slow.sum())
        got = search(steps, x)
        assert got is not None and got[:2] == (16, 8), (i, n, got)


def test_true_period_16_with_random_spikes_stays_16():
    rng = np.random.default_rng(6)
    for i in range(100):
        n = int(rng.integers(60, 300))
        steps = np.arange(1, n + 1)
        x = 100 + rng.normal(0, 4, n)
        x[rng.random(n) < 0.1] += 80  # GC pauses at random steps
        slow = steps % 16 == 8
        x[slow] += rng.uniform(150, 300, slow.sum())
        got = search(steps, x)
        assert got is not None and got[:2] == (16, 8), (i, got)


def test_noise_finds_no_period():
    rng = np.random.default_rng(8)
    for i in range(200):
        n = int(rng.integers(30, 300))
        x = 100 + rng.normal(0, 5, n)
        assert search(np.arange(1, n + 1), x) is None, i
