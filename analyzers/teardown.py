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
``warning``) names the ranks that ended normally with a live gloo group, with the fix of the
framework that ran the job (``framework``: accelerate's ``accelerator.end_training()``, the HF
Trainer's ``trainer.end()``, Lightning, DeepSpeed; else ``destroy_process_group()``). NCCL groups are left
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
_DESTROY = "torch.distributed.destroy_process_group()"
# per framework: (the call the job never made, the fix). Checked against accelerate 1.15
# (Accelerator.end_training() destroys the group since 0.34), transformers 5.24 (Trainer.end()
# calls it; the Trainer itself never does), Lightning 2.6 (an atexit hook destroys the group it
# created, for NCCL only) and DeepSpeed 0.19 (deepspeed.comm.destroy_process_group() also drops
# its own group records; init_distributed() never destroys the group).
TEARDOWN = {
    None: (_DESTROY, f"call {_DESTROY} on every rank once training is done (after the last "
                     f"collective)"),
    "accelerate": ("accelerator.end_training()",
                   "call accelerator.end_training() on every rank at the very end of the script, "
                   "after the last collective and any save: it destroys the process group "
                   f"(before accelerate 0.34 it does not: call {_DESTROY} after it)"),
    "transformers": ("trainer.end()",
                     "call trainer.end() on every rank at the very end of the script, after "
                     "train() and any evaluate(), save_model() or push_to_hub(): the Trainer "
                     "never destroys its process group (transformers without Trainer.end: "
                     "trainer.accelerator.end_training())"),
    "lightning": (_DESTROY, f"call {_DESTROY} on every rank after trainer.fit() and any test() or "
                            f"predict() after it: Lightning destroys the group at exit only for "
                            f"NCCL"),
    "deepspeed": ("deepspeed.comm.destroy_process_group()",
                  "call deepspeed.comm.destroy_process_group() on every rank once training is "
                  "done (after the last collective and any save_checkpoint): "
                  "deepspeed.init_distributed() never destroys the group"),
}
_ALIASES = {"pytorch_lightning": "lightning"}


def framework(run, ranks) -> str | None:
    """The framework whose teardown the fix names: the one whose training loop the probes
    followed (meta.json ``framework``, or ``run_info.framework``), else DeepSpeed when the job
    imported it (``process_group_at_exit.frameworks``: a DeepSpeed engine has no loop of its own
    to follow); None for a plain torch job."""
    loaded = set()
    for r in ranks:
        meta = run.rank_meta(r)
        fw = meta.get("framework")
        name = fw.get("name") if isinstance(fw, dict) else None
        name = name or (meta.get("run_info") or {}).get("framework")
        if isinstance(name, str) and _ALIASES.get(name, name) in TEARDOWN:
            return _ALIASES.get(name, name)
        pg = meta.get("process_group_at_exit") or {}
        loaded.update(x for x in pg.get("frameworks") or [] if isinstance(x, str))
    return "deepspeed" if "deepspeed" in loaded else None


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
    fw = framework(run, clean)
    call, fix = TEARDOWN.get(fw, TEARDOWN[None])
    who = f"rank{'s' * (len(clean) > 1)} {ranges(clean)}"
    message = (
        f"{who} ended with {'their' if len(clean) > 1 else 'its'} gloo process group still live "
        f"(the job never calls {call}): torch then tears the "
        f"group down during interpreter finalization, where gloo can abort the process (SIGABRT, "
        f"\"terminate called without an active exception\") after all its work is done, a race "
        f"in torch ({TORCH_ISSUE}). Under trainprof the ranks' work at exit (writing their "
        f"records) shifts that timing and usually avoids the abort, so this job can crash "
        f"without trainprof where it did not here")
    return AnalyzerResult(metrics=metrics, findings=[Finding(
        kind="process_group_not_destroyed", severity="warning", ranks=clean, message=message,
        evidence={"ranks": ranges(clean), "backend": ", ".join(backends),
                  "ranks_recorded": len(states), "torch_issue": TORCH_ISSUE, "framework": fw},
        fix=fix,
        analyzer=NAME)])
