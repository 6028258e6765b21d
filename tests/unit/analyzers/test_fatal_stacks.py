"""Fatal stack dumps read back (analyzers/_fatal_stacks.py): the main thread of the last dump,
desync and victim rules on written run directories."""

from __future__ import annotations

import json
import shutil

import pytest

import paths
from helpers import run_cli
from trainprof.analysis.run import RunDir
from trainprof.analyzers import _fatal_stacks as fatal


FIXTURES = paths.FIXTURES


def test_parse_picks_the_main_thread_of_the_last_dump():
    text = ("# trainprof fatal-stacks v1 pid=7 main_thread=0x00000000000000aa\n"
            "Fatal Python error: Segmentation fault\n\n"
            "Thread 0x00000000000000aa (most recent call first):\n"
            '  File "/x/old.py", line 1 in old\n\n'
            "Fatal Python error: Aborted\n\n"
            "Current thread 0x00000000000000bb (most recent call first):\n"
            '  File "/x/worker.py", line 3 in loop\n\n'
            "Thread 0x00000000000000aa (most recent call first):\n"
            '  File "/site-packages/torch/distributed/distributed_c10d.py", line 9 in barrier\n'
            '  File "/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
            '  File "/job/train.py", line 12 in sync\n'
            '  File "/job/train.py", line 30 in <module>\n')
    p = fatal.parse(text)
    assert p["signal_text"] == "Aborted" and p["main_known"]
    assert [f["function"] for f in p["main_thread"]] == ["<module>", "sync", "wrapper", "barrier"]
    call = fatal.collective_call(p["main_thread"])
    assert call["op"] == "barrier" and call["call_site"]["function"] == "sync"
    assert call["call_site"]["line"] == 12
    # a stack outside torch.distributed is no collective
    assert fatal.collective_call(p["main_thread"][:2]) is None


def _coll(step, seq, api="c10d.all_reduce", nbytes=4):
    t = int((100 + seq) * 1e9)
    return {"step": step, "pg": "0", "seq": seq, "op": "all_reduce", "bytes": nbytes,
            "enqueue_ns": t, "end_ns": t + 1000, "api": api}


