"""Heartbeat: a crash-safe record of each rank's progress (ranks/rank-N/heartbeat.jsonl).

The session's ticker thread (probes/ticker.py) calls it every TRAINPROF_HEARTBEAT_S seconds
(default 1), and it appends one record
*only when the rank progressed* since the last one: the step index, the last collective issued
(collectives probe, via ``session.state``), the set of in-flight collectives, or the flight
recorder's per-group enqueued/completed counters changed. A rank stuck in a collective or a
sleep therefore stops writing; the time of its last record is the time of its last progress
(within one interval). The launcher's watchdog (`trainprof wrap --hang-timeout`) watches these
files grow; `analyzers/hang.py` reads them after the fact, also after SIGKILL.

Record: {t_ns, event: "start"|"progress"|"failure"|"thread_exception"|"close", pid, step,
last_collective, inflight, inflight_count, fr}. A process that dies of an uncaught exception or
``sys.exit(non-zero)`` writes a ``failure`` record at that moment (probes/heartbeat_exit.py), with
``failure``: {kind: "exception"|"exit", exc_type, exc, exit_code, t_ns}; its ``close`` record
carries the same ``failure``. An exception that ends another thread is a ``thread_exception``
record (the process may go on). ``last_collective``/``inflight`` carry the collectives.jsonl fields
(pg, seq, op, bytes, enqueue_ns, ...); ``fr`` is {pg_name: [last_enqueued, last_completed]} from
PyTorch's flight recorder, which counts collectives even without the collectives probe.

Each record is one O_APPEND write() of a complete line: a kill leaves at most a torn last line.
The file is rotated to heartbeat.prev.jsonl past ROTATE_BYTES so a weeks-long job stays bounded.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from trainprof import settings
from trainprof.probes import heartbeat_exit, runtime
from trainprof.rundir.files import HEARTBEAT as STREAM, HEARTBEAT_PREV as PREV, close_quietly, dumps_compact

ENV_INTERVAL = "TRAINPROF_HEARTBEAT_S"
ROTATE_BYTES = 16 << 20
MAX_INFLIGHT = 8  # records carried per heartbeat; the count is always exact
COLLECTIVE_FIELDS = ("step", "pg", "seq", "op", "bytes", "dtype", "numel", "enqueue_ns", "end_ns",
                     "peer", "async", "api")


def attach(session) -> None:
    hb = Heartbeat(session)
    session.state["heartbeat"] = hb
    session.on_close(hb.close)
    hb.start()
    heartbeat_exit.install()
    heartbeat_exit.on_failure(hb.failed)


def compact(rec) -> dict | None:
    if not isinstance(rec, dict):
        return None
    return {k: rec[k] for k in COLLECTIVE_FIELDS if k in rec}


def inflight_records(state: dict) -> list[dict]:
    """The in-flight collectives of the collectives probe, oldest first. The dict is mutated by
    the job's threads while we read it: copy, and retry on a concurrent resize."""
    inflight = state.get("inflight_collectives")
    if not inflight:
        return []
    for _ in range(3):
        try:
            recs = list(inflight.values())
            break
        except RuntimeError:  # dictionary changed size during iteration
            continue
    else:
        return []
    recs = [compact(r) for r in recs if isinstance(r, dict)]
    recs.sort(key=lambda r: (r.get("enqueue_ns") or 0, str(r.get("pg")), r.get("seq") or 0))
    return recs


def fr_status() -> dict | None:
    """{pg_name: [last_enqueued, last_completed]} from the flight recorder (~10 us), or None.
    gloo records these counters too (its entries' state stays 'scheduled')."""
    if "torch" not in sys.modules:
        return None
    try:
        import pickle

        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        from torch._C import _distributed_c10d as c10d

        fn = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
        if fn is None:
            return None
        # Our own output, from this process: not the untrusted-input case the reader guards.
        status = pickle.loads(fn(includeCollectives=False)).get("pg_status") or {}
        return {str(pg): [s.get("last_enqueued_collective"), s.get("last_completed_collective")]
                for pg, s in status.items() if isinstance(s, dict)}
    except Exception:  # noqa: BLE001 - optional facility
        return None


