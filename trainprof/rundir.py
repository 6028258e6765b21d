"""The run directory: the only contract between capture (probes) and analysis (analyzers).

Layout (schema version 1, documented in docs/run-directory.md)::

    RUN/
      manifest.json                      written by the launcher (`trainprof wrap`) at start and end
      ranks/rank-00000/meta.json         written by each rank's probes when they activate
      ranks/rank-00000/<stream>.jsonl    append-only per-rank streams (steps, collectives, ...)
      profiler/rank-00000.pt.trace.json.gz   torch.profiler Chrome traces (HTA-loadable folder)
      summary.json, report.html          written by `trainprof analyze`

Writers here are used inside training processes: they import only the standard library, write
whole lines (a killed process leaves at most one torn line; the probes' streams are flushed every
TRAINPROF_FLUSH_S seconds by a background thread, so a kill loses at most that much) and never
raise into the job. Readers
tolerate a torn last line and report every other defect with the file it came from.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
RANKS_DIR = "ranks"
PROFILER_DIR = "profiler"
SUMMARY = "summary.json"
REPORT = "report.html"
INJECTED = "injected.json"  # ground truth of the reference workload; analyzers never read it
META = "meta.json"

# Well-known per-rank streams (ranks/rank-NNNNN/<name>.jsonl). Capability issues add more.
STEPS = "steps"


def rank_dirname(rank: int) -> str:
    return f"rank-{int(rank):05d}"


def rank_dir(run: str | os.PathLike, rank: int) -> Path:
    return Path(run) / RANKS_DIR / rank_dirname(rank)


def profiler_trace_path(run: str | os.PathLike, rank: int) -> Path:
    # HTA reads every *.json(.gz) in one folder and takes the rank from distributedInfo.
    return Path(run) / PROFILER_DIR / f"{rank_dirname(rank)}.pt.trace.json.gz"


# --------------------------------------------------------------------------- writing


try:
    import orjson

    _OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY

    def dumps_compact(obj: Any) -> str:
        """One JSON document on one line (no newline): orjson where installed."""
        # ~10x faster than json on the probes' hot path; NaN/Inf become null (strict JSON)
        return orjson.dumps(obj, default=str, option=_OPTS).decode()
except ImportError:  # a dependency, but writers inside a job must not need it
    def dumps_compact(obj: Any) -> str:
        return json.dumps(obj, separators=(",", ":"), default=str, allow_nan=True)


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write JSON so that readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JsonlWriter:
    """Append-only JSONL stream, safe to use from several threads; never raises into the job.

    Immediate mode (default): each record is one write() of a complete line. Deferred mode (the
    probes' streams): write() only queues the line (a deque append, ~1 µs); flush() — called by
    the session's ticker thread every TRAINPROF_FLUSH_S seconds and at close — appends the queued
    lines with one write(). ``urgent=True`` records (a NaN origin, an OOM) go out at once with
    everything queued before them. Either way a killed process leaves at most one torn line at the
    end, which readers skip; a deferred stream loses at most the last interval's records.
    """

    MAX_QUEUED = 10_000  # lines: past this a write flushes inline (a flusher that fell behind)

    def __init__(self, path: str | os.PathLike, deferred: bool = False):
        self.path = Path(path)
        self.errors = 0
        self.deferred = deferred
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._fd: int | None = None  # opened on the first record: unused streams leave no files
        self._closed = False
        self._finished = False  # set under the lock by close(): flush writes nothing after it

    def write(self, record: dict, urgent: bool = False) -> None:
        if self._closed:
            return
        try:
            self.write_text(dumps_compact(record) + "\n", urgent)
        except Exception:  # noqa: BLE001 - never raise into the training job
            self.errors += 1

    def write_text(self, text: str, urgent: bool = False) -> None:
        """Append complete lines (ending in a newline)."""
        if self._closed:
            return
        self._queue.append(text)  # deque.append/popleft are atomic: no lock on the hot path
        if not self.deferred or urgent or len(self._queue) > self.MAX_QUEUED:
            self.flush(wait=True)

    def write_records(self, records: list) -> None:
        """Queue records to be serialized by whoever flushes (the ticker thread for a deferred
        stream): the job's thread pays a deque append instead of a dumps per record. The
        caller hands the dicts over: it must not change them afterwards."""
        if self._closed or not records:
            return
        self._queue.append(records)
        if not self.deferred or len(self._queue) > self.MAX_QUEUED:
            self.flush(wait=True)

    def flush(self, wait: bool = False) -> None:
        """Write what is queued. ``wait``: also wait for a flush in progress on another thread
        (an urgent record may have been taken by it), so the line is written on return."""
        if not self._queue and not wait:
            return
        with self._lock:
            if self._finished:
                self._queue.clear()  # a write that raced close(): never reopen the file
                return
            parts = []
            try:
                while True:
                    parts.append(self._queue.popleft())
            except IndexError:
                pass
            if not parts:
                return
            try:
                data = "".join(p if type(p) is str else "".join(dumps_compact(r) + "\n" for r in p)
                               for p in parts).encode("utf-8")
                if self._fd is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
            except Exception:  # noqa: BLE001
                self.errors += 1

    def close(self) -> None:
        self.flush()
        self._closed = True
        with self._lock:
            self._finished = True
            self._fd = close_quietly(self._fd)


def close_quietly(fd: int | None) -> None:
    """Close a raw fd, if any, ignoring errors (shutdown paths). Returns None for `x = close_quietly(x)`."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    return None


def collect_rank_entries(run: str | os.PathLike) -> dict:
    """Per-rank facts gathered from ranks/*/meta.json for the manifest: world size, the mesh,
    and for every rank its host, local rank, device name and mesh coordinates."""
    ranks, mesh, world, versions = [], None, None, set()
    for p in sorted((Path(run) / RANKS_DIR).glob("rank-*/" + META)):
        try:
            m = read_json(p)
        except RunDirError:
            continue
        world = world or m.get("world_size")
        mesh = mesh or ({k: m["mesh"].get(k) for k in ("dim_names", "shape")}
                        if m.get("mesh") else None)
        versions.add(m.get("torch_version"))
        ranks.append({"rank": m.get("rank"), "host": m.get("host"), "local_rank": m.get("local_rank"),
                      "pid": m.get("pid"), "device": m.get("device"),
                      "device_name": m.get("device_name"), "coords": m.get("coords") or {}})
    return {"world_size": world, "ranks_seen": len(ranks), "mesh": mesh,
            "torch_version": sorted(v for v in versions if v)[0] if any(versions) else None,
            "ranks": ranks}


# --------------------------------------------------------------------------- reading


SNAPSHOT_SUFFIXES = (".pickle", ".pkl")
NOT_SNAPSHOTS = ("flight-recorder",)  # the hang watchdog's pickles in a rank directory


def _rank_from_name(name: str) -> int | None:
    """rank-00003_x.pickle, rank3.pickle, snapshot_rank_3.pickle -> 3; else None."""
    import re

    m = re.search(r"rank[-_]?(\d+)", name)
    return int(m.group(1)) if m else None


class RunDirError(Exception):
    """A run directory (or a file in it) cannot be read; the message names the file."""


def read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise RunDirError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        return json.loads(data)
    except ValueError as e:
        raise RunDirError(f"{path}: not valid JSON ({e})") from e


def iter_jsonl(path: Path, problems: list[str] | None = None) -> Iterator[dict]:
    """Records of a JSONL stream. A torn last line (a writer killed mid-record) is skipped
    silently; any other bad line is skipped and described in ``problems``."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        if problems is not None:
            problems.append(f"{path}: cannot read: {e.strerror or e}")
        return
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            torn_tail = i == last  # no newline after it: the writer died mid-line
            if not torn_tail and problems is not None:
                problems.append(f"{path}:{i + 1}: malformed JSON line skipped")
            continue
        if isinstance(rec, dict):
            yield rec
        elif problems is not None:
            problems.append(f"{path}:{i + 1}: record is not a JSON object, skipped")


class RunDir:
    """Read-side view of a run directory. Everything is loaded lazily and cached, so all
    analyzers share one parse of each file (profiler traces included)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        # Bare allocator snapshots (torch.cuda.memory._dump_snapshot pickles), given as one file
        # or a folder of them, are analysed as a "run" that holds nothing else.
        self.bare_snapshots: list[Path] = []
        if not self.path.exists():
            raise RunDirError(f"{self.path}: no such directory")
        if self.path.is_file():
            if not self.path.name.endswith(SNAPSHOT_SUFFIXES):
                raise RunDirError(f"{self.path}: not a directory (nor an allocator snapshot "
                                  f"*.pickle written by torch.cuda.memory._dump_snapshot)")
            self.bare_snapshots = [self.path]
            self.path = self.path.parent
        elif not (self.path / MANIFEST).exists() and not (self.path / RANKS_DIR).is_dir() \
                and not (self.path / PROFILER_DIR).is_dir():
            self.bare_snapshots = sorted(p for p in self.path.iterdir()
                                         if p.is_file() and p.name.endswith(SNAPSHOT_SUFFIXES))
            if not self.bare_snapshots:
                raise RunDirError(
                    f"{self.path}: not a trainprof run directory (no {MANIFEST}, {RANKS_DIR}/ or "
                    f"{PROFILER_DIR}/) and no allocator snapshots (*.pickle); create one with "
                    f"`trainprof wrap --out {self.path} -- CMD`")
        self.problems: list[str] = []
        self._cache: dict[str, Any] = {}

    @property
    def snapshot_only(self) -> bool:
        """True when this "run" is bare allocator snapshots (no ranks, streams or traces)."""
        return bool(self.bare_snapshots)

    # -- allocator snapshots
    def snapshot_files(self) -> list[tuple[int | None, Path]]:
        """(rank or None, path) of every allocator snapshot: the bare files, or the ones the
        memory probe wrote into ranks/rank-N/ (memory_snapshot.pickle, oom_snapshot.pickle)."""
        if self.bare_snapshots:
            return [(_rank_from_name(p.name), p) for p in self.bare_snapshots]
        out = []
        for r in self.ranks:
            d = rank_dir(self.path, r)
            if d.is_dir():
                out += [(r, p) for p in sorted(d.iterdir()) if p.name.endswith(SNAPSHOT_SUFFIXES)
                        and not p.name.startswith(NOT_SNAPSHOTS)]
        return out

    def snapshot(self, path: Path):
        """The parsed snapshot (trainprof.snapshot.Snapshot), loaded once with the restricted
        unpickler; None (and a problem naming the file) when it cannot be read."""
        key = f"snapshot:{path}"
        if key not in self._cache:
            from trainprof.snapshot import SnapshotError, load_snapshot

            try:
                self._cache[key] = load_snapshot(path)
            except SnapshotError as e:
                self.problems.append(str(e))
                self._cache[key] = None
        return self._cache[key]

    # -- manifest and ranks
    @property
    def launcher(self) -> dict:
        """manifest.json as the launcher wrote it ({} when missing, e.g. a probe-only run)."""
        if "launcher" not in self._cache:
            p = self.path / MANIFEST
            man: dict = {}
            if p.exists():
                try:
                    man = read_json(p)
                except RunDirError as e:
                    self.problems.append(str(e))
                if not isinstance(man, dict):
                    self.problems.append(f"{p}: expected a JSON object")
                    man = {}
                v = man.get("schema_version")
                if v is not None and v > SCHEMA_VERSION:
                    self.problems.append(
                        f"{p}: schema_version {v} is newer than this trainprof reads "
                        f"({SCHEMA_VERSION}); upgrade trainprof")
            self._cache["launcher"] = man
        return self._cache["launcher"]

    @property
    def ranks(self) -> list[int]:
        if "ranks" not in self._cache:
            if self.bare_snapshots:
                self._cache["ranks"] = []
                return []
            found: set[int] = set()
            rd = self.path / RANKS_DIR
            if rd.is_dir():
                for d in rd.iterdir():
                    if d.is_dir() and d.name.startswith("rank-"):
                        try:
                            found.add(int(d.name[5:]))
                        except ValueError:
                            self.problems.append(f"{d}: unexpected folder name, ignored")
            found.update(self.profiler_traces().keys())
            self._cache["ranks"] = sorted(found)
        return self._cache["ranks"]

    def rank_meta(self, rank: int) -> dict:
        key = f"meta:{rank}"
        if key not in self._cache:
            p = rank_dir(self.path, rank) / META
            meta: dict = {}
            if p.exists():
                try:
                    meta = read_json(p)
                except RunDirError as e:
                    self.problems.append(str(e))
            self._cache[key] = meta if isinstance(meta, dict) else {}
        return self._cache[key]

    @property
    def world_size(self) -> int:
        for r in self.ranks:
            ws = self.rank_meta(r).get("world_size")
            if ws:
                return int(ws)
        return int(self.launcher.get("world_size") or len(self.ranks) or 0)

    @property
    def mesh(self) -> dict:
        """{"dim_names": [...], "shape": [...]} of the job's DeviceMesh ({} when none)."""
        for r in self.ranks:
            m = self.rank_meta(r).get("mesh")
            if m and m.get("dim_names"):
                return {"dim_names": m["dim_names"], "shape": m["shape"]}
        return {}

    def coords(self, rank: int) -> dict:
        """Mesh coordinates of a rank, e.g. {"dp": 1, "pp": 0, "tp": 1} ({} when unknown)."""
        return dict(self.rank_meta(rank).get("coords") or {})

    # -- streams
    def stream_path(self, rank: int, name: str) -> Path:
        return rank_dir(self.path, rank) / f"{name}.jsonl"

    def stream(self, rank: int, name: str) -> list[dict]:
        key = f"stream:{name}:{rank}"
        if key not in self._cache:
            p = self.stream_path(rank, name)
            self._cache[key] = list(iter_jsonl(p, self.problems)) if p.exists() else []
        return self._cache[key]

    def frame(self, name: str):
        """All ranks' records of a stream as one pandas DataFrame with a ``rank`` column."""
        key = f"frame:{name}"
        if key not in self._cache:
            import pandas as pd

            rows = []
            for r in self.ranks:
                for rec in self.stream(r, name):
                    rows.append({"rank": r, **rec})
            self._cache[key] = pd.DataFrame(rows)
        return self._cache[key]

    def collectives(self):
        """The training job's collectives (frame of collectives.jsonl), without those a NaN
        replay issued (``"replay": true``: rerun on saved inputs after a detection; the hang
        post-mortem reads the raw stream, where they stay)."""
        key = "frame:collectives:job"
        if key not in self._cache:
            df = self.frame("collectives")
            if "replay" in df.columns:
                df = df[df["replay"].ne(True)].reset_index(drop=True)
            self._cache[key] = df
        return self._cache[key]

    def steps(self):
        """Per-rank step records: rank, step, start_ns, end_ns, dur_ms, source."""
        return self.frame(STEPS)

    # -- profiler traces
    def profiler_traces(self) -> dict[int, Path]:
        """rank -> trace file. Ranks come from our file names; other names are read for
        distributedInfo.rank by the trace parser (see traces())."""
        if "trace_paths" not in self._cache:
            out: dict[int, Path] = {}
            d = self.path / PROFILER_DIR
            if d.is_dir():
                for p in sorted(d.iterdir()):
                    if not p.name.endswith((".json", ".json.gz")):
                        continue
                    if p.name.startswith("rank-"):
                        try:
                            out[int(p.name[5:10])] = p
                            continue
                        except ValueError:
                            pass
                    self.problems.append(f"{p}: trace file not named rank-NNNNN.*, ignored")
            self._cache["trace_paths"] = out
        return self._cache["trace_paths"]

    def traces(self, progress=None) -> dict:
        """rank -> parsed trace (trainprof.trace.Trace), parsed once, in parallel across ranks."""
        if "traces" not in self._cache:
            from trainprof.trace import load_traces

            traces, errors = load_traces(self.profiler_traces(), progress=progress)
            self.problems.extend(errors)
            self._cache["traces"] = traces
        return self._cache["traces"]
