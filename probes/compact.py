"""Bounded always-on capture: compact per-step tables and a ring of recent detail.

Each rank's always-on data stays within ``TRAINPROF_BUDGET_MB`` (wrap --budget-mb; default
256 MB, a week at one step a second) whatever the run's length:

* every step keeps compact fixed-width records (trainprof/rundir/compact.py): its timings, data
  wait, memory, and per (process group, collective kind) sums of the collective log, appended
  to ``ranks/rank-N/compact/<table>.bin`` by the probes' ticker thread right after each step
  boundary (the job's thread only hands the records over);
* the JSONL streams (``collectives.jsonl`` first: ~250 B per collective) are a ring of the most
  recent steps: past its share of the budget a stream's file is renamed to
  ``<stream>.prev.jsonl`` (replacing the older one) and a new one started;
* the collective log's records around anomalies this rank sees (a slow step, its step time
  jumping, a NaN) are also kept in detail windows (probes/detail_windows.py), a bounded share;
* when the compact tables would pass their share, their older half is folded into blocks
  (``<table>.blocks.bin``: per block of 2^k steps each value's min / median / max / sum) and
  when the blocks pass theirs, adjacent blocks merge (twice the steps per block): never a
  silent stop, and the reader says which steps are at which resolution.

Standard library only on the job's side; numpy (present with torch) on the ticker thread.
"""

from __future__ import annotations

import collections
import json
import os
import threading

from trainprof.rundir import compact as fmt
from trainprof.probes import runtime
from trainprof.probes.detail_windows import NAN_KINDS, DetailWindows, StepWatch
from trainprof.rundir.files import JsonlWriter, write_json_atomic
from trainprof import settings

ENV_BUDGET = "TRAINPROF_BUDGET_MB"
DEFAULT_BUDGET_MB = 256.0
MIN_BUDGET_MB = 1.0
STATE = "state.json"

RING_SHARE, COMPACT_SHARE, BLOCKS_SHARE = 0.34, 0.45, 0.10  # the rest: meta, groups, heartbeat
WINDOWS_SHARE = 0.06  # detail windows around anomalies (probes/detail_windows.py)
HEARTBEAT_SHARE = 0.03  # heartbeat.jsonl + heartbeat.prev.jsonl (probes/heartbeat.py)
RING_WEIGHTS = {"collectives": 0.55, "steps": 0.08, "pipeline": 0.1, "memory": 0.08,
                "data": 0.05, "nan": 0.06, "telemetry": 0.05, "steps_device": 0.03}
FIRST_BLOCK_STEPS = 16


def budget_bytes(environ=None) -> int:
    """The per-rank budget in bytes, read as every setting is (trainprof/settings.py: wrap
    refuses a value under 1 MB; a job started without wrap falls back to the default)."""
    mb = settings.value(ENV_BUDGET, environ)
    return int((mb if mb and mb >= MIN_BUDGET_MB else DEFAULT_BUDGET_MB) * 2**20)


class RingWriter(JsonlWriter):
    """A deferred stream whose file is rotated to ``<name>.prev.jsonl`` past ``cap`` bytes, and
    whose records are also handed to ``observer(records)`` (on the flushing thread)."""

    def __init__(self, path, cap: int, observer=None, on_rotate=None, tap=None):
        super().__init__(path, deferred=True)
        self.cap = max(4096, int(cap))
        self.observer = observer
        self.tap = tap  # tap(records, bytes written): the detail windows
        self.on_rotate = on_rotate
        self.prev = self.path.with_name(self.path.name[:-len(".jsonl")] + ".prev.jsonl")
        self._size = 0
        self.rotations = 0
        self.largest_flush = 0

    def write(self, record: dict, urgent: bool = False) -> None:
        if self._closed:
            return
        self._queue.append((record,))  # serialized by the flusher
        if urgent or len(self._queue) > self.MAX_QUEUED:
            self.flush(wait=True)

    def _write_parts(self, parts) -> None:
        """JsonlWriter's flush, with the records handed to the observer first and the file
        rotated when this flush would take it past its cap."""
        recs = [r for p in parts if type(p) is not str for r in p]
        if self.observer is not None and recs:
            try:
                self.observer(recs)
            except Exception:  # noqa: BLE001 - the compact table is best effort
                self.errors += 1
        data = self._encode(parts)
        if self.tap is not None and recs:
            try:
                self.tap(recs, data)
            except Exception:  # noqa: BLE001 - the windows are best effort
                self.errors += 1
        self.largest_flush = max(self.largest_flush, len(data))
        if self._fd is None:
            self._open()
        if self._size and self._size + len(data) > self.cap:
            self._rotate()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self._size += len(data)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = None
        os.replace(self.path, self.prev)  # atomic: a reader sees the old ring or the new one
        self.rotations += 1
        self._open()
        if self.on_rotate is not None:
            self.on_rotate(self)


