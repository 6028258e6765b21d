"""Uneven ranks on written run directories: which rank's exit caused its peers' failure, uneven
step counts under join."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import write_worker_exits
from trainprof.analysis.run import RunDir
from trainprof.analyzers import hang as hang_analyzer
from trainprof.analyzers import uneven_steps
from trainprof.rundir.files import write_json_atomic


GLOO_CLOSED = ("Got the following error when running the callback: RuntimeError: [pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:18147.\n\nAt:\n  probes/ddp.py(192): x\n")


def _coll(step, seq, t_s, end_s=None):
    return {"step": step, "pg": "0", "seq": seq, "op": "all_reduce", "bytes": 4096,
            "enqueue_ns": int(t_s * 1e9), "end_ns": int(end_s * 1e9) if end_s else None,
            "api": "ddp.bucket"}


def _hb(t_s, step, event="progress", **kw):
    return {"t_ns": int(t_s * 1e9), "event": event, "step": step, "inflight": [],
            "inflight_count": 0, "fr": None, **kw}


def _rank(root: Path, r: int, world: int, steps: range, colls: list[dict], hbs: list[dict],
          ended_s: float | None = None):
    """ranks/rank-N: a step every 0.1 s from 100 s, with its collectives."""
    d = root / "ranks" / f"rank-{r:05d}"
    d.mkdir(parents=True)
    meta = {"rank": r, "world_size": world}
    if ended_s is not None:
        meta["ended_ns"] = int(ended_s * 1e9)
    write_json_atomic(d / "meta.json", meta)
    recs = [{"step": s, "start_ns": int((100 + 0.1 * s) * 1e9),
             "end_ns": int((100.09 + 0.1 * s) * 1e9), "dur_ms": 90.0, "source": "optimizer"}
            for s in steps]
    (d / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    (d / "collectives.jsonl").write_text("".join(json.dumps(x) + "\n" for x in colls))
    (d / "groups.jsonl").write_text(json.dumps({"pg": "0", "ranks": list(range(world))}) + "\n")
    (d / "heartbeat.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hbs))


def _step_colls(steps: range, per_step=1, after=()):
    """One all_reduce per step (seq = step + 1, as DDP's bucket after a broadcast #0)."""
    out = [_coll(s, s + 1, 100.05 + 0.1 * s, 100.06 + 0.1 * s) for s in steps]
    return out + list(after)


def _manifest(root: Path, status: str, end_s: float):
    write_json_atomic(root / "manifest.json", {"schema_version": 1, "status": status,
                                               "end_time": {"ns": int(end_s * 1e9)}})


def _nojoin_run(root: Path, agent=True, exit0_s=108.0, fail_s=108.5, rank1_exc=GLOO_CLOSED,
                rank1_coll=None) -> Path:
    """run4c in small: rank 0 runs steps 0-29 and exits 0 (its heartbeat closes at exit0_s);
    rank 1 runs steps 0-29, enters step 30 and its all_reduce #31 fails at fail_s when rank 0's
    process is gone; it exits 1."""
    fail = {"kind": "exception", "exc_type": "RuntimeError", "exc": rank1_exc,
            "t_ns": int(fail_s * 1e9), "thread": "MainThread"}
    last0 = _coll(29, 30, 102.95, 102.96)
    _rank(root, 0, 2, range(30), _step_colls(range(30)),
          [_hb(100, 0, "start"), _hb(101, 10), _hb(103, 30, last_collective=last0),
           _hb(exit0_s, 30, "close", last_collective=last0)], ended_s=exit0_s)
    c31 = rank1_coll or _coll(30, 31, 103.05, fail_s - 0.001)
    pending = dict(c31, end_ns=None)
    _rank(root, 1, 2, range(30), _step_colls(range(30), after=[c31]),
          [_hb(100, 0, "start"), _hb(101, 10),
           _hb(103.1, 30, last_collective=pending, inflight=[pending], inflight_count=1),
           _hb(fail_s, 30, "failure", last_collective=c31, failure=fail),
           _hb(fail_s + 0.001, 30, "close", last_collective=c31, failure=fail)],
          ended_s=fail_s + 0.002)
    _manifest(root, "failed", fail_s + 0.4)
    if agent:
        write_worker_exits(root, fail_s + 0.3, {0: 0, 1: 1}, {0: 0, 1: 1})
    return root


def test_rank_that_exited_normally_first_is_the_cause_of_its_peers_failure(tmp_path):
    res = hang_analyzer.analyze(RunDir(_nojoin_run(tmp_path / "r")))
    (f,) = res.findings
    c = f.evidence["culprit"]
    assert f.kind == "rank_failure" and f.severity == "error" and f.ranks == [0]
    assert c["reason"] == "exited_early"
    assert [(v["rank"], v["collective"]["seq"]) for v in c["victims"]] == [(1, 31)]
    (e,) = c["early_exit"]
    assert (e["rank"], e["exitcode"], e["last_step_done"], e["steps"]) == (0, 0, 29, 30)
    assert f.message.startswith(
        "Rank failure: rank 0 left the job early: exited normally (exit code 0) after step 29 "
        "while rank 1 was still training (rank 0 ran 30 steps, 0-29; rank 1 went on to step 30); "
        "rank 1 then failed in all_reduce #31 of group 0 in step 30, which rank 0 never issued: "
        "raised RuntimeError: Got the following error when running the callback: RuntimeError: "
        "[pair.cc:553] Connection closed by peer [127.0.0.1]:18147. (exited with code 1): a "
        "consequence, not the cause; uneven inputs (ranks given different numbers of batches)? "
        "If so, torch's Join context manager"), f.message
    assert "was the first to fail" not in f.message and "At:" not in f.message
    # the failure record itself is kept whole in the evidence
    assert f.evidence["failures"]["1"]["exc"] == GLOO_CLOSED


def test_a_rank_that_fails_first_on_its_own_stays_the_culprit(tmp_path):
    # Rank 1 raised in its own code after the last collective both ranks completed (#30): rank
    # 0's normal exit explains nothing. Its failure is the first, as before.
    c30 = _coll(29, 30, 102.95, 102.96)
    (f,) = hang_analyzer.analyze(RunDir(_nojoin_run(
        tmp_path / "r", rank1_exc="ValueError: bad checkpoint path", rank1_coll=c30))).findings
    c = f.evidence["culprit"]
    assert f.kind == "rank_failure" and f.ranks == [1] and c["reason"] == "died"
    assert f.message.startswith("Rank failure: rank 1 was the first to fail: raised RuntimeError")


def test_a_normal_exit_after_the_failure_is_not_the_cause(tmp_path):
    # rank 0 ended 10 s after rank 1's collective failed: it did not leave first
    (f,) = hang_analyzer.analyze(RunDir(_nojoin_run(tmp_path / "r", exit0_s=118.5))).findings
    assert f.ranks == [1] and f.evidence["culprit"]["reason"] == "died"


def test_crash_of_a_rank_is_still_named_when_another_exited_normally(tmp_path):
    # 3 ranks: rank 2 exited 0 at the end of its data (after step 29) but its peers' failure is
    # not in a collective it skipped: rank 1 was killed (SIGKILL) in step 12, rank 0 then failed
    root = tmp_path / "r"
    _rank(root, 2, 3, range(30), _step_colls(range(30)),
          [_hb(100, 0, "start"), _hb(108, 30, "close")], ended_s=108)
    _rank(root, 1, 3, range(12), _step_colls(range(12)), [_hb(100, 0, "start"), _hb(101.2, 12)])
    boom = {"kind": "exception", "exc_type": "RuntimeError", "exc": "Connection reset by peer",
            "t_ns": int(101.5e9)}
    _rank(root, 0, 3, range(12), _step_colls(range(12), after=[_coll(12, 13, 101.25, 101.5)]),
          [_hb(100, 0, "start"), _hb(101.5, 12, "failure", failure=boom)])
    _manifest(root, "failed", 102)
    write_worker_exits(root, 101.8, {0: 1, 1: -9}, {0: 1, 1: -9, 2: 0})
    (f,) = hang_analyzer.analyze(RunDir(root)).findings
    assert f.ranks == [1] and f.evidence["culprit"]["reason"] == "died"
    assert "killed by SIGKILL" in f.message and "left the job early" not in f.message


def test_a_peer_left_waiting_forever_names_the_rank_that_exited(tmp_path):
    # NCCL-like: rank 1 never fails, it waits in #31 until the watchdog kills the job; rank 0,
    # which never reached #31, had exited normally after step 29
    root = tmp_path / "r"
    last0 = _coll(29, 30, 102.95, 102.96)
    _rank(root, 0, 2, range(30), _step_colls(range(30)),
          [_hb(100, 0, "start"), _hb(103, 30, last_collective=last0),
           _hb(103.2, 30, "close", last_collective=last0)], ended_s=103.2)
    pending = _coll(30, 31, 103.05)
    _rank(root, 1, 2, range(30), _step_colls(range(30)),
          [_hb(100, 0, "start"), _hb(103.1, 30, last_collective=pending, inflight=[pending],
                                     inflight_count=1)])
    _manifest(root, "hung", 200)
    write_worker_exits(root, 199, {0: 0}, {0: 0, 1: -15})
    (f,) = hang_analyzer.analyze(RunDir(root)).findings
    assert f.kind == "hang" and f.ranks == [0]
    assert f.evidence["culprit"]["reason"] == "never_arrived"
    assert ("rank 0 never reached collective all_reduce #31 of group 0; it had exited normally "
            "(exit code 0) after step 29 while rank 1 was still training (rank 0 ran 30 steps, "
            "0-29; rank 1 went on to step 30) (uneven inputs") in f.message, f.message


def _join_run(root: Path, counts: dict[int, int], exitcodes: dict[int, int] | None = None,
              shadow: bool = True) -> Path:
    """Join in small: every rank has one all_reduce per step it ran; a rank whose inputs ran
    out (fewer steps) shadows the others' all_reduces, logged under its step after its last."""
    top = max(counts.values())
    for r, n in counts.items():
        after = [_coll(n, s + 1, 100.05 + 0.1 * s, 100.06 + 0.1 * s) for s in range(n, top)]
        _rank(root, r, len(counts), range(n), _step_colls(range(n), after=after if shadow else ()),
              [_hb(100, 0, "start"), _hb(100 + 0.1 * top + 0.1, n, "close")],
              ended_s=100 + 0.1 * top + 0.1)
    codes = exitcodes or {r: 0 for r in counts}
    _manifest(root, "ok" if not any(codes.values()) else "failed", 100 + 0.1 * top + 0.5)
    write_worker_exits(root, 100 + 0.1 * top + 0.3, codes, codes)
    return root


def test_uneven_step_counts_under_join_are_said(tmp_path):
    res = uneven_steps.analyze(RunDir(_join_run(tmp_path / "r", {0: 30, 1: 40})))
    (f,) = res.findings
    assert f.kind == "uneven_steps" and f.severity == "info" and f.ranks == [0]
    assert f.message == (
        "Ranks recorded different numbers of steps: rank 0 ran 30 steps (0-29), rank 1 ran 40 "
        "steps (0-39); steps 30-39 were run by rank 1 alone: no other rank recorded them, so "
        "per-step comparisons between ranks (stragglers) leave them out and the job's step time "
        "there is rank 1's alone; rank 0 logged 10 collectives after its last step, all under "
        "step 30, which is what a rank that ran out of inputs does under torch's Join context "
        "manager (DDP: `with model.join():`): it shadows its peers' collectives until they "
        "finish; uneven inputs (ranks given different numbers of batches)?")
    assert res.metrics["partial_steps"] == [{"first": 30, "last": 39, "ranks": "1"}]
    assert f.evidence["collectives_after_last_step"] == {"0": 10}


def test_four_ranks_with_three_step_counts(tmp_path):
    res = uneven_steps.analyze(RunDir(_join_run(tmp_path / "r", {0: 20, 1: 25, 2: 25, 3: 30},
                                                shadow=False)))
    (f,) = res.findings
    assert f.ranks == [0, 1, 2]
    assert f.message.startswith(
        "Ranks recorded different numbers of steps: rank 0 ran 20 steps (0-19), ranks 1-2 ran "
        "25 steps (0-24), rank 3 ran 30 steps (0-29); steps 20-24 were run by ranks 1-3 only: "
        "per-step comparisons there are between those ranks, without rank 0; steps 25-29 were "
        "run by rank 3 alone"), f.message
    assert f.message.endswith("; uneven inputs (ranks given different numbers of batches)?")


def test_even_steps_and_ranks_that_stopped_are_not_uneven(tmp_path):
    even = uneven_steps.analyze(RunDir(_join_run(tmp_path / "even", {0: 12, 1: 12})))
    assert even.findings == [] and even.metrics == {"ranks_with_steps": 2, "uneven": False,
                                                    "steps": 12}
    # rank 1 was killed in step 7 (the launcher then ended rank 0): a failure, said by the hang
    # analyzer, not uneven inputs
    killed = uneven_steps.analyze(RunDir(_join_run(tmp_path / "killed", {0: 8, 1: 7},
                                                   exitcodes={0: -15, 1: -9}, shadow=False)))
    assert killed.findings == [] and killed.metrics["ended_abnormally"] == "1"
    # the no-Join run: both ranks completed steps 0-29 (rank 1's step 30 never closed)
    assert uneven_steps.analyze(RunDir(_nojoin_run(tmp_path / "nojoin"))).findings == []


def test_solo_steps_are_not_compared_between_ranks(tmp_path):
    """What the uneven_steps message says of the stragglers analyzer: a step only one rank
    recorded has no peer step time to compare with."""
    from trainprof.analyzers import stragglers

    m = stragglers.analyze(RunDir(_join_run(tmp_path / "r", {0: 30, 1: 40}))).metrics
    if "excess_ms_by_rank" not in m:
        pytest.skip("stragglers analyzer gives no per-step excess here")
    steps = m["steps"]
    solo = [steps.index(s) for s in range(30, 40) if s in steps]
    assert all(m["excess_ms_by_rank"]["1"][i] is None for i in solo)


def test_without_the_agents_record_a_closed_heartbeat_is_the_normal_exit(tmp_path):
    # No worker-exits.jsonl (a launcher other than torchrun): rank 0's heartbeat closed without a
    # failure record, rank 1 recorded its exception: the same cause, without "exit code 0"
    (f,) = hang_analyzer.analyze(RunDir(_nojoin_run(tmp_path / "r", agent=False))).findings
    assert f.ranks == [0] and f.evidence["culprit"]["reason"] == "exited_early"
    assert f.message.startswith("Rank failure: rank 0 left the job early: exited normally after "
                                "step 29 while rank 1 was still training"), f.message
