"""Asynchronous point-to-point on CPU (gloo) traces: isend/irecv, batch_isend_irecv and the
torch.distributed.pipelining schedules built on them.

gloo records an async send or receive as a ``gloo:send`` / ``gloo:recv`` span on the issuing
thread from the issue to the transfer's completion — for a pipeline's send often the whole step,
with the rank's forward and backward matmuls running inside it. The rank waits for the transfer
only inside ``Work.wait()``; that part alone is communication the rank sits through. Everything
else under the span is the rank's own work.

Where it waited: the collective log (probes/collectives.py) closes an async op at the return of
the ``wait()`` that completed it, with the time spent in that wait (``blocked_ms``): the wait is
[end_ns − blocked_ms, end_ns]. An async op nobody waited for (``blocked_ms`` 0) cost no wait.
Without a log record (a bare trace), a span during which the thread ran torch ops is async and
its wait is the span minus those ops (the thread's gaps inside it); a span during which the
thread ran nothing is a synchronous send/recv and stays a wait as a whole.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _intervals as iv

P2P_EVENTS = ("gloo:send", "gloo:recv")
# the c10d calls that issue a point-to-point op: with isend/irecv they return without waiting
ISSUE_OPS = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_")
MATCH_NS = 1_000_000_000  # an event starts at most this long after its log record's issue
SLACK_NS = 1_000_000      # the log stamps the issue before c10d does; clocks agree this well


def _log_records(log, kind: str):
    """(enqueue_ns, end_ns, blocked_ns, async) arrays of the log's ``kind`` ops with times."""
    if log is None or not len(log) or not all(c in log for c in ("op", "enqueue_ns", "end_ns")):
        return None
    op = np.asarray(log["op"], dtype=object)
    enq = np.asarray(log["enqueue_ns"], dtype=object)
    end = np.asarray(log["end_ns"], dtype=object)
    blocked = np.asarray(log["blocked_ms"], dtype=object) if "blocked_ms" in log else \
        np.full(len(op), np.nan, dtype=object)
    is_async = np.asarray(log["async"], dtype=object) if "async" in log else \
        np.full(len(op), None, dtype=object)
    rows = [i for i in range(len(op))
            if str(op[i]).lstrip("i") == kind and isinstance(enq[i], (int, np.integer))
            and isinstance(end[i], (int, np.integer))]
    if not rows:
        return None
    b = [blocked[i] if isinstance(blocked[i], (int, float)) and blocked[i] == blocked[i] else None
         for i in rows]
    return (np.array([int(enq[i]) for i in rows], np.int64),
            np.array([int(end[i]) for i in rows], np.int64),
            [None if x is None else int(x * 1e6) for x in b],
            [is_async[i] is True for i in rows])


def all_async(log) -> bool:
    """The log's point-to-point ops are all asynchronous (isend/irecv, batch_isend_irecv): their
    issuing calls (ISSUE_OPS) are the host's work of posting them; the waits are Work.wait()'s."""
    recs = [_log_records(log, k) for k in ("send", "recv")]
    recs = [r for r in recs if r]
    return bool(recs) and all(all(r[3]) for r in recs)


def _match(starts: np.ndarray, enq: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Index of the log record each event belongs to (-1: none), in time order: the oldest
    unused record issued before the event started (within MATCH_NS; the span opens as the
    issuing c10d call returns, which can take long on a busy host) and not over by then."""
    out = np.full(len(starts), -1, np.int64)
    used = np.zeros(len(enq), bool)
    order = np.argsort(enq, kind="stable")
    enq_sorted = enq[order]
    for k in np.argsort(starts, kind="stable"):
        s = int(starts[k])
        lo = np.searchsorted(enq_sorted, s - MATCH_NS)
        hi = np.searchsorted(enq_sorted, s + SLACK_NS, side="right")
        for j in order[lo:hi]:
            if not used[j] and end[j] >= s - SLACK_NS:
                used[j] = True
                out[k] = j
                break
    return out


def split(starts, ends, kinds, log, busy: iv.Set) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The communication of the thread's p2p events: (row, start, end) triples, one or more per
    event: a synchronous event's whole span; an async one's wait (none when it never waited).
    ``kinds``: "send"/"recv" per event; ``busy``: the thread's own ops (not waits)."""
    starts = np.asarray(starts, np.int64)
    ends = np.asarray(ends, np.int64)
    rows, lo, hi = [], [], []
    for kind in ("send", "recv"):
        idx = np.flatnonzero(np.asarray(kinds, dtype=object) == kind)
        if not len(idx):
            continue
        recs = _log_records(log, kind)
        match = _match(starts[idx], recs[0], recs[1]) if recs else np.full(len(idx), -1)
        for k, j in zip(idx.tolist(), match.tolist()):
            s, e = int(starts[k]), int(ends[k])
            if j >= 0 and recs[3][j]:          # async in the log: its wait only
                blocked, end = recs[2][j], int(recs[1][j])
                if blocked:
                    rows.append(k), lo.append(max(end - blocked, int(recs[0][j]))), hi.append(end)
                continue
            if j >= 0:                          # synchronous: the call waited throughout
                rows.append(k), lo.append(s), hi.append(e)
                continue
            if iv.length(iv.clip(busy, s, e)) == 0:  # no log, nothing ran under it: synchronous
                rows.append(k), lo.append(s), hi.append(e)
                continue
            free = iv.subtract((np.array([s], np.int64), np.array([e], np.int64)), busy)
            rows += [k] * len(free[0])
            lo += free[0].tolist()
            hi += free[1].tolist()
    return (np.array(rows, np.int64), np.array(lo, np.int64), np.array(hi, np.int64))
