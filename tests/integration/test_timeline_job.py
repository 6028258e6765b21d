"""`trainprof timeline` and the critical path on real reference jobs (gloo, CPU): a 4-rank
dp2·pp2 job with a straggler (its profiled steps too), the imbalanced pipeline with a slow data
loader, and a folder of the straggler job's plain profiler traces. ~45 s for the 4-rank job on
2 cores (the imbalance run is shared with test_stragglers.py)."""

from __future__ import annotations

import gzip
import json
import shutil
from collections import defaultdict

import numpy as np
import pytest

from helpers import run_cli
from trainprof.reports.chrome_trace import problems
from trainprof.analysis.run import RunDir

pytestmark = pytest.mark.multiproc
STRAGGLER = 1


@pytest.fixture(scope="module")
def strag4(reference_run):
    return reference_run("timeline-straggler4", nproc=4, args=[
        "--dp", "2", "--pp", "2", "--tp", "1", "--steps", "10",
        "--inject", f"straggler:rank={STRAGGLER},delay_ms=300"])


def _timeline(src, out, *extra) -> dict:
    p = run_cli(["timeline", src, "--out", out, *extra])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "timeline written" in p.stderr and "ui.perfetto.dev" in p.stderr
    raw = out.read_bytes()
    doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    assert problems(doc) == []
    return doc


