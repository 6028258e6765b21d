"""Whether the profiled window holds training steps at all: a job shorter than the window (or one
whose profiler ran only over start-up or teardown) leaves a trace of idle time, which read as a
measurement would say "0 % exposed communication". The trace-based figures are withheld then."""

from __future__ import annotations

NO_COMPUTE_MS = 0.05  # < 50 µs of ops per profiled step (a training step of the tiniest model
NO_COMM = 0.02       # runs ≥ 0.3 ms of them) and communication < 2 % of it, on every rank


def off_training(run, per_rank: list[dict]) -> str | None:
    """Why the profiled steps are not training steps (a problem line), or None when they are.
    ``per_rank``: comm_compute's per-rank summaries (fractions of the profiled step window)."""
    after = _after_last_step(run)
    ops = {r["rank"]: (r["compute_fraction"] + r["overlapped_fraction"]) * r["step_window_ms"]
           for r in per_rank}
    idle = bool(per_rank) and all(ops[r["rank"]] < NO_COMPUTE_MS and r["comm_fraction"] < NO_COMM
                                  for r in per_rank)
    if not after and not idle:
        return None
    why = [after[0]] if after else []
    if idle:
        why.append(f"its steps hold no training work (≤ {max(ops.values()):.2f} ms of ops per "
                   f"step and no communication on every rank: start-up or teardown only)")
    return ("the profiler window did not cover training steps: " + "; ".join(why)
            + ": the trace-based figures (communication vs compute, ops, roofline, launch, "
              "stragglers from traces) are withheld; profile steps the job runs: "
            + (f"`trainprof wrap --profile-steps {_window_before(after[1])}`" if after
               else "`trainprof wrap --profile-steps FIRST-LAST` (or the job's profiler schedule)"))


def _after_last_step(run) -> tuple[str, int] | None:
    """(why, the last recorded step) when the window (meta.json profile_steps) starts after the
    last step a rank recorded."""
    if getattr(run, "trace_inputs", None):
        return None
    try:
        steps = run.steps()
    except Exception:  # noqa: BLE001 - the step-time analyzer reports an unreadable stream
        return None
    if steps.empty or not {"rank", "step"} <= set(steps):
        return None
    last = steps.groupby("rank")["step"].max()
    late = []
    for r in run.ranks:
        try:
            ps = (run.rank_meta(r) or {}).get("profile_steps") or []
        except Exception:  # noqa: BLE001
            continue
        if len(ps) == 2 and r in last.index and int(ps[0]) > int(last[r]):
            late.append((r, ps, int(last[r])))
    if not late:
        return None
    r, ps, lst = late[0]
    return (f"the window (steps {ps[0]}–{ps[1]}) starts after the last recorded training step "
            f"({lst}) on {len(late)} of {len(run.ranks)} rank(s) (the job ended first)", lst)


def _window_before(last: int) -> str:
    """A --profile-steps window the job reaches, ending at its last recorded step (step 0,
    set-up, only when it is the only one)."""
    return f"{max(1, last - 1)}-{last}" if last >= 1 else "0-0"
