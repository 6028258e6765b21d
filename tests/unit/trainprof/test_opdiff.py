"""Which ops moved (trainprof/gate/opdiff.py) in `trainprof compare`: added/removed ops, per-op time
per step on each side, the largest change first; informational only (exit codes unchanged).

Cases that run multi-process jobs: tests/integration/test_opdiff_jobs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli
from trainprof.analyzers import ops
from trainprof.gate.opdiff import op_diff
from trainprof.trace import load_trace
from paths import FIXTURES

COMPARE = FIXTURES / "compare"
GPU_TRACE = FIXTURES / "gpu" / "h100_item_sync.pt.trace.json.gz"


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 3, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def trace(path: Path, rank: int, mm_us: int = 0, cdist_us: int = 0, relu: bool = True,
          gloo_us: int = 0, c10d_us: int = 0) -> Path:
    """Two steps of 2000 µs on thread 1: a forward with linear (and relu), optional extra
    aten::mm / cdist / c10d::allreduce_, and a gloo all-reduce on communication thread 2."""
    ev = []
    for i in range(2):
        t0 = i * 2000
        ev += [_x(f"ProfilerStep#{i + 1}", t0, 2000, cat="user_annotation"),
               _x("forward", t0 + 10, 600, cat="user_annotation"),
               _x("aten::linear", t0 + 20, 300), _x("aten::addmm", t0 + 30, 250)]
        if relu:
            ev.append(_x("aten::relu", t0 + 400, 100))
        if mm_us:
            ev.append(_x("aten::mm", t0 + 700, mm_us))
        if cdist_us:
            ev.append(_x("aten::cdist", t0 + 1700, cdist_us))
        if c10d_us:
            ev.append(_x("c10d::allreduce_", t0 + 1400, c10d_us))
        if gloo_us:
            ev.append(_x("gloo:all_reduce", t0 + 100, gloo_us, tid=2, cat="user_annotation"))
    path.write_text(json.dumps({"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": ev}))
    return path


def ops_metrics(tmp: Path, tag: str, **kw) -> dict:
    digests = {}
    for rank in (0, 1):
        tr = load_trace(trace(tmp / f"{tag}-{rank}.json", rank, **kw))
        digests[rank] = ops.trace_digest(None, rank, tr)
    return ops.combine(digests)


def summary_with(ops_m: dict) -> dict:
    return {"schema_version": 1, "run": {}, "metrics": {"ops": ops_m}}


def test_added_removed_and_largest_change_first(tmp_path):
    b = [ops_metrics(tmp_path, f"b{i}", mm_us=100) for i in range(2)]
    c = [ops_metrics(tmp_path, "c0", mm_us=400, cdist_us=50, relu=False),
         ops_metrics(tmp_path, "c1", mm_us=600, cdist_us=50, relu=False)]
    d = op_diff([(summary_with(m), None) for m in b], [(summary_with(m), None) for m in c])
    assert d["available"] and d["runs"] == [2, 2] and "kernels" not in d
    t = d["cpu_ops"]
    top = t["top"]
    # mm: 0.1 ms/step before; after, the mean of the runs' 0.4 and 0.6 ms/step
    assert top[0]["name"] == "aten::mm" and top[0]["status"] == "changed" and top[0]["role"] == "compute"
    assert (top[0]["baseline_ms"], top[0]["candidate_ms"], top[0]["delta_ms"]) == \
        (pytest.approx(0.1), pytest.approx(0.5), pytest.approx(0.4))
    assert top[0]["change"] == pytest.approx(4.0)
    by = {r["name"]: r for r in top}
    assert by["aten::relu"]["status"] == "removed" and by["aten::relu"]["delta_ms"] == pytest.approx(-0.1)
    assert by["aten::cdist"]["status"] == "added" and by["aten::cdist"]["candidate_ms"] == pytest.approx(0.05)
    assert [o["name"] for o in t["added"]] == ["aten::cdist"]
    assert [o["name"] for o in t["removed"]] == ["aten::relu"]
    assert by["aten::linear"]["delta_ms"] == 0
    # relu ran inside forward: without it, forward's self time grows by relu's 0.1 ms
    assert by["forward"]["delta_ms"] == pytest.approx(0.1)
    assert [r["name"] for r in top[:4]] == ["aten::mm", "aten::relu", "forward", "aten::cdist"]
    assert t["delta_ms"] == pytest.approx(0.4 - 0.1 + 0.1 + 0.05)  # CPU self time per step
    assert d["top_contributor"]["name"] == "aten::mm" and d["top_contributor"]["table"] == "cpu_ops"


def test_waiting_is_listed_apart_from_the_top_contributors(tmp_path):
    """The gloo all-reduce (communication thread) grows by 0.7 ms/step and the c10d call on the
    step's thread (a wait) by 0.2 ms/step, more than aten::mm's 0.15 ms/step: aten::mm is still
    the top contributor; the waits are listed apart, largest first, with their roles."""
    b = ops_metrics(tmp_path, "b", mm_us=100, gloo_us=200, c10d_us=50)
    c = ops_metrics(tmp_path, "c", mm_us=250, gloo_us=900, c10d_us=250)
    d = op_diff([(summary_with(b), None)], [(summary_with(c), None)])
    t = d["cpu_ops"]
    assert [(r["name"], r["role"], r["delta_ms"]) for r in t["top"] if r["delta_ms"]] == \
        [("aten::mm", "compute", pytest.approx(0.15))]
    assert [(r["name"], r["role"], r["delta_ms"]) for r in t["waiting"]] == \
        [("gloo:all_reduce", "communication", pytest.approx(0.7)), ("c10d::allreduce_", "wait", pytest.approx(0.2))]
    assert t["other_threads"] == []
    assert d["top_contributor"]["name"] == "aten::mm" and d["top_contributor"]["role"] == "compute"
    assert [w["name"] for w in d["waiting_moved"]] == ["gloo:all_reduce", "c10d::allreduce_"]
    # every compared row keeps its role; the largest change of all is the gloo all-reduce
    assert t["rows"][0]["name"] == "gloo:all_reduce" and len(t["rows"]) == t["ops_compared"] == 7
    assert {r["name"]: r["role"] for r in t["rows"]}["forward"] == "compute"
    # self time per step by role: compute = forward 200 + linear 50 + addmm 250 + relu 100 + mm
    assert t["by_role"]["compute"] == {"baseline": pytest.approx(0.7), "candidate": pytest.approx(0.85),
                                       "delta": pytest.approx(0.15)}
    assert t["by_role"]["wait"]["delta"] == pytest.approx(0.2)
    assert t["by_role"]["communication"]["delta"] == pytest.approx(0.7)
    # the step's thread outside any op: 2000 µs - forward 600 - mm - c10d
    assert d["outside_ops_ms"] == {"baseline": pytest.approx(1.25), "candidate": pytest.approx(0.9),
                                   "delta": pytest.approx(-0.35)}


def test_gpu_kernels_communication_is_waiting(tmp_path):
    """On GPU runs the kernels are compared first: a compute kernel that grew is the top
    contributor; an NCCL kernel that grew more is listed as waiting."""
    import copy

    base = ops.combine({0: ops.trace_digest(None, 0, load_trace(GPU_TRACE))})
    nccl = {"name": "ncclKernel_AllReduce_RING_LL_Sum_float", "group": "communication", "ranks": 1,
            "count": 5, "calls_per_step": 1.0, "total_ms": 5.0, "total_ms_per_step": 1.0}
    base["kernels"].append(dict(nccl))
    cand = copy.deepcopy(base)
    gemm = cand["kernels"][0]
    gemm["total_ms_per_step"] += 0.5
    cand["kernels"][-1]["total_ms_per_step"] = 3.0
    d = op_diff([(summary_with(base), None)], [(summary_with(cand), None)])
    k = d["kernels"]
    assert (k["top"][0]["name"], k["top"][0]["role"], k["top"][0]["delta_ms"]) == \
        (gemm["name"], "compute", pytest.approx(0.5))
    assert [(r["name"], r["role"], r["delta_ms"]) for r in k["waiting"]] == \
        [(nccl["name"], "communication", pytest.approx(2.0))]
    assert d["top_contributor"]["table"] == "kernels" and d["top_contributor"]["name"] == gemm["name"]
    assert d["waiting_moved"][0] == {"table": "kernels", "name": nccl["name"], "role": "communication",
                                     "delta_ms": pytest.approx(2.0)}


def test_metrics_written_before_roles_get_roles_from_names(tmp_path):
    """An ops breakdown without roles (and no run directory to analyze again): gloo: ops are
    communication, c10d ops waits, the rest compute; said in a note."""
    b = ops_metrics(tmp_path, "b", mm_us=100, gloo_us=200, c10d_us=50)
    c = ops_metrics(tmp_path, "c", mm_us=250, gloo_us=900, c10d_us=250)
    for m in (b, c):
        m["job"].pop("cpu_self_ms_per_step_by_role")
        for r in m["cpu_ops"]:
            r.pop("role")
        m["name_sums"]["cpu_ops"] = sorted(ops.name_sum(r["name"]) for r in m["cpu_ops"])
    d = op_diff([(summary_with(b), None)], [(summary_with(c), None)])
    t = d["cpu_ops"]
    assert t["roles_inferred"] and any("inferred from op names" in n for n in d["notes"])
    assert d["top_contributor"]["name"] == "aten::mm"
    assert [(r["name"], r["role"]) for r in t["waiting"]] == \
        [("gloo:all_reduce", "communication"), ("c10d::allreduce_", "wait")]
    assert all(r["status"] == "changed" for r in t["rows"])


def test_below_top_is_not_called_removed(tmp_path, monkeypatch):
    """An op below a run's top tables (its name checksum present) is not 'removed'."""
    monkeypatch.setattr(ops, "TOP_DIGEST", 1)
    monkeypatch.setattr(ops, "TOP_JOB", 1)
    b = ops_metrics(tmp_path, "b", mm_us=900)
    c = ops_metrics(tmp_path, "c", mm_us=100)
    d = op_diff([(summary_with(b), None)], [(summary_with(c), None)])
    mm = next(r for r in d["cpu_ops"]["top"] if r["name"] == "aten::mm")
    assert mm["status"] == "changed" and mm["below_top_in"] == ["candidate"]


