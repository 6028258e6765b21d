"""Ranks that never communicate, said from written run directories; silent where it cannot be told."""

from __future__ import annotations

import json
from pathlib import Path

from trainprof.analysis.run import RunDir
from trainprof.analyzers import collectives
from trainprof.rundir.files import write_json_atomic


def _run(root: Path, world=2, steps=5, meta_extra=None, colls=None, per_rank_meta=None) -> Path:
    write_json_atomic(root / "manifest.json", {"schema_version": 1, "status": "ok"})
    for r in range(world):
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        meta = {"rank": r, "world_size": world, "activated_by": "init_process_group",
                "backend": "gloo", **(meta_extra or {}), **((per_rank_meta or {}).get(r) or {})}
        write_json_atomic(d / "meta.json", meta)
        recs = [{"step": s, "start_ns": 10**9 + s * 10**8, "end_ns": 10**9 + s * 10**8 + 9 * 10**7,
                 "dur_ms": 90.0, "source": "optimizer"} for s in range(steps)]
        (d / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
        if colls:
            (d / "collectives.jsonl").write_text("".join(json.dumps(c) + "\n" for c in colls))
            (d / "groups.jsonl").write_text(json.dumps({"pg": "0", "ranks": list(range(world))}) + "\n")
    return root


def _found(root):
    return [f for f in collectives.analyze(RunDir(root)).findings if f.kind == "no_communication"]


def test_ranks_that_never_communicate_are_said(tmp_path):
    fw = {"framework": {"name": "accelerate", "data_parallel_size": 1}}
    (f,) = _found(_run(tmp_path / "a", world=2, steps=32, meta_extra=fw))
    assert f.severity == "warning" and f.ranks == [0, 1]
    assert f.message.startswith("the job's 2 ranks issued no collective in 32 steps each: nothing "
                                "synchronizes them, so each rank trains its own model")
    assert "every rank called init_process_group, but no collective followed" in f.message
    assert "accelerate reports a data-parallel size of 1" in f.message
    assert f.evidence["steps_per_rank"] == {"0": 32, "1": 32}
    # processes that never called init_process_group (WORLD_SIZE set by the launcher)
    (f,) = _found(_run(tmp_path / "b", world=3, steps=4,
                       meta_extra={"activated_by": "optimizer_step", "backend": None}))
    assert "no rank called init_process_group: the processes never formed a group" in f.message
    assert "3 ranks issued no collective in 4 steps each" in f.message


def test_silent_where_it_cannot_be_told(tmp_path):
    coll = [{"step": 1, "pg": "0", "seq": 1, "op": "all_reduce", "bytes": 4, "enqueue_ns": 10**9,
             "end_ns": 10**9 + 1000, "blocked_ms": 0.001}]
    assert not _found(_run(tmp_path / "comm", colls=coll))               # they communicate
    assert not _found(_run(tmp_path / "one", world=1))                   # one rank
    assert not _found(_run(tmp_path / "short", steps=2))                 # too few steps
    assert not _found(_run(tmp_path / "off", meta_extra={"probes_off": ["collectives"]}))
    assert not _found(_run(tmp_path / "noprobe", per_rank_meta={1: {"activated_by": None}}))
