"""Silent desynchronization (analyzers/_hang_steps.py through analyzers/hang.py): ranks of a
group that issued different numbers of collectives in one step, which gloo paired without an
error because op and size agreed; and the per-step differences that are no desync."""

from __future__ import annotations

import json

import pytest

from helpers import write_worker_exits
from trainprof.analysis.run import RunDir
from trainprof.analyzers import _hang_wording, hang

T0 = 100.0  # s
STEP_S = 1.0
CLOSED = "Connection closed by peer [127.0.0.1]:60607"


def _rec(step, pg, seq, op="all_reduce", nbytes=4204584, api="ddp.bucket"):
    t = int((T0 + step * STEP_S + seq * 1e-3) * 1e9)
    return {"step": step, "pg": pg, "seq": seq, "op": op, "bytes": nbytes, "dtype": "float32",
            "enqueue_ns": t, "end_ns": t + 1000, "async": api == "ddp.bucket", "api": api}


def _log(per_step: dict, pg="0") -> list[dict]:
    """Records of group ``pg`` from {step: [(op, bytes, api), ...]}, numbered in order."""
    out, seq = [], 0
    for step in sorted(per_step):
        for op, nbytes, api in per_step[step]:
            out.append(_rec(step, pg, seq, op, nbytes, api))
            seq += 1
    return out


