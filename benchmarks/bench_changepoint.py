"""Cost of the change-point search behind onsets (analyzers/_changepoint.py): per-rank excess
series of R ranks × S steps (noise 0.6 ms, step 10 ms), one rank 6 ms slower from 60 % of the
run; prints wall time, peak RSS, whether the onset was found within 1 % of the steps and how
many clean ranks got an episode. Clean ranks are ruled out by the count of steps over the floor
first (as stragglers' episodes do); the slow rank's series is segmented in full.

    python benchmarks/bench_changepoint.py [--ranks 1024] [--steps 100000]
"""

from __future__ import annotations

import argparse
import resource
import time
from types import SimpleNamespace

import numpy as np

from trainprof.analyzers import _changepoint as cp
from trainprof.analyzers import _straggler_episodes as ep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100_000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    onset = int(0.6 * a.steps)
    th = SimpleNamespace(MIN_EXCESS=0.10, MIN_EXCESS_MS=2.0, FLOOR=0.03, SCORE=1.5,
                         SIGNIFICANCE=3.0, CHRONIC=0.5)
    floor = max(th.MIN_EXCESS * 10.0, th.MIN_EXCESS_MS)
    found, false = None, 0
    series = rng.normal(0, 0.6, (min(a.ranks, 64), a.steps))  # reused: generation not timed
    t0 = time.perf_counter()
    for r in range(a.ranks):
        x = series[r % series.shape[0]].copy()
        if r == 7:
            x[onset:] += 6.0
        if (x >= floor).sum() < th.CHRONIC * ep.min_len(a.steps):  # find()'s pre-filter
            continue
        eps = cp.episodes(x, floor, ep.min_len(a.steps) // 2)
        eps = [e for e in eps if e["end"] - e["start"] >= ep.min_len(a.steps)]
        if r == 7:
            found = eps[0]["start"] if eps else None
        elif eps:
            false += 1
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ok = found is not None and abs(found - onset) <= 0.01 * a.steps
    print(f"{a.ranks} ranks x {a.steps} steps: {dt:.1f} s ({1e3 * dt / a.ranks:.1f} ms/rank), "
          f"peak RSS {rss:.0f} MiB; onset {found} (true {onset}, within 1 %: {ok}); "
          f"clean ranks with an episode: {false}")


if __name__ == "__main__":
    main()