class Heartbeat:
    def __init__(self, session):
        self.session = session
        self.path = session.dir / STREAM
        try:
            self.interval = max(0.05, settings.value(ENV_INTERVAL))
        except ValueError:
            self.interval = 1.0
        self._fd: int | None = None
        self._size = 0  # bytes in the file: no fstat per record
        store = getattr(session, "compact", None)  # within the rank's budget (probes/compact.py)
        self.rotate_bytes = min(ROTATE_BYTES, store.heartbeat_cap()) if store else ROTATE_BYTES
        self._closed = False
        # re-entrant: a signal handler that exits (sys.exit in a SIGTERM handler) runs on the
        # main thread, possibly while it is inside _append; a plain lock would deadlock there
        self._lock = threading.RLock()
        self._stopped = False
        self._key = None
        self._use_fr = True
        self.last: dict = {}
        self.errors = 0

    def start(self) -> None:
        self.beat("start", force=True)
        self.session.ticker.every(self.interval, self._tick)  # the probes' periodic thread

    def _tick(self) -> None:
        if not self._stopped:
            self.beat()

    def snapshot(self, with_fr: bool = True) -> dict:
        """This rank's progress now (also used by the hang dump)."""
        state = self.session.state
        inflight = inflight_records(state)
        fr = fr_status() if self._use_fr and with_fr else None
        if fr is None and with_fr:
            self._use_fr = False  # absent or failing: don't retry every second
        return {"pid": os.getpid(), "step": self.session.clock.step,
                "last_collective": compact(state.get("last_collective")),
                "inflight": inflight[:MAX_INFLIGHT], "inflight_count": len(inflight),
                "fr": fr}

    def failed(self, failure: dict) -> None:
        """The process is dying of ``failure`` (or a thread died): say so at once."""
        event = "thread_exception" if failure.get("kind") == "thread_exception" else "failure"
        # on the failing thread: no flight-recorder dump (a backend call that may block)
        self.beat(event, force=True, extra={"failure": failure}, with_fr=False)

    def beat(self, event: str = "progress", force: bool = False,
             extra: dict | None = None, with_fr: bool = True) -> None:
        try:
            snap = self.snapshot(with_fr)
            lc = snap["last_collective"] or {}
            key = (snap["step"], lc.get("pg"), lc.get("seq"), lc.get("end_ns"),
                   tuple((r.get("pg"), r.get("seq")) for r in snap["inflight"]),
                   snap["inflight_count"],
                   tuple(sorted((k, tuple(v)) for k, v in snap["fr"].items())) if snap["fr"] else None)
            if key == self._key and not force:
                return
            self._key = key
            rec = {"t_ns": time.time_ns(), "event": event, **snap, **(extra or {})}
            self._append(dumps_compact(rec) + "\n")  # orjson where present: ~5x json's speed
            self.last = rec
        except Exception:  # noqa: BLE001 - never raise into the job
            self.errors += 1

    def _append(self, line: str) -> None:
        data = line.encode()
        with self._lock:
            if self._closed:
                return
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                self._size = os.fstat(self._fd).st_size
            os.write(self._fd, data)  # one write: a kill tears at most this line
            self._size += len(data)
            if self._size > self.rotate_bytes:
                os.close(self._fd)
                self._fd = None
                os.replace(self.path, self.path.with_name(PREV))

    def close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        failure = None
        try:
            failure = heartbeat_exit.failure()
        except Exception:  # noqa: BLE001
            pass
        self.beat("close", force=True, extra={"failure": failure} if failure else None)
        with self._lock:
            self._closed = True
            self._fd = close_quietly(self._fd)
