"""_lateness.p2p_upstream_waits: the parts of a pipeline's point-to-point waits that are not the
transfer, by hand on a frame of the collectives analyzer's shape (times in ms, one clock)."""

import numpy as np
import pandas as pd
import pytest

from trainprof.analyzers import _lateness

MS = 1_000_000


def _frame(latencies, send_at=None):
    """Rank 0 sends to rank 1 every 100 ms (issued at ``send_at`` or with the receive); rank 1
    posts a blocking receive at 100·i ms and waits ``latencies[i]`` ms for it."""
    rows = []
    for i, lat in enumerate(latencies):
        t = 100.0 * i
        ts = t if send_at is None else send_at[i]
        rows.append(dict(rank=0, op="send", peer=1, t_enq=ts, t_end=ts + 0.01, blocked_ms=0.0))
        rows.append(dict(rank=1, op="recv", peer=0, t_enq=t, t_end=t + lat, blocked_ms=lat))
    df = pd.DataFrame(rows)
    df = df.assign(group="0:0,1", bytes=65536, p2p=True, **{"async": False},
                   enqueue_ns=(df["t_enq"] * MS).round().astype(np.int64),
                   end_ns=(df["t_end"] * MS).round().astype(np.int64))
    return df


def test_host_delay_past_the_transfer_time_and_the_wait_for_the_send_are_not_transfer():
    # six hand-overs of 1 ms, one of 21 ms: the edge's transfer takes 1 ms (10th percentile);
    # the 20 ms past it are the host's delay: [501, 521] ms on rank 1
    out = _lateness.p2p_upstream_waits(_frame([1, 1, 1, 1, 1, 21]))
    assert out.to_dict("records") == [{"rank": 1, "start_ns": 501 * MS, "end_ns": 521 * MS}]
    # the send of hand-over 2 issued 30 ms after the receive was posted (the upstream stage
    # still computing): its 31 ms wait is 30 ms of dependency [200, 230] and the 1 ms transfer
    out = _lateness.p2p_upstream_waits(_frame([1, 1, 31, 1, 1, 1], send_at=[0, 100, 230, 300, 400, 500]))
    assert out.to_dict("records") == [{"rank": 1, "start_ns": 200 * MS, "end_ns": 230 * MS}]


def test_a_slow_link_stays_communication():
    # every hand-over takes 20 ms: that is the transfer, nothing is left out; with fewer than
    # five hand-overs of a kind nothing past the send's issue is left out either
    assert _lateness.p2p_upstream_waits(_frame([20] * 6)).empty
    assert _lateness.p2p_upstream_waits(_frame([1, 1, 21])).empty
    assert _lateness.TRANSFER_MIN_RECORDS == 5 and _lateness.TRANSFER_QUANTILE == pytest.approx(0.1)


def test_a_send_waited_for_late_does_not_measure_the_transfer():
    """A pipeline schedule waits for its isends at the step's end: their end − issue is the
    sender's own work since, not the hand-over. Rank 0 isends every 100 ms and waits 80 ms
    later (the transfer long done: blocked 0); rank 1's blocking receives, posted with the send,
    take 1 ms. Hand-over 6: rank 0 waits from its isend at 500 ms, rank 1 posts its receive at
    510 ms (still busy: dependency [500, 510]), the data is there at 511 ms (1 ms, the edge's
    transfer measured at either end) and rank 0's wait returns at 530 ms: [511, 530] is the
    host's delay. Judged from the sends' own end − issue (80 ms) it would all be transfer."""
    rows = []
    for i in range(5):
        t = 100.0 * i
        rows.append(dict(rank=0, op="send", peer=1, t_enq=t, t_end=t + 80, blocked_ms=0.0, is_async=True))
        rows.append(dict(rank=1, op="recv", peer=0, t_enq=t, t_end=t + 1, blocked_ms=1.0, is_async=False))
    rows.append(dict(rank=0, op="send", peer=1, t_enq=500.0, t_end=530.0, blocked_ms=30.0, is_async=True))
    rows.append(dict(rank=1, op="recv", peer=0, t_enq=510.0, t_end=511.0, blocked_ms=1.0, is_async=False))
    df = pd.DataFrame(rows).rename(columns={"is_async": "async"})
    df = df.assign(group="0:0,1", bytes=65536, p2p=True,
                   enqueue_ns=(df["t_enq"] * MS).round().astype(np.int64),
                   end_ns=(df["t_end"] * MS).round().astype(np.int64))
    out = _lateness.p2p_upstream_waits(df)
    assert sorted(map(tuple, out.to_numpy().tolist())) == [(0, 500 * MS, 510 * MS), (0, 511 * MS, 530 * MS)]
