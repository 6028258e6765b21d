"""When things happen: a step's wall-clock time, and the `onset` / `end` a finding carries.

``onset = {"step": N, "time": ISO-8601}``: the first step of the problem and when that step
started (the earliest ``start_ns`` of the step over the ranks that logged it; None when no rank
did). ``end``: the first step after it, present only when the problem is over — it stopped at
least ``over_after`` steps before the last step the run logged.
"""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np


def step_starts(run) -> dict[int, int]:
    """step -> earliest start_ns over the ranks (cached per run)."""
    cache = getattr(run, "_cache", None)
    key = "analyzers._onset.starts"
    if cache is not None and key in cache:
        return cache[key]
    out: dict[int, int] = {}
    try:
        st = run.steps()
    except Exception:  # noqa: BLE001 - bare traces have no step records
        st = None
    if st is not None and not st.empty and {"step", "start_ns"} <= set(st.columns):
        d = st[["step", "start_ns"]].dropna()
        g = d.groupby("step")["start_ns"].min()
        out = {int(s): int(v) for s, v in zip(g.index.to_numpy(), g.to_numpy())}
    if cache is not None:
        cache[key] = out
    return out


def iso(ns) -> str | None:
    if ns is None or not np.isfinite(float(ns)):
        return None
    return datetime.fromtimestamp(int(ns) / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds")


def at(run, step: int) -> dict:
    """{"step": step, "time": ISO-8601 of its start or None}."""
    return {"step": int(step), "time": iso(step_starts(run).get(int(step)))}


def last_step(run) -> int | None:
    s = step_starts(run)
    return max(s) if s else None


def stamp(finding, run, first: int, last: int | None, over_after: int = 1):
    """Set ``finding.onset`` (step ``first``) and, when the problem's last step ``last`` is at
    least ``over_after`` steps before the run's last logged step, ``finding.end`` (last + 1).
    Returns the finding."""
    finding.onset = at(run, first)
    end_of_run = last_step(run)
    if last is not None and end_of_run is not None and end_of_run - last >= max(1, over_after):
        finding.end = at(run, last + 1)
    return finding


def stamp_findings(run, findings) -> None:
    """onset / end for findings whose evidence names their steps but whose analyzer does not set
    them: slow steps (``slow_steps``) and loss spikes (``steps``). A periodic or recurring
    pattern that lasts to the run's end has no end."""
    for f in findings:
        if f.onset is not None:
            continue
        ev = f.evidence or {}
        steps = ev.get("slow_steps") if f.kind == "slow_steps" else \
            ev.get("steps") if f.kind == "loss_spike" else None
        steps = sorted(int(s) for s in steps or [] if isinstance(s, (int, float)))
        if not steps:
            continue
        gaps = np.diff(steps)
        typical = int(np.median(gaps)) if gaps.size else 1
        # over once the run went on without one for several of its usual gaps
        stamp(f, run, steps[0], steps[-1], over_after=max(10, 3 * typical))