def _synthetic(root, logs, stacks, exitcodes, beats=None):
    """``beats``: {rank: fields of its last (progress) heartbeat} (its in-flight collectives)."""
    (root / "ranks").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"schema_version": 1, "status": "failed",
                                                    "end_time": {"ns": int(130e9)}}))
    for r, recs in logs.items():
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"rank": r, "world_size": len(logs)}))
        hb = [{"t_ns": int(100e9), "event": "start", "step": 0},
              {"t_ns": int(120e9), "event": "progress", "step": recs[-1]["step"],
               **(beats or {}).get(r, {})}]
        (d / "heartbeat.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hb))
        (d / "collectives.jsonl").write_text("".join(json.dumps(c) + "\n" for c in recs))
        (d / "steps.jsonl").write_text(json.dumps(
            {"step": recs[-1]["step"] - (r in stacks), "start_ns": int(119e9),
             "end_ns": int(119.5e9), "dur_ms": 500.0}) + "\n")
        if r in stacks:
            (d / "fatal-stacks.txt").write_text(stacks[r])
    rec = {"t_ns": int(125e9), "event": "workers_closed", "host": "h", "agent_pid": 1,
           "restart": 0, "workers": [{"rank": r, "local_rank": r, "pid": 100 + r,
                                      "exitcode_at_close": c if c != -15 else None, "exitcode": c}
                                     for r, c in exitcodes.items()]}
    (root / "worker-exits.jsonl").write_text(json.dumps(rec) + "\n")
    return root


IN_ALL_REDUCE = ("# trainprof fatal-stacks v1 pid=7 main_thread=0x00000000000000aa\n"
                 "Fatal Python error: Segmentation fault\n\n"
                 "Thread 0x00000000000000aa (most recent call first):\n"
                 '  File "/sp/torch/distributed/distributed_c10d.py", line 9 in all_reduce\n'
                 '  File "/job/train.py", line 12 in sync\n'
                 '  File "/job/train.py", line 30 in <module>\n')


def test_same_op_at_the_next_seq_is_no_desync_the_dead_rank_stays_the_cause(tmp_path):
    # rank 0 crashed (SIGSEGV) inside all_reduce #12; rank 1 issued all_reduce #12 as well:
    # the unknown size is no evidence of a mismatch
    from trainprof.analyzers import hang

    logs = {0: [_coll(5, 10), _coll(6, 11)], 1: [_coll(5, 10), _coll(6, 11), _coll(7, 12)]}
    run = _synthetic(tmp_path / "r", logs, {0: IN_ALL_REDUCE}, {0: -11, 1: -15})
    (f,) = hang.analyze(RunDir(run)).findings
    assert f.kind == "rank_failure" and f.ranks == [0] and f.evidence["desync"] == []
    assert f.evidence["culprit"]["reason"] == "died"
    w = f.evidence["waiting_in"]["0"]
    assert (w["seq"], w["op"], w["call_site"]) == (12, "all_reduce", "job/train.py:12 in sync")


def test_skip_seen_through_the_victims_stacks_names_the_rank_that_broke_its_order(tmp_path):
    # each step: ddp bucket, then the metric all_reduce; rank 1 skipped the metric one in step 6
    # and issued step 7's bucket as #14, where rank 0 (aborted) waited in the metric all_reduce
    from trainprof.analyzers import hang

    def steps(n, skip=None):
        out, seq = [], 0
        for s in range(n):
            out.append(_coll(s, seq, "ddp.bucket", 9488))
            seq += 1
            if s != skip and s < n - 1:
                out.append(_coll(s, seq))
                seq += 1
        return out

    # rank 0 logged up to #12 (step 6's bucket) and died in #13, step 6's metric all_reduce;
    # rank 1 skipped that one and issued step 7's bucket as #13
    logs = {0: steps(7), 1: steps(8, skip=6)}
    assert logs[0][-1]["seq"] == 12 and logs[1][-1]["seq"] == 13
    stacks = IN_ALL_REDUCE.replace("Segmentation fault", "Aborted")
    run = _synthetic(tmp_path / "r", logs, {0: stacks}, {0: -6, 1: -15})
    (f,) = hang.analyze(RunDir(run)).findings
    c = f.evidence["culprit"]
    assert f.kind == "desync" and f.ranks == [1] and c["reason"] == "desync", f.message
    assert [v["rank"] for v in c["victims"]] == [0]
    assert f.evidence["desync"][0]["deviating"] == [1]
    assert "called at job/train.py:12 in sync" in f.message


def test_a_rank_that_died_mid_step_is_placed_by_its_per_step_order(tmp_path):
    # Each step: DDP bucket, then the metric all_reduce. Rank 1 skipped the metric one in step 6.
    # Rank 0's log is written at step boundaries: it holds steps 0-5 (#0-#11) and none of step 6,
    # where rank 0 issued the bucket #12 (paired with rank 1's) and was aborted in the metric
    # all_reduce #13, paired with rank 1's step-7 bucket. Its per-step order places it at #13
    # (not #12, the next after its log): rank 1 broke its order, rank 0 is the victim.
    from trainprof.analyzers import hang

    def steps(n, skip=None):
        out, seq = [], 0
        for s in range(n):
            out.append(_coll(s, seq, "ddp.bucket", 9488))
            seq += 1
            if s != skip:
                out.append(_coll(s, seq))
                seq += 1
        return out

    logs = {0: steps(6), 1: steps(7, skip=6) + [_coll(7, 13, "ddp.bucket", 9488)]}
    assert (logs[0][-1]["seq"], logs[0][-1]["step"]) == (11, 5) and logs[1][-1]["seq"] == 13
    stacks = IN_ALL_REDUCE.replace("Segmentation fault", "Aborted")
    run = _synthetic(tmp_path / "r", logs, {0: stacks}, {0: -6, 1: -15}, beats={0: {"step": 6}})
    (f,) = hang.analyze(RunDir(run)).findings
    c, d = f.evidence["culprit"], f.evidence["desync"][0]
    assert f.kind == "desync" and f.ranks == [1] and c["reason"] == "desync", f.message
    assert (d["seq"], d["deviating"]) == (13, [1]) and [v["rank"] for v in c["victims"]] == [0]
    assert f.evidence["waiting_in"]["0"]["seq"] == 13
    assert f.message.startswith(
        "Collective desynchronization: rank 1 issued all_reduce (ddp.bucket, 9.5 kB) in step 7 as "
        "collective #13 of group 0, out of its per-step order, while rank 0 issued all_reduce "
        "(c10d.all_reduce) in step 6 there"), f.message


@pytest.mark.parametrize("case", ["stale_inflight", "stale_fr", "inflight_at_death"])
def test_a_heartbeat_older_than_the_log_does_not_hide_the_desync(tmp_path, case):
    """Real runs of SKIP (rank 1 skips a metric all_reduce) whose rank 0 was aborted between two
    heartbeats: its last beat (step 1) still lists a collective in flight that the log shows
    completed, or flight-recorder counters from then. Neither may make rank 0 the one that never
    arrived: rank 1 broke its per-step order. ``inflight_at_death``: rank 0's last beat fell while
    it waited in the metric all_reduce #8 it was aborted in (its stacks confirm it)."""
    run = tmp_path / case
    shutil.copytree(FIXTURES / "desync_stale_beat" / case, run)
    res = run_cli(["analyze", run, "--no-report", "-q"])
    assert res.returncode in (0, 1), res.stderr
    summary = json.loads((run / "summary.json").read_text())
    (f,) = [f for f in summary["findings"] if f["kind"] in ("desync", "rank_failure", "hang")]
    c = f["evidence"]["culprit"]
    assert f["kind"] == "desync" and f["ranks"] == [1] and c["reason"] == "desync", f["message"]
    assert [v["rank"] for v in c["victims"]] == [0]


def _skip_logs(last0=7, last1=8):
    """As test_fatal_dump's SKIP logs them: step 0 DDP's broadcast and bucket; each later step
    the metric all_reduce of the step before, then the bucket; rank 1 skipped the metric one of
    step 4, so its #8 is step 4's bucket where rank 0's is the metric all_reduce. Rank 0 logged
    up to #``last0``, rank 1 up to #``last1``."""
    def steps(r):
        out, seq = [], 0
        for s in range(5):
            kinds = ["broadcast"] if s == 0 else [] if r == 1 and s == 4 else ["metric"]
            for k in kinds + ["bucket"]:
                out.append(_coll(s, seq, "c10d.all_reduce") if k == "metric" else
                           dict(_coll(s, seq, "c10d.broadcast", 9488), op="broadcast")
                           if k == "broadcast" else _coll(s, seq, "ddp.bucket", 9488))
                seq += 1
        return out
    return {0: steps(0)[:last0 + 1], 1: steps(1)[:last1 + 1]}


def _inflight(step, seq, api="c10d.all_reduce", nbytes=4):
    return dict(_coll(step, seq, api, nbytes), end_ns=None)


ABORTED = IN_ALL_REDUCE.replace("Segmentation fault", "Aborted")


def test_a_beat_that_saw_the_aborted_rank_waiting_is_confirmed_by_its_stacks(tmp_path):
    # the real failing runs of test_fatal_dump's SKIP: rank 0's last beat fell while it waited in
    # the metric all_reduce #8 (size 4), where rank 1 issued step 4's bucket (size 9488); gloo
    # aborted rank 0. Its stacks confirm it was still there: rank 1 broke its order
    from trainprof.analyzers import hang

    logs = _skip_logs()
    assert [(c["seq"], c["api"]) for c in logs[0][-2:]] == [(6, "c10d.all_reduce"), (7, "ddp.bucket")]
    assert [(c["seq"], c["api"]) for c in logs[1][-2:]] == [(7, "ddp.bucket"), (8, "ddp.bucket")]
    beat = _inflight(4, 8)
    run = _synthetic(tmp_path / "r", logs, {0: ABORTED}, {0: -6, 1: -15},
                     beats={0: {"step": 4, "last_collective": beat, "inflight": [beat]}})
    (f,) = hang.analyze(RunDir(run)).findings
    c = f.evidence["culprit"]
    assert f.kind == "desync" and f.ranks == [1] and c["reason"] == "desync", f.message
    assert [v["rank"] for v in c["victims"]] == [0]
    assert f.evidence["desync"][0]["deviating"] == [1]
    w = f.evidence["waiting_in"]["0"]
    # the beat's record (its size too), placed at the death by the stacks, with the call site
    assert (w["seq"], w["op"], w["bytes"], w["inferred"]) == (8, "all_reduce", 4, "fatal-stacks")
    assert w["call_site"] == "job/train.py:12 in sync"
    assert "called at job/train.py:12 in sync" in f.message


def test_without_stacks_the_beat_alone_names_the_rank_that_broke_its_order(tmp_path):
    # the job ran its own faulthandler (no fatal-stacks.txt): the beat's in-flight collective
    # is the evidence; no call site is claimed
    from trainprof.analyzers import hang

    beat = _inflight(4, 8)
    run = _synthetic(tmp_path / "r", _skip_logs(), {}, {0: -6, 1: -15},
                     beats={0: {"step": 4, "last_collective": beat, "inflight": [beat]}})
    (f,) = hang.analyze(RunDir(run)).findings
    c = f.evidence["culprit"]
    assert f.kind == "desync" and f.ranks == [1] and c["reason"] == "desync", f.message
    assert [v["rank"] for v in c["victims"]] == [0]
    w = f.evidence["waiting_in"]["0"]
    assert (w["seq"], w["bytes"]) == (8, 4) and "inferred" not in w and "call_site" not in w


def test_a_beat_of_another_op_was_passed_the_rank_died_in_the_next(tmp_path):
    # rank 0's beat saw a DDP bucket as #8 in flight (async), but it died in all_reduce: it
    # completed #8 after the beat (the log lost it) and waited in #9
    from trainprof.analyzers import hang

    beat = _inflight(4, 8, "ddp.bucket", 9488)
    logs = _skip_logs(last0=7, last1=9)
    run = _synthetic(tmp_path / "r", logs, {0: ABORTED}, {0: -6, 1: -15},
                     beats={0: {"step": 4, "last_collective": beat, "inflight": [beat]}})
    res = hang.analyze(RunDir(run))
    w = res.metrics["ranks"][0]["waiting_in"]
    assert (w["seq"], w["op"], w["bytes"], w["inferred"]) == (9, "all_reduce", None, "fatal-stacks")


def test_a_size_mismatch_with_the_beats_known_size_is_kept(tmp_path):
    # same API on both sides, sizes 4 and 8 known from the records: a desynchronization, with
    # no side named by the per-step order (both kept it); the dead rank stays the culprit
    from trainprof.analyzers import hang

    logs = _skip_logs(last0=7, last1=7)
    logs[1].append(_coll(4, 8, "c10d.all_reduce", 8))
    beat = _inflight(4, 8)
    run = _synthetic(tmp_path / "r", logs, {0: ABORTED}, {0: -6, 1: -15},
                     beats={0: {"step": 4, "last_collective": beat, "inflight": [beat]}})
    (f,) = hang.analyze(RunDir(run)).findings
    (d,) = f.evidence["desync"]
    assert d["seq"] == 8 and sorted(v["bytes"] for v in d["variants"]) == [4, 8]
    assert "deviating" not in d
    assert f.kind == "rank_failure" and f.evidence["culprit"]["reason"] == "died"


def test_a_peer_ended_before_writing_its_step_is_not_claimed_to_have_never_arrived(tmp_path):
    # rank 1 was ended by the launcher (SIGTERM, no failure record, heartbeat not closed) before
    # it wrote its step 4 (its log ends at #7, step 3's bucket): where rank 0 was aborted, in #8,
    # rank 1 may have issued another collective. Named as the one that did not arrive, with
    # that said
    from trainprof.analyzers import hang

    run = _synthetic(tmp_path / "r", _skip_logs(last0=7, last1=7), {0: ABORTED}, {0: -6, 1: -15})
    (f,) = hang.analyze(RunDir(run)).findings
    c = f.evidence["culprit"]
    assert f.kind == "desync" and f.ranks == [1] and c["reason"] == "never_arrived", f.message
    assert [v["rank"] for v in c["victims"]] == [0] and c["records_incomplete"] == [1]
    assert "never reached collective all_reduce #8 of group 0 as far as its records show " \
           "(or it issued another collective there" in f.message
    # a peer that closed its log (its failure, then its close) did not reach #8: said plainly
    d = tmp_path / "r" / "ranks" / "rank-00001" / "heartbeat.jsonl"
    d.write_text(d.read_text() + json.dumps({"t_ns": int(121e9), "event": "close", "step": 4})
                 + "\n")
    (f,) = hang.analyze(RunDir(run)).findings
    c = f.evidence["culprit"]
    assert c["reason"] == "never_arrived" and "records_incomplete" not in c
    assert "never reached collective all_reduce #8 of group 0;" in f.message
