"""The collective log's name for gloo events the trace names after their implementation.

gloo runs reduce_scatter as an allreduce: its worker thread records ``gloo:all_reduce`` for
the job's ``reduce_scatter_tensor`` (ZeRO-3, FSDP2 on CPU). The collective log (probes/
collectives.py) recorded the call the job made. An ``all_reduce`` event inside the span of a
logged reduce_scatter ([enqueue_ns, end_ns] ± MATCH_SLACK_NS) and of no logged all_reduce is
that reduce_scatter.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._comm_groups import MATCH_SLACK_NS, coll_types

# the trace's type -> the logged op it may stand for
IMPLEMENTED_AS = {"all_reduce": "reduce_scatter"}


def _spans(log, op: str):
    """(enqueue_ns, end_ns) of the log's ``op`` records with both times, sorted by enqueue."""
    ops = np.asarray(log["op"], dtype=object)
    enq = np.asarray(log["enqueue_ns"], dtype=object)
    end = np.asarray(log["end_ns"], dtype=object)
    keep = [i for i in range(len(ops)) if ops[i] == op and isinstance(enq[i], (int, np.integer))
            and isinstance(end[i], (int, np.integer))]
    s = np.array([int(enq[i]) for i in keep], np.int64)
    e = np.array([int(end[i]) for i in keep], np.int64)
    order = np.argsort(s, kind="stable")
    return s[order], e[order]


def _inside(starts, ends, spans, lookback: int = 8) -> np.ndarray:
    """Whether each [start, end] lies inside one of ``spans`` (give or take the slack)."""
    s, e = spans
    out = np.zeros(len(starts), bool)
    if not len(s):
        return out
    last = np.searchsorted(s, starts + MATCH_SLACK_NS, side="right") - 1
    for k in range(lookback):  # spans of one thread's ops hardly nest deeper than this
        j = last - k
        ok = j >= 0
        jj = np.where(ok, j, 0)
        out |= ok & (e[jj] + MATCH_SLACK_NS >= ends)
    return out


def types(names, starts, ends, log) -> np.ndarray:
    """coll_types(names), with each event the log shows to be another op given that op."""
    out = coll_types(names)
    if log is None or not len(log) or not all(c in log for c in ("op", "enqueue_ns", "end_ns")):
        return out
    starts = np.asarray(starts, np.int64)
    ends = np.asarray(ends, np.int64)
    for shown, real in IMPLEMENTED_AS.items():
        cand = np.flatnonzero(out == shown)
        if not len(cand):
            continue
        real_spans = _spans(log, real)
        if not len(real_spans[0]):
            continue
        hit = _inside(starts[cand], ends[cand], real_spans) & \
            ~_inside(starts[cand], ends[cand], _spans(log, shown))
        out[cand[hit]] = real
    return out