class Table:
    """One compact table of this rank: rows queued by the streams' flushes, appended by
    CompactStore.flush (O_APPEND, whole records)."""

    def __init__(self, store: "CompactStore", f: fmt.TableFormat, on_rows=None):
        self.store, self.fmt = store, f
        self.on_rows = on_rows  # on_rows(rows) after they are written (the step watch)
        self.path = fmt.table_path(store.dir.parent, f.name)
        self.bpath = fmt.table_path(store.dir.parent, f.name, blocks=True)
        self.pending: collections.deque = collections.deque()
        self.fd = None
        self.size = 0  # bytes of records in the file (header excluded)
        self.bsize = 0
        self.rows_written = 0

    def append(self, rows) -> None:
        if rows:
            self.pending.append(rows)

    def flush(self) -> int:
        rows = []
        try:
            while True:
                rows.extend(self.pending.popleft())
        except IndexError:
            pass
        if not rows:
            return 0
        data = self.fmt.pack(rows)
        if self.fd is None:
            if not self.path.exists():
                fmt.new_table_file(self.path, self.fmt)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self.size = os.fstat(self.fd).st_size - fmt.HEADER_SIZE
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.size += len(data)
        self.rows_written += len(rows)
        if self.on_rows is not None:
            self.on_rows(rows)
        return len(data)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


