"""The probes' one periodic thread: shared schedule, isolation of a failing task, stop."""

from __future__ import annotations

import threading
import time

from helpers import wait_for
from trainprof.probes.ticker import Ticker


def test_periods_share_one_grid_so_tasks_fire_together():
    t = Ticker()
    t.every(0.5, lambda: None)
    t.every(1.0, lambda: None)
    t.every(0.25, lambda: None)
    for period, due, _, _ in t._tasks:
        # due times on origin + k * period: the 1 s task is due when a 0.5 s one is
        k = (due - t._origin) / period
        assert abs(k - round(k)) < 1e-9 and round(k) >= 1
    dues = sorted(x[1] for x in t._tasks)
    assert abs(dues[1] - dues[0] - 0.25) < 1e-9 and abs(dues[2] - dues[0] - 0.75) < 1e-9


def test_tasks_run_on_one_named_thread_and_a_failing_task_does_not_stop_the_others(capsys):
    calls = {"fast": [], "slow": [], "bad": 0}

    def bad():
        calls["bad"] += 1
        raise RuntimeError("boom")

    t = Ticker()
    t.every(0.05, lambda: calls["fast"].append(threading.current_thread().name))
    t.every(0.1, lambda: calls["slow"].append(time.monotonic()))
    t.every(0.05, bad)
    t.start()
    try:
        assert wait_for(lambda: len(calls["slow"]) >= 3 and calls["bad"] >= 5, 10)
    finally:
        t.stop()
    assert set(calls["fast"]) == {"trainprof-tick"}
    assert len(calls["fast"]) >= 5
    assert capsys.readouterr().err.count("periodic") == 3  # reported three times, then quiet
    n = len(calls["fast"])
    time.sleep(0.3)
    assert len(calls["fast"]) <= n + 1  # stopped (one call may have been under way)


def test_a_late_task_is_not_run_twice():
    runs = []
    t = Ticker()
    t.every(0.05, lambda: (runs.append(time.monotonic()), time.sleep(0.2)))
    t.start()
    try:
        assert wait_for(lambda: len(runs) >= 3, 10)
    finally:
        t.stop()
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert min(gaps) >= 0.2  # after a 0.2 s run it waits for the next slot, no catch-up burst
