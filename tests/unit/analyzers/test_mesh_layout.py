"""The job's parallel layout as reported: an unnamed DeviceMesh dimension keeps its real size
(dim0=2, never dp1), HSDP's dp dims combine, and plain DDP (no DeviceMesh) reads as dp from the
group the DDP probe labelled — in the header, the rank labels and the analyzers' coordinates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainprof.analysis.runner import run_info
from trainprof.meshinfo import group_coords, group_sizes, mesh_sizes
from trainprof.reports import kit
from trainprof.analysis.run import RunDir


@pytest.mark.parametrize("names, shape, expect", [
    (["dim0"], [2], {"dim0": 2}),  # init_device_mesh("cpu", (2,)): unnamed
    (["dp"], [2], {"dp": 2, "pp": 1, "tp": 1}),
    (["dp_replicate", "dp_shard", "tp"], [2, 2, 2], {"dp": 4, "pp": 1, "tp": 2}),
    (["pp", "cp"], [2, 4], {"dp": 1, "pp": 2, "tp": 1, "cp": 4}),
    (["dim0", "dim1"], [2, 3], {"dim0": 2, "dim1": 3}),
])
def test_mesh_sizes(names, shape, expect):
    assert mesh_sizes({"dim_names": names, "shape": shape}) == expect


def test_labelled_groups_give_ddp_coordinates_and_sizes():
    groups = [{"pg": "0", "ranks": [0, 1, 2, 3], "mesh_dim": "dp", "size": 4},
              {"pg": "1", "ranks": [5], "mesh_dim": "dp"},  # a group of one: no coordinate
              {"pg": "2", "ranks": [0, 2], "mesh_dim": None}]
    assert group_coords(groups, 2) == {"dp": 2} and group_coords(groups, 7) == {}
    assert group_sizes(groups, 4) == {"dp": 4, "pp": 1, "tp": 1}
    assert group_sizes(groups, 8) == {}  # a dp group of 4 in a world of 8: the layout is unknown


def _run(tmp_path: Path, meta: dict, groups: list[dict] | None, world: int = 2) -> RunDir:
    root = tmp_path / "run"
    (root / "ranks").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(
        {"schema_version": 1, "kind": "trainprof-run", "command": ["torchrun", "job.py"],
         "status": "ok", "exit_code": 0}))
    for r in range(world):
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir()
        m = {"rank": r, "world_size": world, "host": "h", "device": "cpu", **meta}
        if "mesh" in meta:
            m["mesh"] = {**meta["mesh"], "coord": [r]}
            m["coords"] = {meta["mesh"]["dim_names"][0]: r}
        (d / "meta.json").write_text(json.dumps(m))
        if groups is not None:
            (d / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    return RunDir(root)


def test_unnamed_fsdp_mesh_reports_its_real_size(tmp_path):
    run = _run(tmp_path, {"mesh": {"dim_names": ["dim0"], "shape": [2], "device_type": "cpu"}},
               [{"pg": "0", "ranks": [0, 1], "mesh_dim": "dim0", "size": 2}])
    info = run_info(run)
    assert info["mesh"] == {"dim0": 2}  # not dp1·pp1·tp1
    assert kit.mesh_text(info["mesh"]) == "dim0=2"
    assert [kit.coord_text(r["coords"]) for r in info["ranks"]] == ["dim0=0", "dim0=1"]  # not dim00


def test_plain_ddp_reads_as_dp(tmp_path):
    run = _run(tmp_path, {"ddp": [{"pg": "0", "world": 2}]},
               [{"pg": "0", "ranks": [0, 1], "mesh_dim": "dp", "backend": "gloo", "size": 2}])
    assert run.coords(1) == {"dp": 1}  # the analyzers' coordinates: not "unknown"
    info = run_info(run)
    assert info["mesh"] == {"dp": 2, "pp": 1, "tp": 1}
    assert [r["coords"] for r in info["ranks"]] == [{"dp": 0}, {"dp": 1}]


def test_no_mesh_and_no_labelled_group_stays_unknown(tmp_path):
    run = _run(tmp_path, {}, None)
    assert run.coords(0) == {} and run_info(run)["mesh"] == {}


def test_headers_render_the_mesh(tmp_path):
    from trainprof.reports import html

    summary = {"run": {"dir": "r", "world_size": 2, "mesh": {"dim0": 2},
                       "ranks": [{"rank": 0, "coords": {"dim0": 0}}, {"rank": 1, "coords": {"dp": 1}}]}}
    assert html._rank_labels(summary) == {0: "rank 0 (dim0=0)", 1: "rank 1 (dp1)"}
    assert "dim0=2" in html._header(summary)


def test_unmatched_gloo_events_of_a_one_group_rank_take_that_group():
    """Plain DDP: the collective log names the default group only, so a gloo event outside
    every logged window (profiler/clock slack) is that group's, not 'unknown'."""
    import pandas as pd

    from trainprof.analyzers._comm_groups import gloo_event_groups

    ms = 1_000_000
    events = pd.DataFrame({"name": ["gloo:all_reduce", "gloo:all_reduce"], "tid": [7, 8],
                           "ts_ns": [10 * ms, 50 * ms], "end_ns": [11 * ms, 51 * ms]})
    one = pd.DataFrame({"pg": ["0"], "op": ["all_reduce"], "enqueue_ns": [9 * ms], "end_ns": [12 * ms]})
    assert list(gloo_event_groups(events, one)) == ["0", "0"]
    two = pd.concat([one, pd.DataFrame({"pg": ["1"], "op": ["broadcast"], "enqueue_ns": [0],
                                        "end_ns": [ms]})])
    assert list(gloo_event_groups(events, two)) == ["0", None]  # another group exists: unknown
