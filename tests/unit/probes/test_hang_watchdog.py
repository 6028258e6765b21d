"""The hang watchdog in one process: heartbeats appended only on progress, a trigger file dumps
every thread's stack."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from hang_shared import _lines
from helpers import wait_for
from trainprof.probes.ticker import Ticker
from trainprof.rundir.files import HANG_DUMP, HANG_TRIGGER, write_json_atomic


class _Clock:
    step = 0
    start_ns = 0


class _Session:
    def __init__(self, root: Path, rank=0):
        self.run_dir = root
        self.rank = rank
        self.dir = root / "ranks" / f"rank-{rank:05d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.clock = _Clock()
        self.state: dict = {}
        self.closers = []
        self.ticker = Ticker()  # the probes' periodic thread, as in ProbeSession
        self.ticker.start()

    def on_close(self, fn):
        self.closers.append(fn)

    def close(self):
        for fn in self.closers:
            fn()
        self.ticker.stop()


def test_heartbeat_appends_only_on_progress(tmp_path, monkeypatch):
    from trainprof.probes import heartbeat

    monkeypatch.setenv(heartbeat.ENV_INTERVAL, "0.05")
    s = _Session(tmp_path)
    heartbeat.attach(s)
    path = s.dir / "heartbeat.jsonl"
    time.sleep(0.4)  # no progress: no new records
    assert [r["event"] for r in _lines(path)] == ["start"]
    s.clock.step = 1
    assert wait_for(lambda: len(_lines(path)) == 2, timeout=5)
    rec = {"step": 1, "pg": "0", "seq": 7, "op": "all_reduce", "bytes": 4, "enqueue_ns": 5,
           "end_ns": None, "blocked_ms": 0}
    s.state["last_collective"] = rec
    s.state["inflight_collectives"] = {1: rec}
    assert wait_for(lambda: len(_lines(path)) == 3, timeout=5)
    last = _lines(path)[-1]
    assert last["step"] == 1 and last["last_collective"]["seq"] == 7
    assert last["inflight"][0]["op"] == "all_reduce" and last["inflight_count"] == 1
    time.sleep(0.3)
    assert len(_lines(path)) == 3  # stuck in that collective: the file stops growing
    s.close()
    assert _lines(path)[-1]["event"] == "close"


def parked_in_collective(ev):  # a frame the dump must show
    ev.wait(30)


def test_trigger_file_makes_every_thread_stack_dump(tmp_path, monkeypatch):
    from trainprof.probes import hang_watchdog, heartbeat

    monkeypatch.setenv(hang_watchdog.ENV_POLL, "0.05")
    trigger = tmp_path / HANG_TRIGGER
    write_json_atomic(trigger, {"id": "stale"})  # older than the rank: ignored
    s = _Session(tmp_path, rank=3)
    s.state["last_collective"] = {"pg": "1", "seq": 4, "op": "broadcast"}
    heartbeat.attach(s)
    hang_watchdog.attach(s)
    ev = threading.Event()
    t = threading.Thread(target=parked_in_collective, args=(ev,), name="worker")
    t.start()
    try:
        dump = s.dir / HANG_DUMP
        time.sleep(0.3)
        assert not dump.exists()
        write_json_atomic(trigger, {"id": "t1"})
        assert wait_for(lambda: dump.exists() and json.loads(dump.read_text())["complete"], 10)
        d = json.loads(dump.read_text())
        assert d["trigger_id"] == "t1" and d["rank"] == 3
        assert d["last_collective"]["op"] == "broadcast"
        worker = next(x for x in d["threads"] if x["name"] == "worker")
        own = [f for f in worker["frames"] if not f["lib"]]
        assert own[-1]["function"] == "parked_in_collective" and own[-1]["code"] == "ev.wait(30)"
        assert worker["frames"][-1]["lib"] is True  # threading.py: library, not the job
        assert any(x["main"] for x in d["threads"])
        assert not any(x["name"] == "trainprof-tick" for x in d["threads"])  # the dumping thread
        assert "file" in d["flight_recorder"] or "error" in d["flight_recorder"]
    finally:
        ev.set()
        t.join()
        s.close()
