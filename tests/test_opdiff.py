"""Which ops moved (trainprof/opdiff.py) in `trainprof compare`: added/removed ops, per-op time
per step on each side, the largest change first; informational only (exit codes unchanged)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from helpers import run_cli
from trainprof.analyzers import ops
from trainprof.opdiff import op_diff
from trainprof.trace import load_trace

COMPARE = Path(__file__).parent / "fixtures" / "compare"


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 3, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def trace(path: Path, rank: int, mm_us: int = 0, cdist_us: int = 0, relu: bool = True) -> Path:
    """Two steps of 2000 µs: a forward with linear (and relu), optional extra aten::mm / cdist."""
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
    assert top[0]["name"] == "aten::mm" and top[0]["status"] == "changed"
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
    base_ops, cand_ops = ops_metrics(tmp_path, "b", mm_us=100), ops_metrics(tmp_path, "c", mm_us=700)
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
    r2 = run_cli(["compare", *ob, "--", *oc])
    assert r2.returncode == 1 and "Which ops moved" in r2.stdout and "aten::mm" in r2.stdout
    assert r2.stdout.rstrip().splitlines()[-1].startswith("REGRESSION")


JOB = """
import os, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
torch.set_num_threads(1)
extra = int(os.environ.get("OPDIFF_EXTRA_MATMULS", "0"))
model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
w = torch.randn(384, 384)
for step in range(7):
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    ((model(x) - y) ** 2).mean().backward()
    for _ in range(extra):
        w = torch.mm(w, w) / 384.0
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_real_runs_name_the_injected_matmuls(tmp_path):
    """Two 2-rank gloo jobs, the candidate doing extra matmuls every step: compare's op diff
    names aten::mm as the top contributor to the change of CPU time per step."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    runs = {}
    for tag, extra in (("base", "0"), ("cand", "12")):
        out = tmp_path / tag
        r = run_cli(["wrap", "--out", out, "--no-analyze", "--profile-steps", "3-5", "--",
                     sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     "2", job], env={"OPDIFF_EXTRA_MATMULS": extra}, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[tag] = out
    r = run_cli(["compare", runs["base"], runs["cand"], "--json"], timeout=300)
    assert r.returncode in (0, 1, 3), r.stderr[-2000:]
    d = json.loads(r.stdout)["op_diff"]
    assert d["available"] and "kernels" not in d
    top = d["cpu_ops"]["top"][0]
    assert top["name"] == "aten::mm" and top["delta_ms"] > 0, d["cpu_ops"]["top"][:3]
    mm = top["candidate_calls"] - top["baseline_calls"]
    assert mm == pytest.approx(12, abs=0.01)  # the 12 injected matmuls per step, on every rank
    shutil.rmtree(tmp_path / "base", ignore_errors=True)
