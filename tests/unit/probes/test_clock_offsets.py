"""Clock offsets between hosts (probes/clock.py): estimates by hand, ping/serve, drift
interpolation, bad records, exit hooks; single process."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

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
    from trainprof.analysis.run import RunDir

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


class _FakeSession:
    def __init__(self, rank):
        self.rank = rank
        self.records = []
        self.writer = self

    def stream(self, _name):
        return self

    def write(self, rec, urgent=False):
        self.records.append(rec)


def _probe_without_peers(tcp_store, rank):
    probe = clock.ClockProbe(_FakeSession(rank))
    probe.store, probe.world, probe.started = _client(tcp_store), 2, True
    return probe


@pytest.mark.parametrize("rank", [0, 1])
def test_end_estimate_never_waits_on_peers_when_the_process_is_failing(tcp_store, monkeypatch,
                                                                       rank):
    """Nobody answers (the peer is gone). A clean exit waits its end budget for it; a process
    dying of an exception or sys.exit(non-zero) returns at once, with nothing written."""
    import os

    from trainprof.probes import heartbeat_exit

    monkeypatch.setenv(clock.ENV_END_TIMEOUT, "1.5")
    monkeypatch.setattr(heartbeat_exit, "_pid", os.getpid())
    monkeypatch.setattr(heartbeat_exit, "_failure", None)
    probe = _probe_without_peers(tcp_store, rank)
    t0 = time.monotonic()
    probe.end()
    clean_s = time.monotonic() - t0
    assert clean_s >= 1.4  # the clean exit does wait for its peer (the budget)
    for failure in ({"kind": "exception", "exc_type": "RuntimeError", "exc": "boom"},
                    {"kind": "exit", "exit_code": 7}):
        monkeypatch.setattr(heartbeat_exit, "_failure", failure)
        probe = _probe_without_peers(tcp_store, rank)
        t0 = time.monotonic()
        probe.end()
        assert time.monotonic() - t0 < 0.5, failure
        assert probe.session.records == []


EXIT_SCRIPT = r"""
import sys, threading
from trainprof.probes import heartbeat_exit
seen = []
def user_hook(t, e, tb):  # the job's own hook: must still run, and print as it likes
    sys.stderr.write(f"user hook saw {t.__name__}: {e}\n")
sys.excepthook = user_hook
heartbeat_exit.install()
heartbeat_exit.on_failure(lambda rec: seen.append(rec))
import atexit
atexit.register(lambda: sys.stdout.write(f"failure={heartbeat_exit.failure()!r} seen={len(seen)}\n"))
mode = sys.argv[1]
if mode == "thread":
    t = threading.Thread(target=lambda: 1 / 0, name="worker"); t.start(); t.join()
    print("main goes on")
elif mode == "exit7":
    sys.exit(7)
elif mode == "exit0":
    sys.exit(0)
elif mode == "raise":
    raise RuntimeError("boom: corrupt batch at step 5")
"""


@pytest.mark.parametrize("mode, rc, failure_kind", [
    ("raise", 1, "exception"), ("exit7", 7, "exit"), ("exit0", 0, None), ("thread", 0, None),
    ("clean", 0, None)])
def test_exit_hooks_record_the_failure_and_change_nothing(tmp_path, mode, rc, failure_kind):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == rc, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    if failure_kind is None:
        assert last.startswith("failure=None"), p.stdout
    else:
        assert f"'kind': '{failure_kind}'" in last, p.stdout
    if mode == "raise":  # the job's hook ran; the exception's text recorded
        assert "user hook saw RuntimeError: boom: corrupt batch at step 5" in p.stderr
        assert "'exc': 'boom: corrupt batch at step 5'" in last and "seen=1" in last
    if mode == "exit7":
        assert "'exit_code': 7" in last and p.stderr == ""
    if mode == "thread":  # recorded for the listeners, the traceback printed as before
        assert "ZeroDivisionError" in p.stderr and "main goes on" in p.stdout and "seen=1" in last


# --------------------------------------------------------------------------- who measures


class _CountingStore:
    """A store client that counts its calls (every method the clock probe uses)."""

    def __init__(self, store):
        self._store, self.calls = store, 0

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def counted(*args):
            self.calls += 1
            return fn(*args)

        return counted


def _phase(probes: dict, phase: str, hosts: dict, monkeypatch, timeout_s=20.0):
    """Run one phase of every probe at once, each on a thread standing for its rank's host."""
    monkeypatch.setattr(clock, "_host", lambda: hosts[int(threading.current_thread().name)])
    threads = [threading.Thread(target=p._run, name=str(r),
                                args=(phase, timeout_s, timeout_s if phase == "end" else None))
               for r, p in probes.items()]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return time.monotonic() - t0


