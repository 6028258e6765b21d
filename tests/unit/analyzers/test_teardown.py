"""A process group left live at exit: the probe's record (a real gloo group in this process) and
the analyzer on written run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import write_worker_exits
from trainprof.analysis.run import RunDir
from trainprof.analyzers import teardown
from trainprof.rundir.files import write_json_atomic


def _run(root: Path, states: dict, exits: dict | None = None, extra: dict | None = None) -> RunDir:
    for r, st in states.items():
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        meta = {"rank": r, "world_size": len(states), **(extra or {})}
        if st is not None:
            meta["process_group_at_exit"] = st
        write_json_atomic(d / "meta.json", meta)
        (d / "heartbeat.jsonl").write_text(json.dumps(
            {"t_ns": 1, "event": "close", "step": 3, "inflight": [], "inflight_count": 0}) + "\n")
    if exits is not None:
        write_worker_exits(root, 10.0, exits, exits)
    return RunDir(root)


LIVE = {"live": True, "backend": "gloo"}
GONE = {"live": False, "backend": None}


def test_live_gloo_group_at_a_clean_exit_is_a_warning_naming_the_ranks(tmp_path):
    res = teardown.analyze(_run(tmp_path, {0: LIVE, 1: LIVE, 2: GONE}))
    (f,) = res.findings
    assert (f.kind, f.severity, f.ranks) == ("process_group_not_destroyed", "warning", [0, 1])
    assert f.message.startswith("ranks 0-1 ended with their gloo process group still live")
    assert "terminate called without an active exception" in f.message
    assert f.evidence["backend"] == "gloo" and f.evidence["ranks_recorded"] == 3
    assert res.metrics == {"ranks_recorded": 3, "live_at_exit": "0-1", "destroyed": "2"}


def test_destroyed_groups_nccl_and_old_runs_say_nothing(tmp_path):
    assert teardown.analyze(_run(tmp_path / "a", {0: GONE, 1: GONE})).findings == []
    nccl = teardown.analyze(_run(tmp_path / "b", {0: {"live": True, "backend": "nccl"}}))
    assert nccl.findings == [] and nccl.metrics["live_at_exit"] == "0"
    old = teardown.analyze(_run(tmp_path / "c", {0: None, 1: None}))
    assert old.findings == [] and old.metrics == {}


def test_a_rank_that_failed_is_left_to_the_hang_analyzer(tmp_path):
    res = teardown.analyze(_run(tmp_path, {0: LIVE, 1: LIVE}, exits={0: 0, 1: 1}))
    (f,) = res.findings
    assert f.ranks == [0]
    res = teardown.analyze(_run(tmp_path / "both", {0: LIVE, 1: LIVE}, exits={0: -6, 1: 1}))
    assert res.findings == []


def test_the_probe_reads_the_default_group_as_the_job_leaves_it(tmp_path):
    import torch.distributed as dist

    from trainprof.probes.rankinfo import process_group_at_exit

    import sys

    from trainprof.probes.rankinfo import TEARDOWN_FRAMEWORKS

    assert process_group_at_exit() == {"live": False, "backend": None}
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        got = process_group_at_exit()
        loaded = [m for m in TEARDOWN_FRAMEWORKS if m in sys.modules]  # (other tests' imports)
        assert got == {"live": True, "backend": "gloo", **({"frameworks": loaded} if loaded else {})}
        fake = type(sys)("deepspeed")
        sys.modules.setdefault("deepspeed", fake)  # the job imported DeepSpeed: looked up, not imported
        try:
            assert "deepspeed" in process_group_at_exit()["frameworks"]
        finally:
            if sys.modules.get("deepspeed") is fake:
                del sys.modules["deepspeed"]
    finally:
        dist.destroy_process_group()
    assert process_group_at_exit() == {"live": False, "backend": None}


def test_the_finding_reaches_the_summary_with_its_fix(tmp_path):
    from trainprof.analysis.runner import analyze_and_write

    run = _run(tmp_path / "run", {0: LIVE, 1: LIVE})
    summary, _, _ = analyze_and_write(run.path, tmp_path / "out", report=False)
    (f,) = [f for f in summary["findings"] if f["kind"] == "process_group_not_destroyed"]
    assert f["fix"].startswith("call torch.distributed.destroy_process_group()")
    assert summary["metrics"]["teardown"]["live_at_exit"] == "0-1"


ACC_META = {"framework": {"name": "accelerate", "version": "1.15.0", "steps_marked": 30},
            "run_info": {"framework": "accelerate", "framework_version": "1.15.0"}}


@pytest.mark.parametrize("extra,pg_extra,fw,call,fix", [
    # a plain accelerate loop (the probes followed AcceleratedOptimizer.step)
    (ACC_META, {}, "accelerate", "accelerator.end_training()", "call accelerator.end_training()"),
    # the HF Trainer (built on accelerate: the Trainer's run is the one recorded)
    ({"framework": {"name": "transformers"}}, {"frameworks": ["accelerate", "transformers"]},
     "transformers", "trainer.end()", "call trainer.end()"),
    ({"run_info": {"framework": "pytorch_lightning"}}, {}, "lightning",
     "torch.distributed.destroy_process_group()", "call torch.distributed.destroy_process_group() "
     "on every rank after trainer.fit()"),
    # a DeepSpeed engine: no framework loop followed, DeepSpeed imported
    ({}, {"frameworks": ["deepspeed"]}, "deepspeed", "deepspeed.comm.destroy_process_group()",
     "call deepspeed.comm.destroy_process_group()"),
    # plain torch: the default
    ({}, {}, None, "torch.distributed.destroy_process_group()",
     "call torch.distributed.destroy_process_group() on every rank once training is done"),
])
def test_the_fix_is_the_frameworks_own_teardown(tmp_path, extra, pg_extra, fw, call, fix):
    from trainprof.analysis.runner import analyze_and_write

    run = _run(tmp_path / "run", {0: {**LIVE, **pg_extra}, 1: {**LIVE, **pg_extra}}, extra=extra)
    summary, _, _ = analyze_and_write(run.path, tmp_path / "out", report=False)
    (f,) = [f for f in summary["findings"] if f["kind"] == "process_group_not_destroyed"]
    assert f["evidence"]["framework"] == fw
    assert f["fix"].startswith(fix), f["fix"]
    assert f"(the job never calls {call})" in f["message"]
    if fw is not None:
        assert "torch.distributed.destroy_process_group() on every rank once" not in f["fix"]
