"""How the job leaves torch.distributed at exit: a gloo process group still live when a rank
ends.

A job that never calls ``torch.distributed.destroy_process_group()`` leaves its process group to
torch's teardown during interpreter finalization. With gloo that teardown races with the
group's worker threads and can abort the process (SIGABRT, "terminate called without an active
exception") after the job's work is done and its output printed (pytorch/pytorch#190489; torch's
own attempt at an atexit fix, PR #179291, was abandoned). Measured here with a 6-line 5-rank gloo
job (init, one all_gather, exit): 5 of 14 bare runs aborted; with 0.3 s of work in an atexit
hook, 0 of 10; under ``trainprof wrap``, 0 of 10. The probes' own work at exit (writing each
rank's records) shifts the timing the same way, so the crash a user sees without trainprof is
usually absent under it: this analyzer says so instead of letting it pass unseen.

The probes record the default group's state at their close (meta.json ``process_group_at_exit``,
read after the job's own atexit hooks). A finding (kind ``process_group_not_destroyed``,
``warning``) names the ranks that ended normally with a live gloo group. NCCL groups are left
out: torch prints its own warning for them ("process group has NOT been destroyed"), with or
without trainprof. Runs recorded before the field existed say nothing.
"""

from __future__ import annotations

from trainprof.analyzers._hang_exits import ended_normally
from trainprof.findings import AnalyzerResult, Finding
from trainprof.rankranges import ranges
from trainprof.rundir import worker_exits

NAME = "teardown"
TORCH_ISSUE = "https://github.com/pytorch/pytorch/issues/190489"


def analyze(run) -> AnalyzerResult:
    states = {r: run.rank_meta(r).get("process_group_at_exit") for r in run.ranks}
    states = {r: s for r, s in states.items() if isinstance(s, dict) and "live" in s}
    if not states:
        return AnalyzerResult()
    live = {r: str(s.get("backend") or "") for r, s in states.items() if s.get("live")}
    metrics = {"ranks_recorded": len(states), "live_at_exit": ranges(sorted(live)),
               "destroyed": ranges(sorted(r for r in states if r not in live))}
    gloo = sorted(r for r, b in live.items() if "gloo" in b)
    if not gloo:
        return AnalyzerResult(metrics=metrics)
    workers = worker_exits.summarize(run.worker_exits())["workers"]
    clean = [r for r in gloo if ended_normally(run, r, workers)]
    if not clean:  # ranks that failed or were killed: the hang analyzer says how they ended
        return AnalyzerResult(metrics=metrics)
    backends = sorted({live[r] for r in clean})
    who = f"rank{'s' * (len(clean) > 1)} {ranges(clean)}"
    message = (
        f"{who} ended with {'their' if len(clean) > 1 else 'its'} gloo process group still live "
        f"(the job never calls torch.distributed.destroy_process_group()): torch then tears the "
        f"group down during interpreter finalization, where gloo can abort the process (SIGABRT, "
        f"\"terminate called without an active exception\") after all its work is done, a race "
        f"in torch ({TORCH_ISSUE}). Under trainprof the ranks' work at exit (writing their "
        f"records) shifts that timing and usually avoids the abort, so this job can crash "
        f"without trainprof where it did not here")
    return AnalyzerResult(metrics=metrics, findings=[Finding(
        kind="process_group_not_destroyed", severity="warning", ranks=clean, message=message,
        evidence={"ranks": ranges(clean), "backend": ", ".join(backends),
                  "ranks_recorded": len(states), "torch_issue": TORCH_ISSUE},
        analyzer=NAME)])