def _probes(tcp_store, world: int, key: str, monkeypatch) -> dict:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", key)
    probes = {}
    for r in range(world):
        p = clock.ClockProbe(_FakeSession(r))
        p.store, p.world, p.started = _CountingStore(_client(tcp_store)), world, True
        probes[r] = p
    return probes


def test_ranks_on_rank0s_host_measure_nothing(tcp_store, monkeypatch):
    """16 ranks on one host: each records offset 0 with no round trip (a few store calls at
    start, none at exit); rank 0 answers nobody and leaves at once at exit. (Every rank used to
    run 8 round trips that rank 0 answered one rank after the other, polling the store ~100
    times a second while it waited, and every rank waited up to its end budget at exit.)"""
    world = 16
    probes = _probes(tcp_store, world, "one-host", monkeypatch)
    hosts = {r: "node-a" for r in probes}
    _phase(probes, "start", hosts, monkeypatch)
    assert probes[0].start_complete and probes[0].registered == 0
    for r in range(1, world):
        (rec,) = probes[r].session.records
        assert rec["phase"] == "start" and rec["rounds"] == 0 and rec["same_host"] is True
        assert rec["offset_ns"] == 0 and rec["uncertainty_ns"] == 0
        assert probes[r].store.calls <= 4, probes[r].store.calls  # read the host, count itself
    for p in probes.values():
        p.store.calls = 0
    took = _phase(probes, "end", hosts, monkeypatch)
    assert took < 5  # nobody waits for anybody (the budget here is 20 s)
    assert sum(p.store.calls for p in probes.values()) == 0
    for r, p in probes.items():
        assert [x["phase"] for x in p.session.records] == ["start", "end"]
        assert all(x["offset_ns"] == 0 for x in p.session.records)


def test_ranks_on_other_hosts_are_measured(tcp_store, monkeypatch):
    """Ranks 2 and 3 run on another host: they register and rank 0 measures them (8 round
    trips, ~0 offset through a local store), at start and again at exit; rank 1, on rank 0's
    host, records offset 0 unmeasured."""
    probes = _probes(tcp_store, 4, "two-hosts", monkeypatch)
    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    for phase in ("start", "end"):
        _phase(probes, phase, hosts, monkeypatch)
    assert probes[0].start_complete and probes[0].registered == 2
    assert [x["rounds"] for x in probes[1].session.records] == [0, 0]
    for r in (2, 3):
        recs = probes[r].session.records
        assert [x["phase"] for x in recs] == ["start", "end"], recs
        for x in recs:
            assert x["rounds"] == clock.ROUNDS and "same_host" not in x
            assert 0 <= x["uncertainty_ns"] < 50e6
            assert abs(x["offset_ns"]) <= x["uncertainty_ns"] + 1000, x


def test_a_rank_deciding_only_at_exit_is_still_measured(tcp_store, monkeypatch):
    """Rank 2 (another host) missed the start phase: at exit it registers and rank 0, which
    did not see every rank decide at start, answers it within the end budget."""
    probes = _probes(tcp_store, 3, "late", monkeypatch)
    hosts = {0: "node-a", 1: "node-a", 2: "node-b"}
    _phase({r: p for r, p in probes.items() if r != 2}, "start", hosts, monkeypatch,
           timeout_s=0.5)
    assert not probes[0].start_complete
    _phase(probes, "end", hosts, monkeypatch, timeout_s=10)
    (rec,) = probes[2].session.records
    assert rec["phase"] == "end" and rec["rounds"] == clock.ROUNDS
