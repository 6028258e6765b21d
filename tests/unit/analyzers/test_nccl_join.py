"""The same NCCL collective joined across ranks by the traces' own (process group, sequence
number), as PyTorch 2.x writes them on the NCCL kernels: a 3-rank job's profiler traces
(tests/fixtures/gpu/nccl_late_rank, made from a real H100 trace by
tests/support/make_nccl_ranks.py), each rank on its own host clock, rank 2 3 ms late before the
first collective of ProfilerStep#3. The timeline's arrows and the critical path's joins must pair
the kernels of one (group, seq), mark the last arrival, and the path must run through the late
rank's work."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict

import numpy as np
import pytest

import make_nccl_ranks as gen
from trainprof.analysis.run import RunDir

FOLDER = gen.OUT


def _late_seq() -> int:
    doc = gen._load()
    lo, hi = gen._window(doc)
    base = gen._kept(doc, lo, hi)
    step3 = next(e for e in base if e.get("name") == "ProfilerStep#3" and e.get("cat") == "user_annotation")
    return gen.first_seq_of_step3(gen._collectives(base), step3)


LATE_SEQ = _late_seq()


def test_fixture_is_what_the_script_makes(tmp_path):
    made = gen.make(tmp_path)
    assert [p.name for p in made] == [f"rank-{r}.pt.trace.json.gz" for r in range(gen.RANKS)]
    for p in made:
        assert p.read_bytes() == (FOLDER / p.name).read_bytes(), p.name
    assert sum(p.stat().st_size for p in made) < 200_000
    doc = json.loads(gzip.decompress(made[1].read_bytes()))
    k = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "Seq" in e.get("args", {}))
    assert {"Collective name", "In msg nelems", "Group size", "Process Group Name", "Seq"} <= set(k["args"])
    assert doc["distributedInfo"]["rank"] == 1 and doc["distributedInfo"]["world_size"] == 3


@pytest.fixture(scope="module")
def timeline(tmp_path_factory) -> dict:
    from trainprof.analysis.timeline import make
    from trainprof.reports.chrome_trace import problems

    out = tmp_path_factory.mktemp("nccl") / "t.json"
    make(FOLDER, out)
    doc = json.loads(out.read_text())
    assert problems(doc) == []
    return doc


def test_timeline_pairs_the_kernels_of_one_group_and_seq(timeline):
    ev = timeline["traceEvents"]
    clock = timeline["otherData"]["clock"]["per_rank"]
    # each host's clock put back from the kernels' ends: the offsets the script gave them
    assert {r: clock[str(r)].get("shift_us", 0.0) for r in range(3)} == gen.CLOCK_US
    kernels = [e for e in ev if e.get("cat") == "kernel" and "seq" in (e.get("args") or {})]
    by = defaultdict(dict)
    for e in kernels:
        assert e["args"]["group"] == "0" and e["args"]["collective"] == "allreduce"
        assert e["pid"] not in by[e["args"]["seq"]]
        by[e["args"]["seq"]][e["pid"]] = e
    assert len(by) == 24 and all(set(d) == {0, 1, 2} for d in by.values())
    for seq, d in by.items():
        ends = [e["ts"] + e["dur"] for e in d.values()]
        assert max(ends) - min(ends) <= 0.002, seq  # one clock: the kernels end together
        last = [r for r, e in d.items() if e["args"].get("last_to_arrive")]
        assert last == [gen.last_to_arrive(seq, LATE_SEQ)], (seq, last)
        assert d[last[0]]["name"].endswith("(last to arrive)")
        assert d[last[0]]["ts"] == max(e["ts"] for e in d.values())
    assert by[LATE_SEQ][2]["ts"] - by[LATE_SEQ][0]["ts"] >= gen.LATE_US - 5
    # arrows: from each member's kernel to the last arrival's, within one (group, seq)
    at = {(e["pid"], e["tid"], e["ts"]): e for e in kernels}
    flows = defaultdict(dict)
    for e in ev:
        if e.get("cat") == "collective_flow":
            flows[e["id"]][e["ph"]] = at.get((e["pid"], e["tid"], e["ts"]))
    assert len(flows) == 2 * len(by)
    pairs = defaultdict(set)
    for f in flows.values():
        src, dst = f["s"], f["f"]
        assert src is not None and dst is not None
        assert (src["args"]["group"], src["args"]["seq"]) == (dst["args"]["group"], dst["args"]["seq"])
        assert dst["args"].get("last_to_arrive") and not src["args"].get("last_to_arrive")
        pairs[src["args"]["seq"]].add(src["pid"])
    assert all(pairs[s] == {0, 1, 2} - {gen.last_to_arrive(s, LATE_SEQ)} for s in by)


def test_critical_path_joins_at_the_last_arrival_and_runs_through_the_late_rank(timeline):
    from trainprof.analyzers import critical_path
    from trainprof.analyzers._align import align_traces

    run = RunDir(FOLDER)
    traces = run.traces()
    shift, _, _ = align_traces(traces)
    per = critical_path.profiled_paths(run, traces, [3], shift)[3]
    assert per["ranks"] == [0, 1, 2]
    rows = per["rows"]
    late = [(r, b - a) for r, kind, a, b, label in rows if label == "late host work"]
    assert late == [(gen.LATE, int(gen.LATE_US * 1000))]
    # the join of the late collective: its transfer on the path starts at the late rank's kernel
    t = traces[gen.LATE]
    comm, ev = t.tables.comm, t.tables.events
    row = next(int(comm["row"][i]) for i in range(len(comm))
               if ev["is_gpu"][int(comm["row"][i])] and int(comm["seq"][i]) == LATE_SEQ)
    arrival = int(ev["ts_ns"][row]) - shift[gen.LATE]
    joined = [(r, a, b - a) for r, kind, a, b, label in rows
              if label and label.startswith("ncclDevKernel") and kind == "communication"]
    assert joined and joined[0][1] == arrival and joined[0][2] == int(gen.TRANSFER_US * 1000), joined
    # the step's path is mostly the late rank's work (its 3 ms of the 5.2 ms step)
    by_rank = per["attr"]["by_rank"]
    assert max(by_rank, key=by_rank.get) == gen.LATE
    assert by_rank[gen.LATE] / per["length_ns"] > 0.6, by_rank
    # drawn in the timeline as the highlighted track, on the late rank
    cp = [e for e in timeline["traceEvents"] if e.get("cat") == "critical_path"
          and e["args"].get("op") == "late host work"]
    assert [(e["pid"], e["dur"]) for e in cp] == [(gen.LATE, gen.LATE_US)]
    assert np.isclose(sum(by_rank.values()), per["length_ns"])
