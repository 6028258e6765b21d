"""Timeline and critical path on synthesized runs (benchmarks/synth_run.py): clocks refined
from collective ends where the probes' estimate is off, and a 1,024-rank run whose timeline
stays within its size limit with a default selection around the straggler the path runs
through. The 1,024-rank test took 180 s on the 2-core machine under a load average of 20
(TRAINPROF_SCALE_RANKS=256 for a quicker run); benchmarks/bench_timeline.py times it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from trainprof.analysis.run import RunDir

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from synth_run import synthesize  # noqa: E402

RANKS = int(os.environ.get("TRAINPROF_SCALE_RANKS", "1024"))
STRAGGLER = RANKS * 3 // 4 + 1


def check_chrome_trace(doc: dict) -> None:
    """Every event well-formed (ph, ts, dur, pid, tid), flows paired and bound, threads nested."""
    from trainprof.reports.chrome_trace import problems

    assert doc["traceEvents"]
    assert problems(doc) == []


def _shift_clock(run_dir: Path, ranks, by_ns: int, uncertainty_ns: int) -> None:
    for r in ranks:
        p = run_dir / "ranks" / f"rank-{r:05d}" / "clock.jsonl"
        recs = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        for x in recs:
            x["offset_ns"] += by_ns
            x["uncertainty_ns"] = uncertainty_ns
        p.write_text("".join(json.dumps(x) + "\n" for x in recs))


def test_clock_refined_from_collective_ends_within_the_probes_bound(tmp_path):
    """The synthesized run's clock estimates are exact; spoiling those of a whole host by 3 ms
    (said ±5 ms) is undone by the collective ends (median error over the host's ranks < 0.5 ms;
    the source run's own end jitter is ~1 ms); said ±1 ms, the ends may
    move the clock by 1 ms only (the round trips bound it)."""
    import shutil

    from trainprof.analyzers._align import align

    truth_dir = synthesize(tmp_path / "run16", 16, traces=0)
    truth = align(RunDir(truth_dir))
    node1 = list(range(8, 16))
    t_mid = int(RunDir(truth_dir).stream(9, "steps")[5]["start_ns"])
    for bound_ns, err_ms in ((5_000_000, (0.0, 0.5)), (1_000_000, (1.5, 2.5))):
        d = tmp_path / f"spoiled-{bound_ns}"
        shutil.copytree(truth_dir, d)
        _shift_clock(d, node1, 3_000_000, bound_ns)
        al = align(RunDir(d))
        errs = [abs(al(r, t_mid) - truth(r, t_mid)) / 1e6 for r in node1]
        assert err_ms[0] <= float(np.median(errs)) <= err_ms[1], errs
        assert "collective" in al.info[9]["method"]
        for r in node1:  # where causality bounds the offset, the error is within the bound
            if al.info[r]["method"].endswith("collective bounds"):
                assert abs(al(r, t_mid) - truth(r, t_mid)) <= al.info[r]["uncertainty_us"] * 1e3
        assert abs(al.info[9]["shift_us"]) <= bound_ns / 1e3
        for r in range(8):  # rank 0's host: one clock, never moved
            assert al(r, t_mid) == truth(r, t_mid)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("scale") / "run", RANKS, traces=2,
                      straggler=STRAGGLER, delay_ms=300.0)


def test_path_runs_through_the_straggler_and_timeline_is_bounded(big, tmp_path):
    from trainprof.analyzers import critical_path
    from trainprof.analysis.timeline import make

    run = RunDir(big)
    m = critical_path.analyze(run).metrics
    top = m["job"]["by_rank"][0]
    assert top["rank"] == STRAGGLER and top["share"] > 0.2, m["job"]["by_rank"][:3]
    # the what-if: the straggler's excess removed saves most of its delay (300 ms a step; the
    # next slowest of 1,023 jittered ranks then leads the path)
    r = critical_path.replay(run, {"remove_excess": STRAGGLER})
    assert 150 < r["saving_ms"] < 330, r
    # the timeline's selection follows the findings: one naming the rank the path runs through
    # (the stragglers analyzer's own finding costs it ~30 s more at this size)
    findings = [{"kind": "straggler", "severity": "warning", "ranks": [top["rank"]],
                 "message": f"rank {top['rank']} leads the critical path", "evidence": {}}]
    out = make(big, tmp_path / "t.json", findings=findings, max_mb=24)
    assert out["bytes"] <= 24 << 20
    doc = json.loads((tmp_path / "t.json").read_text())
    check_chrome_trace(doc)
    meta = doc["otherData"]
    assert STRAGGLER in meta["ranks"] and 0 in meta["ranks"] and len(meta["ranks"]) <= 96
    assert "of 1024 ranks" in meta["ranks_selection"] or RANKS != 1024
    assert meta["clock"]["per_rank"][str(STRAGGLER)]["method"]
    # processes named by mesh coordinate and host, the straggler's on the path
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names[STRAGGLER].startswith(f"rank {STRAGGLER} (dp{STRAGGLER}")
    on_path = {e["pid"] for e in doc["traceEvents"] if e.get("cat") == "critical_path"}
    assert STRAGGLER in on_path
