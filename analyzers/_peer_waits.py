"""The part of a rank's exposed communication that is waiting for other ranks, not transfer:
waits for a late rank (a straggler, a rank starved of input: the stragglers analyzer's finding)
and, on CPU traces, waits for the other members of a collective to arrive (or, in a pipeline,
for the upstream stage to send). comm_compute leaves them out of the exposed communication it
judges (docs/comm-compute.md).
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _lateness, _overlap_credit
from trainprof.analyzers import _intervals as iv
from trainprof.analyzers._stats import median
from trainprof.analyzers.stragglers import waits_or_problem
from trainprof.analyzers.trace_stragglers import has_collective_log, waits


def late_waits(run, per_rank: list[dict], analyzer: str) -> dict:
    """Per rank, the exposed-communication fraction without the time it waits in collectives
    for a late rank (a straggler or a rank starved of input: the stragglers analyzer's finding,
    from the collective log; ms per step over its analysed steps ÷ the profiled step window)."""
    out = {"late": [], "wait_ms": {}, "adjusted": {}, "exposed": None}

    w = waits_or_problem(run, analyzer)
    if (w is None or not w["wait_ms"]) and not _has_log(run):  # bare traces: judged from them
        w = waits(run)
    if w is None or not w["wait_ms"]:
        return out
    for r in per_rank:
        wait = w["wait_ms"].get(r["rank"], 0.0)
        win = r["step_window_ms"] or 0.0
        out["adjusted"][r["rank"]] = round(max(0.0, r["exposed_comm_fraction"] - wait / win), 4) \
            if win > 0 else r["exposed_comm_fraction"]
    out.update(late=w["late"], wait_ms={str(k): round(v, 3) for k, v in w["wait_ms"].items()},
               exposed=round(float(median(list(out["adjusted"].values()))), 4))
    return out


def peer_arrival_waits(run, per_rank: list[dict], per_step: list[dict],
                       analyzer: str) -> dict[int, float]:
    """CPU traces: rank -> the share of its analysed profiled steps it spent blocked in a
    collective before the last other member of that collective had arrived (the collective
    log's complete instances of blocking calls: from its enqueue, min(blocked time, last other
    member's enqueue − its own)). That is the other ranks' lateness — a slower or descheduled
    peer, a straggler — not the transfer: on CPU every blocking collective is exposed, and two
    balanced ranks on a loaded host take turns waiting for each other by tens of ms a step.
    Counted only inside each step's window and within its exposed time. Empty without a log or
    for GPU traces (their waits are on the device: late_waits)."""
    rows: dict[int, list[dict]] = {}
    for r in per_rank:
        if r["kind"] != "cpu" or r.get("whole_trace_window"):
            continue
        use = set(r["steps"])
        rows[r["rank"]] = [x for x in per_step if x["rank"] == r["rank"] and x["step"] in use
                           and x.get("start_ns") is not None]
    rows = {k: v for k, v in rows.items() if v}
    if not rows or not _has_log(run):
        return {}
    try:
        df = _lateness.frame(run)
    except Exception as e:  # noqa: BLE001 - the log only refines the judgement
        run.problems.append(f"{analyzer}: waits for other ranks' arrival unavailable ({type(e).__name__}: {e})")
        return {}
    if df.empty:
        return {}
    sync = ~df["async"].eq(True).to_numpy(bool) if "async" in df else np.ones(len(df), bool)
    c = df.loc[df["complete"].to_numpy(bool) & sync & df["rank"].isin(list(rows)).to_numpy(),
               ["rank", "group", "ordinal", "op", "bytes", "enqueue_ns", "t_enq", "wait_ms"]]
    enq, ends, rank_of = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    if not c.empty:
        last = df.loc[df["complete"].to_numpy(bool)].groupby(["group", "ordinal"], observed=True)["t_enq"].max()
        c = c.join(last.rename("t_last"), on=["group", "ordinal"])
        total = np.nan_to_num(c["wait_ms"].to_numpy(float))
        # past the last arrival, the op's own time is a low quantile of that part over the
        # group's instances of the same op and about the same size (_transfer_time: an
        # expert-parallel all_to_all's size changes every step); the rest is the host's delay
        # (on 2 shared cores a 512 KiB all_to_all took 0.6 ms at best, 3.1 ms at the median):
        # a slow link makes every instance slow, and its quantile keeps it communication
        wait, late = _overlap_credit.split_waits(total, c["t_enq"].to_numpy(float),
                                                 c["t_last"].to_numpy(float), c["group"].to_numpy(),
                                                 c["op"].to_numpy(), c["bytes"].to_numpy())
        enq = c["enqueue_ns"].astype(np.int64).to_numpy()
        ends = enq + np.round(wait * 1e6).astype(np.int64)
        rank_of = c["rank"].to_numpy(np.int64)
        d = late > 0
        stop = enq[d] + np.round(total[d] * 1e6).astype(np.int64)
        enq = np.concatenate([enq, stop - np.round(late[d] * 1e6).astype(np.int64)])
        ends = np.concatenate([ends, stop])
        rank_of = np.concatenate([rank_of, rank_of[d]])
    # a pipeline stage's receive waiting for the upstream stage to issue its send: the same
    # lateness of another rank (the schedule's dependency), not a transfer
    up = _lateness.p2p_upstream_waits(df)
    if len(up):
        enq = np.concatenate([enq, up["start_ns"].to_numpy(np.int64)])
        ends = np.concatenate([ends, up["end_ns"].to_numpy(np.int64)])
        rank_of = np.concatenate([rank_of, up["rank"].to_numpy(np.int64)])
    if not len(enq):
        return {}
    out = {}
    for rank, rs in rows.items():
        m = rank_of == rank
        waits = iv.union(enq[m], ends[m])
        got = sum(min(iv.length(iv.clip(waits, x["start_ns"], x["end_ns"])) / 1e6, x["exposed_comm_ms"])
                  for x in rs)
        win = sum(x["window_ms"] for x in rs)
        if win > 0:
            out[rank] = round(got / win, 4)
    return out


def _has_log(run) -> bool:
    return bool(not run.trace_inputs and has_collective_log(run))