def test_no_traces_on_a_side_says_so(tmp_path):
    d = op_diff([({"metrics": {}}, tmp_path / "nope.json")],
                [(summary_with(ops_metrics(tmp_path, "c")), None)])
    assert d == {"available": False, "reason": "no op breakdown (profiler traces) on the baseline side",
                 "notes": [f"baseline {tmp_path / 'nope.json'}: no op breakdown in the summary and no "
                           f"run directory beside it"]}


def _summaries(tmp: Path, names: list[str], ops_m: dict | None) -> list[Path]:
    out = []
    for n in names:
        s = json.loads((COMPARE / f"{n}.json").read_text())
        if ops_m is not None:
            s["metrics"]["ops"] = ops_m
        p = tmp / f"{n}.json"
        p.write_text(json.dumps(s))
        out.append(p)
    return out


def test_compare_cli_shows_the_diff_and_keeps_the_verdict(tmp_path):
    base_ops = ops_metrics(tmp_path, "b", mm_us=100, gloo_us=200)
    cand_ops = ops_metrics(tmp_path, "c", mm_us=700, gloo_us=1500)
    plain, withops = tmp_path / "plain", tmp_path / "ops"
    plain.mkdir()
    withops.mkdir()
    names_b, names_c = [f"base-0{i}" for i in range(8)], [f"slow50-0{i}" for i in range(8)]
    pb, pc = _summaries(plain, names_b, None), _summaries(plain, names_c, None)
    ob, oc = _summaries(withops, names_b, base_ops), _summaries(withops, names_c, cand_ops)
    r0 = run_cli(["compare", *pb, "--", *pc, "--json"])
    md = tmp_path / "cmp.md"
    r1 = run_cli(["compare", *ob, "--", *oc, "--json", "--markdown", md])
    assert r0.returncode == r1.returncode == 1, (r0.stderr, r1.stderr)  # slow50: a regression
    j0, j1 = json.loads(r0.stdout), json.loads(r1.stdout)
    assert j1["metrics"] == j0["metrics"] and j1["verdict"] == j0["verdict"]
    assert j0["op_diff"]["available"] is False
    top = j1["op_diff"]["cpu_ops"]["top"][0]
    assert top["name"] == "aten::mm" and top["delta_ms"] == pytest.approx(0.6)
    text = md.read_text()
    assert "#### Which ops moved" in text and "`aten::mm`" in text
    assert "waiting moved: gloo:all_reduce +1.3 ms/step" in text and "a symptom" in text
    r2 = run_cli(["compare", *ob, "--", *oc])
    assert r2.returncode == 1 and "Which ops moved" in r2.stdout and "aten::mm" in r2.stdout
    assert "waiting moved: gloo:all_reduce" in r2.stdout
    assert r2.stdout.rstrip().splitlines()[-1].startswith("REGRESSION")


