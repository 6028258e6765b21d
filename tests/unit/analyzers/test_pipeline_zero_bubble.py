"""Zero-bubble pipeline schedules get their theory (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024: ZB-H1 bubble (p-1)(F+B-W), interleaving divides it by v), so a 37 %
bubble is flagged; the Gantt chart tells a rank's virtual stages apart."""

from __future__ import annotations

import pytest

from trainprof.analyzers import _pipeline_theory, pipeline
from trainprof.reports.sections import pipeline as section
from trainprof.rundir.files import JsonlWriter, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
META = {"stages": None, "num_stages": 4, "virtual_stages": 2, "group_size": 2,
        "schedule": "ScheduleInterleavedZeroBubble", "micro_batches": 2}


def _rank(root, rank, offset_ms, steps=3):
    """Rank ``rank`` holds stages rank and rank+2; per step 12 spans of 5 ms (F, B, W of two
    micro-batches on each stage) back to back from ``offset_ms``."""
    d = rank_dir(root, rank)
    write_json_atomic(d / "meta.json", {"rank": rank, "world_size": 2, "coords": {"pp": rank},
                                        "host": "h", "pipeline": dict(META, stages=[rank, rank + 2])})
    steps_w, spans_w = JsonlWriter(d / "steps.jsonl"), JsonlWriter(d / "pipeline.jsonl")
    for s in range(steps):
        base = T0 + s * 1000 * MS
        steps_w.write({"step": s, "start_ns": base, "end_ns": base + 1000 * MS, "dur_ms": 1000.0,
                       "source": "optimizer"})
        t = offset_ms
        for stage in (rank, rank + 2):
            for kind in "FBW":
                for mb in (0, 1):
                    spans_w.write({"step": s, "stage": stage, "microbatch": mb, "kind": kind,
                                   "start_ns": base + t * MS, "end_ns": base + (t + 5) * MS})
                    t += 5
    steps_w.close(), spans_w.close()


def _torch_order(p=2, v=2, m=4):
    """rank -> torch's own action list of ScheduleInterleavedZeroBubble (None = an idle slot of its
    lockstep table), built as its __init__ does, without a process group."""
    from torch.distributed.pipelining import schedules as S

    o = S.ScheduleInterleavedZeroBubble.__new__(S.ScheduleInterleavedZeroBubble)
    o.pp_group_size, o.n_local_stages, o._n_microbatches = p, v, m
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    o.pipeline_order = {r: o._calculate_single_rank_operations(r) for r in range(p)}
    return o._add_bubbles_to_actions(p * v)


def _torch_ordered_rank(root, rank, order, first_b_ms, steps=3):
    """Spans in torch's lockstep table: slot t at 6·t ms, each action 5 ms (the first stage's
    input-gradient B ``first_b_ms``); the 1 ms between slots stands for the hand-overs."""
    d = rank_dir(root, rank)
    write_json_atomic(d / "meta.json", {"rank": rank, "world_size": 2, "coords": {"pp": rank},
                                        "host": "h", "pipeline": dict(META, stages=[rank, rank + 2],
                                                                      micro_batches=4)})
    steps_w, spans_w = JsonlWriter(d / "steps.jsonl"), JsonlWriter(d / "pipeline.jsonl")
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for s in range(steps):
        base = T0 + s * 1000 * MS
        steps_w.write({"step": s, "start_ns": base, "end_ns": base + 1000 * MS, "dur_ms": 1000.0,
                       "source": "optimizer"})
        for t, a in enumerate(order[rank]):
            if a is None:
                continue
            kind = kinds[a.computation_type.name]
            dur = first_b_ms if (a.stage_index, kind) == (0, "B") else 5
            spans_w.write({"step": s, "stage": a.stage_index, "microbatch": a.microbatch_index,
                           "kind": kind, "start_ns": base + 6 * t * MS,
                           "end_ns": base + round((6 * t + dur) * MS)})
    steps_w.close(), spans_w.close()


def test_zero_bubble_theory_is_the_schedules_own_order(tmp_path):
    """torch's ScheduleInterleavedZeroBubble, p=2, v=2, m=4: its lockstep table has 25 slots
    for 24 actions per rank. Every action 5 ms: 2 idle slots of 50, 4 % = the paper's
    (p-1)/(3·v·m) ratio 1/24. Its first stage computes no input gradient: with those B spans at
    0.2 ms rank 0 works 20·5 + 4·0.2 = 100.8 ms, rank 1 24·5 = 120 ms from the end of rank 0's
    first forward (5 ms) without a wait: window 125 ms, idle 1 − 220.8/250."""
    order = _torch_order()
    assert [len([a for a in order[r] if a]) for r in (0, 1)] == [24, 24]
    assert max(len(order[0]), len(order[1])) == 25
    for first_b, share in ((5, 1 / 25), (0.2, 1 - 220.8 / 250)):
        root = tmp_path / str(first_b)
        for r in (0, 1):
            _torch_ordered_rank(root, r, order, first_b)
        m = pipeline.analyze(RunDir(root)).metrics
        th = m["theory"]
        assert th["formula"] == _pipeline_theory.ORDER_FORMULA
        assert th["share"] == pytest.approx(share, abs=1e-6)
        assert th["paper"]["ratio"] == pytest.approx(1 / 24, rel=0.05)  # (p-1)(F+B-W)/(v·m·(F+B+W))
        assert th["span_ms"]["B_first_stage"] == pytest.approx(first_b)


def test_zero_bubble_theory_by_hand():
    th = _pipeline_theory.theory("ScheduleInterleavedZeroBubble", 4, 8, 2, {"F": 2.0, "B": 2.0, "W": 1.0})
    assert th["ratio"] == pytest.approx(3 * (2 + 2 - 1) / (2 * 8 * (2 + 2 + 1)))
    assert _pipeline_theory.theory("ScheduleInterleavedZeroBubble", 2, 4, 2)["ratio"] == pytest.approx(1 / 24)
    assert _pipeline_theory.theory("ScheduleZBVZeroBubble", 2, 4, 2) is None  # no closed form


def test_a_37_percent_bubble_of_a_zero_bubble_schedule_is_flagged(tmp_path):
    _rank(tmp_path, 0, 0)
    _rank(tmp_path, 1, 35)  # window 0-95 ms, each rank busy 60: bubble 1 - 120/190 = 36.8 %
    res = pipeline.analyze(RunDir(tmp_path))
    m = res.metrics
    assert m["bubble_fraction"] == pytest.approx(1 - 120 / 190)
    # F = B = W = 5 ms: ratio (2-1)·5 / (2·2·15) = 1/12, share 1/13
    assert m["theory"]["share"] == pytest.approx(1 / 13) and m["theory"]["span_ms"] == {
        "F": 5.0, "B": 5.0, "W": 5.0}
    (f,) = [f for f in res.findings if f.kind == "pipeline_bubble"]
    assert f.evidence["theory_share"] == pytest.approx(1 / 13)
    assert "ScheduleInterleavedZeroBubble" in f.message


def test_gantt_names_the_virtual_stage(tmp_path):
    _rank(tmp_path, 0, 0)
    _rank(tmp_path, 1, 35)
    m = pipeline.analyze(RunDir(tmp_path)).metrics
    assert {(s["rank"], s["stage"]) for s in m["gantt"]["spans"]} == {(0, 0), (0, 2), (1, 1), (1, 3)}
    html = section.render(m, {})
    assert "pp 0 (rank 0) stage 0 forward, micro-batch 0" in html
    assert "pp 0 (rank 0) stage 2 forward, micro-batch 0" in html
    assert "stage:micro-batch" in html and ">2:1<" in html