def test_timeline_of_a_straggler_job(strag4, tmp_path):
    doc = _timeline(strag4, tmp_path / "t.json")
    ev = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert names[1] == "rank 1 (dp0 pp1 tp0, " + RunDir(strag4).rank_meta(1)["host"] + ")"
    order = sorted(names, key=lambda p: next(e["args"]["sort_index"] for e in ev
                                             if e["pid"] == p and e["name"] == "process_sort_index"))
    assert order == [0, 1, 2, 3]  # mesh order dp, pp, tp = rank order for this layout
    coll = [e for e in ev if e.get("cat") == "collective"]
    assert coll and all({"group", "seq", "bytes", "blocked_ms"} <= set(e["args"]) for e in coll)
    assert any(e["args"].get("last_to_arrive") for e in coll)
    assert sum(e["ph"] == "s" for e in ev) > 20
    # one clock: the 4 ranks share rank 0's host, so no rank is moved and each is said exact
    per = doc["otherData"]["clock"]["per_rank"]
    assert {r: (x["method"], x["uncertainty_us"]) for r, x in per.items()} == {
        "0": ("reference", 0.0), **{str(r): ("same host as rank 0", 0.0) for r in (1, 2, 3)}}
    # ... and the file is consistent with causality: in a collective where every member needs
    # every member's input, no member's slice ends before every member's slice began. That pins
    # each rank's clock between bounds read from the file alone, whatever the load (a slow
    # wake-up only widens them): measured [-0.34, +0.34] ms on every rank under a load of 9.
    bounds, n = causal_bounds(coll)
    assert n > 100 and set(bounds) == {0, 1, 2, 3}
    for r, (lo, hi) in bounds.items():
        assert lo <= 2 and hi >= -2, (r, lo, hi)  # µs: the file's rounding
        assert hi - lo <= 2000, (r, lo, hi)  # the file pins every clock to within ±1 ms
    # what the ends themselves spread by (each rank wakes on its own after the transfer):
    # reported in docs/timeline.md, not asserted (the load sets it)
    ends = defaultdict(list)
    for e in coll:
        if e["args"]["op"] not in ("send", "recv"):
            ends[(e["args"]["group"], e["args"]["seq"])].append(e["ts"] + e["dur"])
    spread_ms = [(max(v) - min(v)) / 1e3 for v in ends.values() if len(v) > 1]
    assert len(spread_ms) > 20
    print("collective end spread (ms) p25/50/90:", np.percentile(spread_ms, [25, 50, 90]).round(2))
    # the path runs through the straggler, in the log's steps and in the profiled ones (ops)
    cp = [e for e in ev if e.get("cat") == "critical_path"]
    tracks = {e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert {"critical path", "critical path (ops)", "steps", "data"} <= tracks
    on = defaultdict(float)
    for e in cp:
        on[e["pid"]] += e["dur"]
    assert max(on, key=on.get) == STRAGGLER, dict(on)
    # the profiler window: ops of every rank; memory counters; findings at their step
    assert {e["pid"] for e in ev if e.get("cat") == "cpu_op"} == {0, 1, 2, 3}
    assert any(e["ph"] == "C" for e in ev)
    marks = [e for e in ev if e["ph"] == "i"]  # findings, on the ranks they name
    assert marks and all({"kind", "severity", "step", "message"} <= set(e["args"]) for e in marks)
    meta = doc["otherData"]
    assert set(meta["clock"]["per_rank"]) == {"0", "1", "2", "3"}
    assert meta["findings"]["source"].startswith("computed now")


def test_clock_of_another_host_put_back_by_collective_bounds(strag4, tmp_path):
    """Ranks 2 and 3 said to be on another host whose clock estimate is off by 3 ms (said ±5 ms):
    the causality bounds from their collectives with ranks 0 and 1 put them back (measured: within
    0.02 ms, said ±0.26-0.33 ms), the error within what is said."""
    from trainprof.analyzers._align import align

    d = tmp_path / "run"
    shutil.copytree(strag4, d)
    for r in (2, 3):
        rd = d / "ranks" / f"rank-{r:05d}"
        meta = json.loads((rd / "meta.json").read_text())
        meta["host"] = "another-host"
        (rd / "meta.json").write_text(json.dumps(meta))
        recs = [json.loads(x) for x in (rd / "clock.jsonl").read_text().splitlines() if x.strip()]
        for x in recs:  # one host in truth: the true offset is 0
            x["offset_ns"], x["uncertainty_ns"] = 3_000_000, 5_000_000
        (rd / "clock.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    al = align(RunDir(d))
    t = int(RunDir(d).stream(2, "steps")[3]["start_ns"])
    for r in (2, 3):
        info = al.info[r]
        err_us = abs(al(r, t) - t) / 1e3
        assert info["method"] == "clock probe + collective bounds", info
        assert err_us <= info["uncertainty_us"] + 0.1 and info["uncertainty_us"] <= 2000, (err_us, info)


def causal_bounds(coll: list[dict]) -> tuple[dict, int]:
    """{pid: (lo, hi)} µs: the clock offset of each rank against the others' that the file's
    causal collectives allow (end_r >= start_j for every pair of members), and their count."""
    inst: dict = defaultdict(dict)
    for e in coll:
        if e["args"]["op"] in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"):
            inst[(e["args"]["group"], e["args"]["seq"])][e["pid"]] = (e["ts"], e["ts"] + e["dur"])
    out: dict = {}
    for d in inst.values():
        for r, (a, b) in d.items():
            for j, (aj, bj) in d.items():
                if j != r:
                    lo, hi = out.get(r, (-np.inf, np.inf))
                    out[r] = (max(lo, a - bj), min(hi, b - aj))
    return out, len(inst)


def test_critical_path_in_summary_and_report(strag4, tmp_path):
    p = run_cli(["analyze", strag4, "--out", tmp_path, "-q"])
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    cp = s["metrics"]["critical_path"]
    job = cp["job"]
    # its 300 ms are >= 30 % of an ~800-1000 ms path; measured 0.42 (next: its stage peer, 0.37)
    assert job["by_rank"][0]["rank"] == STRAGGLER and job["by_rank"][0]["share"] > 0.3, job["by_rank"]
    assert set(job["by_kind"]) == {"compute", "host", "data", "communication", "idle"}
    assert abs(sum(job["by_kind"].values()) - 1) < 0.01
    assert job["by_kind"]["compute"] > job["by_kind"]["data"]
    # each step's path is at most its wall time (first start to last end)
    for row in cp["per_step"]:
        assert row["length_ms"] <= row["wall_ms"] + 0.01
    assert {r["rank"] for r in cp["profiled"]["ranks"]} == {0, 1, 2, 3}
    # the graph's what-if of the straggler's fix (rank 1 running as its peers do) saves most of
    # the 300 ms injected (measured 273 ms); every finding whose fix the graph can express
    # carries that replay beside its estimate (the straggler's estimate: 402 ms, when the
    # stragglers analyzer flags it; under a load of 15 it did not, the step being 1.2 s)
    from trainprof.analyzers import critical_path

    r = critical_path.replay(RunDir(strag4), {"remove_excess": STRAGGLER})
    assert 150 < r["saving_ms"] < 400, r
    rows = cp.get("what_if") or []
    replayable = [f for f in s["findings"] if f.get("estimate") and critical_path.finding_change(f)]
    key = lambda x: (x["kind"], x["ranks"])  # noqa: E731
    rows, replayable = sorted(rows, key=key), sorted(replayable, key=key)
    assert [key(w) for w in rows] == [key(f) for f in replayable]
    for w, f in zip(rows, replayable):
        assert f["estimate"]["replay"]["saving_ms"] == w["replay_saving_ms"]
        assert w["estimate_saving_ms"] == f["estimate"]["saving_ms"]
    html = (tmp_path / "report.html").read_text()
    assert "Critical path across ranks" in html and "Critical path per step" in html


def test_path_through_the_heavy_stage_and_the_slow_loader(reference_run):
    """dp1·pp2·tp2, stage 1 holds 4 extra layers, rank 0's loader sleeps 300 ms a batch."""
    from trainprof.analyzers import critical_path

    run = RunDir(reference_run("imbalance-slowdata", nproc=4,
                               args=["--dp", "1", "--pp", "2", "--tp", "2", "--steps", "6",
                                     "--inject", "imbalance:stage=1,extra_layers=4",
                                     "--inject", "slow_data:rank=0,delay_ms=300"],
                               wrap_args=["--profile-steps", "none"]))
    per = critical_path.paths(run)
    steps = critical_path._kept(run, per)
    assert steps
    heavy = light = 0.0
    for s in steps:
        rk = per[s]["attr"]["by_rank_kind"]
        assert rk.get((0, "data"), 0) >= 250e6, (s, rk)  # the slow loader, on the path each step
        heavy += sum(v for (r, k), v in rk.items() if r in (2, 3) and k == "compute")
        light += sum(v for (r, k), v in rk.items() if r in (0, 1) and k == "compute")
    # the heavy stage's compute leads over the run (11x in one measured run; in another, under a
    # load average of 20, one step of five had it 7 % below the light stage's)
    assert heavy > 1.5 * light, (heavy, light)
    # what-if: without rank 0's data wait the step is shorter by about it
    r = critical_path.replay(run, {"scale": {"rank": 0, "kind": "data", "factor": 0.0}})
    assert 200 < r["saving_ms"] < 400, r
    # ... which the data_starvation finding's estimate carries as its replay; the estimate's
    # lockstep model (a step = the slowest rank's own time) does not see that stage 0's wait
    # delays the whole pipeline (measured: 0 ms estimated, 299 ms replayed)
    from trainprof.analyzers.advice import advise
    from trainprof.analyzers import stragglers, step_time

    found = stragglers.analyze(run)
    metrics = {"step_time": step_time.analyze(run).metrics, "stragglers": found.metrics}
    findings = [f.to_dict() for f in found.findings]
    advise(metrics, findings)
    rows = critical_path.replay_findings(run, findings)
    (data,) = [w for w in rows if w["kind"] == "data_starvation"]
    assert data["change"] == {"scale": {"rank": [0], "kind": "data", "factor": 0.0}}
    assert 200 < data["replay_saving_ms"] < 400 and data["replay_saving_ms"] > data["estimate_saving_ms"], data


def test_timeline_of_plain_traces(strag4, tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    for p in (strag4 / "profiler").glob("rank-*.pt.trace.json.gz"):
        shutil.copy(p, folder / p.name)
    doc = _timeline(folder, tmp_path / "plain.json.gz", "--gzip")
    ev = doc["traceEvents"]
    assert {e["pid"] for e in ev if e.get("cat") == "cpu_op"} == {0, 1, 2, 3}
    assert {e["pid"] for e in ev if e.get("cat") == "step"} == {0, 1, 2, 3}
    clock = doc["otherData"]["clock"]
    assert "wall clock" in clock["how"] and clock["per_rank"]["0"]["method"] == "reference"
