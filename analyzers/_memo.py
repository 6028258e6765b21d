"""One analysis per run: an analyzer whose result another analyzer reads (step_time for
slow_steps, stragglers for comm_compute and slow_steps) is computed once and kept in the run's
cache."""

from __future__ import annotations


def once(run, key: str, fn):
    """``fn(run)``, computed once per run (kept in ``run._cache`` under ``key``)."""
    cache = getattr(run, "_cache", None)
    if cache is None:
        return fn(run)
    if key not in cache:
        cache[key] = fn(run)
    return cache[key]
