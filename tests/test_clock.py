"""Clock alignment: the NTP estimator, the store round trips with a skewed clock, timeouts,
the analyzers' offset functions, and offsets measured on one host in a real multi-rank run."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

from test_collective_log import collective_run  # noqa: F401 - shared session fixture
from trainprof.probes import clock


def test_estimate_math_by_hand():
    # remote clock is 1000 ns ahead; 100 ns each way; 50 ns spent answering
    t0 = 10_000
    t1 = t0 + 100 + 1000
    t2 = t1 + 50
    t3 = t0 + 100 + 50 + 100
    off, unc = clock.estimate(t0, t1, t2, t3)
    assert off == 1000
    assert unc == 100  # half of the 200 ns spent on the wire
    # asymmetric paths: error is within the uncertainty
    t1 = t0 + 10 + 1000
    t2 = t1
    t3 = t0 + 10 + 190
    off, unc = clock.estimate(t0, t1, t2, t3)
    assert abs(off - 1000) <= unc


@pytest.fixture()
def tcp_store():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    yield server


def _client(server):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


@pytest.mark.parametrize("skew_ns", [0, 7_500_000, -3_000_000_000])
def test_ping_serve_recovers_known_offset(tcp_store, skew_ns):
    """Rank 1's clock runs skew_ns behind rank 0's; the estimate recovers it."""
    ref_store, rank_store = _client(tcp_store), _client(tcp_store)
    served = []
    t = threading.Thread(target=lambda: served.extend(
        clock.serve(ref_store, [1], f"skew{skew_ns}", timeout_s=10)))
    t.start()
    best = clock.ping(rank_store, 1, f"skew{skew_ns}", timeout_s=10,
                      now=lambda: time.time_ns() - skew_ns)
    t.join(10)
    assert served == [1]
    off, unc, _t = best
    assert unc >= 0
    assert abs(off - skew_ns) <= unc + 1000, (off, unc)
    assert unc < 50e6  # a local TCPStore round trip is well under 100 ms even on a busy box


def test_timeouts_never_hang(tcp_store):
    store = _client(tcp_store)
    t0 = time.monotonic()
    assert clock.ping(store, 3, "nobody-answers", timeout_s=0.5) is None
    assert clock.serve(store, [1, 2], "nobody-pings", timeout_s=0.3, deadline_s=0.5) == []
    assert time.monotonic() - t0 < 5


def _run_with_clock(tmp_path, records: dict, hosts: dict):
    ranks = tmp_path / "ranks"
    for r, recs in records.items():
        d = ranks / f"rank-{r:05d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"rank": r, "host": hosts[r], "world_size": 3}))
        (d / "clock.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    from trainprof.rundir import RunDir

    return RunDir(tmp_path)


def test_offsets_interpolate_drift_and_identity(tmp_path):
    from trainprof.analyzers._clock import offsets

    run = _run_with_clock(tmp_path, {
        0: [{"phase": "start", "ref_rank": 0, "offset_ns": 0, "uncertainty_ns": 0, "t_ns": 0}],
        1: [{"phase": "start", "ref_rank": 0, "offset_ns": 1000, "uncertainty_ns": 10, "t_ns": 1_000_000},
            {"phase": "end", "ref_rank": 0, "offset_ns": 3000, "uncertainty_ns": 10, "t_ns": 3_000_000}],
        2: [],
    }, hosts={0: "a", 1: "b", 2: "b"})
    f = offsets(run)
    assert f[0](123) == 123
    assert f[1](1_000_000) == 1_001_000
    assert f[1](2_000_000) == 2_002_000  # linear drift between the two estimates
    assert f[1](3_000_000) == 3_003_000
    assert f[1](0) == 1000  # clamped outside the measured interval
    assert f[2](555) == 555  # no estimate: identity


def test_same_host_as_reference_is_identity(tmp_path):
    from trainprof.analyzers._clock import offsets

    run = _run_with_clock(tmp_path, {
        0: [{"phase": "start", "ref_rank": 0, "offset_ns": 0, "uncertainty_ns": 0, "t_ns": 0}],
        1: [{"phase": "start", "ref_rank": 0, "offset_ns": 40_000, "uncertainty_ns": 60_000, "t_ns": 5}],
    }, hosts={0: "same", 1: "same"})
    assert offsets(run)[1](10) == 10  # one host: one clock, the estimate is only noise


def test_bad_clock_record_is_reported(tmp_path):
    from trainprof.analyzers._clock import offsets

    run = _run_with_clock(tmp_path, {
        0: [{"phase": "start", "ref_rank": 0, "offset_ns": 0, "uncertainty_ns": 0, "t_ns": 0}],
        1: [{"phase": "start", "offset_ns": "x"}],
    }, hosts={0: "a", 1: "b"})
    assert offsets(run)[1](7) == 7
    assert any("clock.jsonl" in p for p in run.problems)


@pytest.mark.multiproc
def test_offsets_on_one_host_are_near_zero(collective_run):
    """Every rank of a real run recorded start and end estimates, ~0 on one host."""
    from trainprof.rundir import RunDir

    run = RunDir(collective_run)
    for r in run.ranks:
        recs = run.stream(r, "clock")
        phases = {x["phase"] for x in recs}
        assert phases == {"start", "end"}, (r, recs)
        for x in recs:
            assert x["uncertainty_ns"] < 50e6
            assert abs(x["offset_ns"]) <= x["uncertainty_ns"] + 1000, x