class CompactStore:
    def __init__(self, rank_dir, budget: int):
        self.dir = rank_dir / fmt.COMPACT_DIR
        self.budget = budget
        self.windows = DetailWindows(self.dir, "collectives", budget * WINDOWS_SHARE, self._state)
        self.watch = StepWatch(self.windows.anomaly)
        self.tables = {name: Table(self, f, self._watch_rows if name == "steps" else None)
                       for name, f in fmt.TABLES.items()}
        self.keys: dict[tuple[str, str], int] = {}
        self.keys_path = self.dir / fmt.KEYS
        self.lock = threading.Lock()
        self.steps_per_block = FIRST_BLOCK_STEPS
        self.folds = self.merges = 0
        self.errors = 0
        self.closed = False
        self.writers: dict[str, RingWriter] = {}
        self.warned_small = False
        self.state_lock = threading.Lock()

    def _watch_rows(self, rows) -> None:
        try:
            self.watch.rows(rows)
        except Exception as e:  # noqa: BLE001 - never into the job
            self.errors += 1
            if self.errors <= 3:
                runtime.warn(f"detail windows: {type(e).__name__}: {e}")

    # -- observers (run on the thread that flushes the stream)
    def observer(self, stream: str):
        if stream == "collectives":
            tab = self.tables["collectives"]
            return lambda recs: tab.append(fmt.collective_rows(recs, self.key_of))
        if stream == "nan":  # the NaN watch's detections open a detail window
            seen = set()

            def nan_obs(recs):
                for r in recs:
                    st = r.get("step") if type(r) is dict else None
                    if r.get("kind") in NAN_KINDS and type(st) is int and st not in seen:
                        seen.add(st)
                        self.windows.anomaly(st, "nan")
            return nan_obs
        conv = fmt.ROW_OF.get(stream)
        if conv is None:
            return None
        tab = self.tables[stream]

        def obs(recs):
            rows = [r for r in map(conv, recs) if r is not None]
            tab.append(rows)
        return obs

    def key_of(self, pg: str, op: str) -> int:
        k = self.keys.get((pg, op))
        if k is None:
            k = self.keys[(pg, op)] = len(self.keys)
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.keys_path, "ab") as f:  # before any row that uses it
                f.write((json.dumps({"key": k, "pg": pg, "op": op}) + "\n").encode())
        return k

    def ring_writer(self, path, stream: str) -> RingWriter:
        w = RingWriter(path, self.budget * RING_SHARE * RING_WEIGHTS.get(stream, 0.02) / 2,
                       self.observer(stream), self._rotated,
                       self.windows.feed if stream == self.windows.stream else None)
        self.writers[stream] = w
        if stream == self.windows.stream:
            self.windows.ring = w  # a window's steps before its anomaly: read back from the ring
        return w

    def heartbeat_cap(self) -> int:
        """Bytes of heartbeat.jsonl before it rotates (two files: the share of the budget)."""
        return max(16384, int(self.budget * HEARTBEAT_SHARE / 2))

    def _rotated(self, w: RingWriter) -> None:
        if w.largest_flush > w.cap and not self.warned_small:
            self.warned_small = True
            runtime.warn(f"{ENV_BUDGET}={self.budget / 2**20:g}: one step's "
                         f"{w.path.name} detail ({w.largest_flush // 1024} KB) is larger than its "
                         f"share of the budget ({w.cap // 1024} KB): the ring keeps only the last "
                         f"steps; raise {ENV_BUDGET}")

    # -- the ticker thread
    def flush(self) -> None:
        if self.closed:
            return
        with self.lock:
            try:
                for t in self.tables.values():
                    t.flush()
                self._maintain()
            except Exception as e:  # noqa: BLE001 - never into the job
                self.errors += 1
                if self.errors <= 3:
                    runtime.warn(f"compact tables: {type(e).__name__}: {e}")

    def _maintain(self) -> None:
        if sum(t.size for t in self.tables.values()) > self.budget * COMPACT_SHARE:
            self._fold()
        while sum(t.bsize for t in self.tables.values()) > self.budget * BLOCKS_SHARE \
                and self.merges < 60:
            self._merge()

    def _fold(self) -> None:
        """Fold the older half of every table's full-resolution steps into blocks."""
        steps = self.tables["steps"]
        rows, _ = fmt.read_table(steps.path)
        if len(rows) < 2:
            return
        first, last = int(rows["step"].min()), int(rows["step"].max())
        s = self.steps_per_block
        cutoff = ((first + last) // 2) // s * s  # on a block boundary where the steps allow
        if cutoff <= first:
            cutoff = (first + last) // 2 + 1
        for t in self.tables.values():
            self._fold_table(t, cutoff)
        self.folds += 1
        self._state()

    def _fold_table(self, t: Table, cutoff: int) -> None:
        if t.size <= 0:
            return
        rows, _ = fmt.read_table(t.path)
        old = rows[rows["step"] < cutoff]
        if not len(old):
            return
        blocks = fmt.fold(t.fmt, old, self.steps_per_block)
        if not t.bpath.exists():
            fmt.new_table_file(t.bpath, t.fmt, blocks=True)
        with open(t.bpath, "ab") as f:  # blocks first: the reader drops full rows they cover
            f.write(blocks.tobytes())
        t.bsize = os.path.getsize(t.bpath) - fmt.HEADER_SIZE
        keep = rows[rows["step"] >= cutoff]
        t.close()
        fmt.new_table_file(t.path, t.fmt, body=keep.tobytes())
        t.size = len(keep) * t.fmt.size

    def _merge(self) -> None:
        self.steps_per_block *= 2
        for t in self.tables.values():
            if t.bsize <= 0:
                continue
            blocks, _ = fmt.read_table(t.bpath)
            merged = fmt.merge_blocks(t.fmt, blocks, self.steps_per_block)
            fmt.new_table_file(t.bpath, t.fmt, blocks=True, body=merged.tobytes())
            t.bsize = len(merged) * t.fmt.block_struct.size
        self.merges += 1
        self._state()

    def _state(self) -> None:
        with self.state_lock:  # (the flushing thread, and a window opened by a NaN detection)
            write_json_atomic(self.dir / STATE, {
                "budget_bytes": self.budget, "steps_per_block": self.steps_per_block,
                "folds": self.folds, "merges": self.merges,
                "shares": {"ring": RING_SHARE, "compact": COMPACT_SHARE, "blocks": BLOCKS_SHARE,
                           "windows": WINDOWS_SHARE},
                "ring_caps": {k: w.cap for k, w in self.writers.items()},
                "detail_windows": self.windows.state()})

    def close(self) -> None:
        self.flush()
        with self.lock:
            try:
                self.windows.close()
                self._state()
            except Exception:  # noqa: BLE001
                pass
            self.closed = True
            for t in self.tables.values():
                t.close()


def attach_store(session):
    """The rank's CompactStore (created before the streams, see ProbeSession.stream)."""
    store = CompactStore(session.dir, budget_bytes())
    try:
        store.dir.mkdir(parents=True, exist_ok=True)
        store._state()
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"compact tables disabled: {type(e).__name__}: {e}")
        return None
    return store