def _write(root, logs: dict, closed: dict, status="ok", failures=None, exits=None,
           sources=None, ahead=None):
    """A run directory: per rank its collective log (``logs``: {rank: records}), steps 0 to
    ``closed[rank]`` in steps.jsonl, heartbeats that close (with the failure record of
    ``failures[rank]``), and the agent's record of ``exits`` ({rank: exit code}). ``ahead``:
    {rank: seconds} a rank ran ahead of time (every time of its records that much earlier)."""
    man = {"schema_version": 1, "status": status,
           "end_time": {"ns": int((T0 + max(closed.values()) * STEP_S + 5) * 1e9)}}
    (root / "ranks").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(man))
    for r, recs in logs.items():
        lead = (ahead or {}).get(r, 0.0)
        recs = [dict(c, enqueue_ns=c["enqueue_ns"] - int(lead * 1e9),
                     end_ns=c["end_ns"] - int(lead * 1e9)) for c in recs]
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"rank": r, "world_size": len(logs)}))
        (d / "collectives.jsonl").write_text("".join(json.dumps(c) + "\n" for c in recs))
        src = (sources or {}).get(r, "marker")
        (d / "steps.jsonl").write_text("".join(json.dumps(
            {"step": s, "start_ns": int((T0 - lead + s * STEP_S) * 1e9),
             "end_ns": int((T0 - lead + (s + 1) * STEP_S) * 1e9), "dur_ms": STEP_S * 1e3,
             "source": src}) + "\n" for s in range(closed[r] + 1)))
        end = T0 - lead + (closed[r] + 1) * STEP_S
        last = {k: v for k, v in recs[-1].items() if k in ("step", "pg", "seq", "op", "bytes",
                                                          "enqueue_ns", "end_ns", "api")}
        hb = [{"t_ns": int(T0 * 1e9), "event": "start", "step": 0},
              {"t_ns": int(end * 1e9) - 1000, "event": "progress", "step": closed[r] + 1,
               "last_collective": last, "inflight": [], "inflight_count": 0}]
        f = (failures or {}).get(r)
        if f:
            f = dict(f, t_ns=last["end_ns"] + 500_000)
            hb.append({"t_ns": f["t_ns"], "event": "failure", "step": closed[r] + 1, "failure": f})
        hb.append({"t_ns": int(end * 1e9) + (2 if f else 1) * 1000, "event": "close",
                   "step": closed[r] + 1, **({"failure": f} if f else {})})
        (d / "heartbeat.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hb))
    if exits:
        write_worker_exits(root, T0 + max(closed.values()) * STEP_S + 3,
                           {r: c for r, c in exits.items() if c}, exits)
    return root


BCAST = [("broadcast", 5229608, "c10d._broadcast_coalesced"), ("broadcast", 5056, "c10d.broadcast")]
ONE_BUCKET = [("all_reduce", 5229608, "ddp.bucket")]
TWO_BUCKETS = [("all_reduce", 4204584, "ddp.bucket"), ("all_reduce", 1025024, "ddp.bucket")]


def _ddp_steps(n, extra_at=(), first_extra=False, skip_at=()):
    """A DDP job's group 0 per step: start-up broadcasts and one bucket in step 0 (buckets are
    rebuilt after the first backward), then two buckets a step. ``extra_at``: steps with two
    more bucket all-reduces (a DDP forward outside no_sync on this rank); ``first_extra``: the
    rebuilt buckets already in step 0; ``skip_at``: steps with one bucket fewer."""
    out = {0: BCAST + ONE_BUCKET + (TWO_BUCKETS if first_extra else [])}
    for s in range(1, n):
        out[s] = TWO_BUCKETS * (2 if s in extra_at else 1)
        if s in skip_at:
            out[s] = out[s][:1]
    return out


def test_extra_collectives_on_one_rank_paired_silently_are_the_culprit(tmp_path):
    """The accelerate job whose rank 0 alone runs the DDP model for a print every 40 micro-steps
    (steps 0, 10, 20): rank 0 issued 5 collectives in step 0, rank 1 3, then 2 a step, 4 on rank
    0 in steps 10 and 20. gloo paired them (same op and size) until rank 1 had run its 30 steps
    and exited; rank 0, 6 collectives ahead, failed in step 27 in all_reduce #62. The desync at
    collective #3 (step 0 on rank 0, step 1 on rank 1) is the cause, not rank 1's exit."""
    r0 = _log(_ddp_steps(28, extra_at=(10, 20), first_extra=True))
    r1 = _log(_ddp_steps(30))
    r0 = [c for c in r0 if c["seq"] <= 62]
    assert (r0[-1]["seq"], r0[-1]["step"]) == (62, 27) and r1[-1]["seq"] == 60
    fail = {"kind": "exception", "exc_type": "RuntimeError", "exc": CLOSED}
    # rank 1 ran 3 steps ahead in time: it exited before rank 0 failed
    run = _write(tmp_path / "r", {0: r0, 1: r1}, closed={0: 26, 1: 29}, status="failed",
                 failures={0: fail}, exits={0: 1, 1: 0}, ahead={1: 3 * STEP_S})
    res = hang.analyze(RunDir(run))
    (f,) = res.findings
    c = f.evidence["culprit"]
    assert f.kind == "desync" and f.severity == "error" and f.ranks == [0], f.message
    assert c["reason"] == "desync" and c["silent"] is True
    d = f.evidence["desync"][0]
    assert (d["by"], d["pg"], d["seq"], d["step"]) == ("steps", "0", 3, 0)
    assert {v["step"]: v["ranks"] for v in d["variants"]} == {0: [0], 1: [1]}
    assert {(v["op"], v["bytes"], v["api"]) for v in d["variants"]} == \
        {("all_reduce", 4204584, "ddp.bucket")}
    assert d["deviating"] == [0] and d["extra"] is True
    assert d["counts"] == [{"count": 5, "ranks": [0]}, {"count": 3, "ranks": [1]}]
    assert [x["step"] for x in d["steps_differ"]] == [0, 10, 20]
    assert f.message.startswith(
        "Collective desynchronization: rank 0 issued 2 more collectives of group 0 in step 0 "
        "than rank 1 (5 against 3), and again in steps 10 (4 against 2) and 20 (4 against 2): "
        "from collective #3 of group 0 on, the ranks were in different steps")
    assert "rank 0: all_reduce (ddp.bucket, 4.2 MB) of step 0; rank 1: all_reduce " \
           "(ddp.bucket, 4.2 MB) of step 1" in f.message
    # rank 1's exit and rank 0's failure follow from it, said as such
    assert "rank 1 then exited normally (exit code 0) after step 29" in f.message
    assert "rank 0 then failed in all_reduce #62 of group 0 in step 27, which rank 1 never " \
           "issued" in f.message
    assert f.message.endswith("a consequence of the desynchronization, not its cause")
    assert "left the job early" not in f.message and "Join" not in f.message
    assert "no_sync()" in f.fix and "model.module" in f.fix


def test_a_rank_that_skipped_collectives_is_named_by_its_own_per_step_order(tmp_path):
    # two ranks, two 4-byte metric all_reduces a step; rank 1 skipped one in step 5, so its next
    # (step 6's first, same op and size) was paired with rank 0's second of step 5: the side
    # whose count departs from its own usual per-step count is the culprit, not the one with more
    metric = ("all_reduce", 4, "c10d.all_reduce")
    per = {s: [metric, metric] for s in range(12)}
    r0, r1 = _log(per), _log({**per, 5: [metric]})
    run = _write(tmp_path / "r", {0: r0, 1: r1}, closed={0: 11, 1: 11})
    (f,) = hang.analyze(RunDir(run)).findings
    d = f.evidence["desync"][0]
    assert f.kind == "desync" and f.ranks == [1] and d["deviating"] == [1], f.message
    assert d["extra"] is False and d["step"] == 5 and d["seq"] == 11
    assert "rank 1 issued 1 fewer collective of group 0 in step 5 than rank 0 (1 against 2)" \
        in f.message


def test_the_minority_of_many_ranks_is_the_culprit(tmp_path):
    logs = {r: _log(_ddp_steps(10, extra_at=(4,) if r == 2 else ())) for r in range(4)}
    run = _write(tmp_path / "r", logs, closed={r: 9 for r in range(4)})
    (f,) = hang.analyze(RunDir(run)).findings
    d = f.evidence["desync"][0]
    assert f.ranks == [2] and d["deviating"] == [2] and d["extra"] is True
    assert d["counts"] == [{"count": 4, "ranks": [2]}, {"count": 2, "ranks": [0, 1, 3]}]
    assert "rank 2 issued 2 more collectives of group 0 in step 4 than ranks 0, 1, 3" in f.message


def _join_logs():
    # uneven inputs under Join: rank 0 ran out after step 6 (closed 0-6) and shadows rank 1's
    # steps 7-9 with collectives it logs under step 7, which it never closes
    r1 = _log(_ddp_steps(10))
    r0 = [dict(c, step=min(c["step"], 7)) for c in r1]
    return {0: r0, 1: r1}, {0: 6, 1: 9}


def _thread_logs():
    # a helper thread's collective on group 1 in steps 0, 3 and 9, and one issued right at the
    # boundary of steps 5 and 6: before it on rank 0, after it on rank 1
    logs = {}
    for r in (0, 1):
        side = {s: [("all_reduce", 8, "c10d.all_reduce")] * (s in (0, 3, 9, 5 + r))
                for s in range(12)}
        logs[r] = _log(_ddp_steps(12)) + _log(side, pg="1")
    return logs, {0: 11, 1: 11}


def _pipeline_logs():
    # two pipeline stages: each stage's data-parallel group holds its own ranks, with another
    # number of collectives a step than the other stage's; the stages exchange sends and recvs
    # on group 2, ranks 1 and 3 one more pair in step 3 (left out: point-to-point ops differ
    # from rank to rank by design)
    logs = {}
    for r in range(4):
        per = {s: [("all_reduce", 64, "ddp.bucket")] * (3 if r < 2 else 1) for s in range(8)}
        p2p = {s: [("send" if r < 2 else "recv", 16, "c10d.isend" if r < 2 else "c10d.irecv")]
               * (1 + (s == 3 and r in (1, 3))) for s in range(8)}
        logs[r] = _log(per, pg="0" if r < 2 else "1") + _log(p2p, pg="2")
    return logs, {r: 7 for r in range(4)}


def _definitions_logs():
    # rank 0 closes a step every micro-batch (4 a step), rank 1 every optimizer step: the same
    # collectives, numbered alike, fall in steps that are not the same steps
    r1 = _log({s: TWO_BUCKETS for s in range(10)})
    r0 = [dict(c, step=c["step"] * 4 + 3) for c in r1]
    return {0: r0, 1: r1}, {0: 39, 1: 9}


def _moe_logs():
    # all_to_all of other sizes on every rank (tokens routed unevenly), same count a step;
    # DDP's first-iteration bucket rebuild on both
    logs = {}
    for r in range(2):
        per = _ddp_steps(8)
        for s in per:
            per[s] = per[s] + [("all_to_all", 1000 * (r + 1) * (s + 1), "c10d.all_to_all_single")]
        logs[r] = _log(per)
    return logs, {0: 7, 1: 7}


@pytest.mark.parametrize("case", [_join_logs, _thread_logs, _pipeline_logs, _definitions_logs,
                                  _moe_logs])
def test_per_step_differences_that_are_no_desync_are_silent(tmp_path, case):
    logs, closed = case()
    run = _write(tmp_path / "r", logs, closed=closed)
    res = hang.analyze(RunDir(run))
    assert res.findings == [], res.findings[0].message
    assert "desync" not in res.metrics or res.metrics["desync"] == []


def test_skipped_collective_message_says_what_differs():
    """A desync that is not the culprit's reason names each side's call, size and step."""
    d = {"source": "probe", "pg": "0", "seq": 41,
         "variants": [{"op": "all_reduce", "bytes": None, "ranks": [0], "steps": [20]},
                      {"op": "all_reduce", "bytes": 799784, "ranks": [1], "steps": [20]}],
         "calls": {"0": "all_reduce (c10d.all_reduce)", "1": "all_reduce (ddp.bucket)"}}
    assert _hang_wording._desync_text(d) == (
        "desynchronized at collective #41 of group 0: rank 0 issued all_reduce "
        "(c10d.all_reduce) in step 20, rank 1 all_reduce (ddp.bucket, 799.8 kB) in step 20")
