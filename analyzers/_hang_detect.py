"""Whether a stopped or running job hung (analyzers/hang.py): the watchdog said so, ranks dumped,
or no rank progressed for long before the job's end point — the launcher's record of the end,
the first rank failure, the ranks' own ends; without any, now while the launcher runs, or its
last sign of life (its node record) when it was killed with the job."""

from __future__ import annotations

import time

from trainprof.analyzers._hang_views import PROGRESS_EVENTS, _longest_step_s
from trainprof.analyzers.live import HANG_MIN_S as RUNNING_HANG_MIN_S
from trainprof.rundir import worker_exits

MIN_STALL_S = 5.0

def _detect(run, views, exits=None, unrecorded=None) -> dict:
    """``unrecorded``: worker_exits.launcher_unrecorded of the run (the caller's)."""
    man = run.launcher
    reasons = []
    if man.get("status") == "hung":
        reasons.append("the hang watchdog terminated the job (manifest status 'hung')")
    elif man.get("hangs"):
        reasons.append(f"the hang watchdog fired {len(man['hangs'])} time(s)")
    dumped = sorted(v.rank for v in views.values() if v.dump)
    if dumped and not man.get("hangs"):
        reasons.append(f"hang dumps present on {len(dumped)} rank(s)")
    gaps = []
    for v in views.values():
        ts = [h["t_ns"] for h in v.heartbeats[1:] if h.get("event") in PROGRESS_EVENTS
              and h.get("t_ns")]
        gaps += [(b - a) / 1e9 for a, b in zip(ts, ts[1:])]
    gaps.sort()
    p90_gap = gaps[int(0.9 * (len(gaps) - 1))] if gaps else 0.0
    longest_step = _longest_step_s(run)
    threshold = max(MIN_STALL_S, 3 * p90_gap, 2 * longest_step)
    end_ns = (man.get("end_time") or {}).get("ns")
    closes = [w["t_close_ns"] for w in (exits or {}).get("first_failures", [])
              if isinstance(w.get("t_close_ns"), int)]
    if closes:  # the torchrun agent stopped the workers then: the job's end, not its own exit
        end_ns = min([end_ns] + closes) if end_ns else min(closes)
    # A rank's own failure ends the job: the others' wait for the launcher to stop them after it
    # (and its own exit) is no stall. Its failure record dates it; without one, a rank the agent
    # saw fail first ended no later than it closed its heartbeat.
    failed_at = [v.failure["t_ns"] for v in views.values() if v.failure and v.failure.get("t_ns")]
    first_ranks = {w["rank"] for w in (exits or {}).get("first_failures", [])}
    failed_at += [v.last_hb["t_ns"] for r, v in views.items() if r in first_ranks and v.closed
                  and isinstance(v.last_hb.get("t_ns"), int)]
    if failed_at:
        end_ns = min([end_ns] + failed_at) if end_ns else min(failed_at)
    if end_ns is None:
        ended = [run.rank_meta(r).get("ended_ns") for r in views]
        end_ns = max((e for e in ended if e), default=None)
    until = None  # the end is not recorded: the job still runs, or its launcher was killed
    if end_ns is None:
        end_ns, until = _unrecorded_end(run, unrecorded)
    if until and unrecorded["state"] == "alive":  # as `trainprof watch` judges a running job
        threshold = max(threshold, RUNNING_HANG_MIN_S)
    last = max((v.last_progress_ns for v in views.values() if v.last_progress_ns), default=None)
    # a rank that progressed after the job's end point (a peer finishing its step after the first
    # failure, before the launcher stopped it) means no stall: 0 s, never a negative one
    stalled = max(0.0, (end_ns - last) / 1e9) if end_ns and last else None
    live = [v for v in views.values() if v.heartbeats and not v.closed]
    quiet_end = None
    if stalled is not None and stalled > threshold and live and not reasons:
        quiet_end = _work_ended(man, views, live)
    if stalled is not None and stalled > threshold and live and not reasons and not quiet_end:
        reasons.append(f"no rank progressed during the last {stalled:.1f} s before "
                       f"{until or 'the job ended'} (threshold {threshold:.1f} s) and {len(live)} "
                       f"rank(s) never closed")
    recovered = bool(reasons) and man.get("status") == "ok" and not live
    return {"reasons": reasons, "end_ns": end_ns, "last_progress_ns": last, "p90_gap_s": p90_gap,
            "stalled_s": None if stalled is None else round(stalled, 3),
            "threshold_s": round(threshold, 3), "recovered": recovered,
            **({"quiet_end": quiet_end} if quiet_end else {})}


def _unrecorded_end(run, unrec: dict | None) -> tuple[int | None, str | None]:
    """(the end point, its wording) of a job whose end nobody recorded (``unrec``:
    worker_exits.launcher_unrecorded): now, while its launcher runs (a hang in progress); the
    launcher's last sign of life when it is gone without recording the job's end (killed, e.g.
    with the job by kill -9: its node record, touched every few seconds while it lived).
    (None, None) for a probe-only run."""
    if not unrec:
        return None, None
    if unrec["state"] == "alive":
        return time.time_ns(), "now (the job is still running)"
    seen = worker_exits.launcher_last_seen_ns(run.path, run.launcher)
    return (seen, "the launcher's last sign of life (it ended without recording the job's "
                  "end: killed?)") if seen else (None, None)


def _work_ended(man: dict, views: dict, live: list) -> str | None:
    """Why a stall before the end is the job's own shutdown, not a hang (None when it may be
    one): the job exited 0, every rank reached the same step and none had a collective in
    flight. Ray Train ends its workers without letting them close their heartbeat and takes
    seconds to shut down after the work."""
    if man.get("status") != "ok" or man.get("exit_code") not in (0, None) or man.get("signal"):
        return None
    steps = {v.step for v in views.values() if v.heartbeats}
    if len(steps) != 1 or None in steps or any(v.blocked for v in live):
        return None
    return (f"the job exited 0 after every rank reached step {steps.pop()} with no collective in "
            f"flight; {len(live)} rank(s) ended without closing their heartbeat (their launcher "
            "ended them, e.g. Ray Train's workers)")


# --------------------------------------------------------------------------- process exits


# --------------------------------------------------------------------------- ranks that left


# --------------------------------------------------------------------------- assembly
