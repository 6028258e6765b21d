"""The run directory's names and paths, its writers, and the low-level readers of its files.

The names (RUN/manifest.json, ranks/rank-NNNNN/, profiler/, ...) are those of the layout
documented in docs/run-directory.md. Writers here are used inside training processes: they
import only the standard library, write whole lines (a killed process leaves at most one torn
line; the probes' streams are flushed every TRAINPROF_FLUSH_S seconds by a background thread, so
a kill loses at most that much) and never raise into the job. The readers (read_json,
iter_jsonl) read only regular files within the input limits (trainprof/safeio.py), tolerate a
torn last line and report every other defect with the file it came from. trainprof.analysis.run
re-exports all of it; the reader of a whole run directory is RunDir there.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator

from trainprof.rundir import schema as rundir_schema
from trainprof import safeio

SCHEMA_VERSION = 2  # 2: bounded capture (compact tables, rings); 1 still read
MANIFEST = "manifest.json"
RANKS_DIR = "ranks"
PROFILER_DIR = "profiler"
SUMMARY = "summary.json"
REPORT = "report.html"
INJECTED = "injected.json"  # ground truth of the reference workload; analyzers never read it
META = "meta.json"

# Well-known per-rank streams (ranks/rank-NNNNN/<name>.jsonl). Capability issues add more.
STEPS = "steps"
HEARTBEAT = "heartbeat.jsonl"  # rotated to HEARTBEAT_PREV past its size cap (probes/heartbeat.py)
HEARTBEAT_PREV = "heartbeat.prev.jsonl"


def rank_dirname(rank: int) -> str:
    return f"rank-{int(rank):05d}"


def rank_dir(run: str | os.PathLike, rank: int) -> Path:
    return Path(run) / RANKS_DIR / rank_dirname(rank)


def profiler_trace_path(run: str | os.PathLike, rank: int) -> Path:
    # HTA reads every *.json(.gz) in one folder and takes the rank from distributedInfo.
    return Path(run) / PROFILER_DIR / f"{rank_dirname(rank)}.pt.trace.json.gz"


JOB_TRACES_DIR = "job"  # RUN/profiler/job/rank-NNNNN/: links to the traces the job's profiler wrote
HANG_TRIGGER = "hang-trigger.json"  # RUN/: written by the launcher when no rank progressed
HANG_DUMP = "hang-dump.json"  # ranks/rank-N/: each rank's answer (probes/hang_watchdog.py)
FATAL_STACKS = "fatal-stacks.txt"  # ranks/rank-N/: faulthandler's dump (probes/fatal_dump.py)
MAX_FATAL_STACKS_BYTES = 1 << 20
MAX_WORKER_EXITS_BYTES = 64 << 20  # a real one: one line per worker and restart
NOT_SNAPSHOTS = ("flight-recorder",)  # the hang watchdog's pickles in a rank directory
SNAPSHOT_SUFFIXES = (".pickle", ".pkl")  # a bare allocator snapshot
TRACE_SUFFIXES = (".json", ".json.gz")  # a bare profiler trace (trainprof/trace/_discover.py)


def job_trace_dir(run: str | os.PathLike, rank: int) -> Path:
    """Where a rank's links to its job's own profiler traces live (each under the job's name)."""
    return Path(run) / PROFILER_DIR / JOB_TRACES_DIR / rank_dirname(rank)


def is_job_trace_name(name: str) -> bool:
    """A name the probe links a job's trace under: a *.json[.gz] file name, not hidden."""
    return (name.endswith((".json", ".json.gz")) and not name.startswith(".")
            and "/" not in name and "\\" not in name)


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


def _json_bytes(obj: Any, indent: int | None) -> bytes:
    """obj as JSON text and a newline: orjson where it can (json's indented encoder is pure
    Python: seconds for a 1,000-rank summary), the json module for what orjson refuses (integers
    beyond 64 bits); NaN / Inf are written as null either way (strict JSON)."""
    if indent in (None, 2):
        try:
            import orjson

            opts = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
            return orjson.dumps(obj, default=str, option=opts | (orjson.OPT_INDENT_2 if indent else 0))
        except (ImportError, TypeError):  # orjson.JSONEncodeError is a TypeError
            pass
    return (json.dumps(_nan_to_none(obj), indent=indent, default=str) + "\n").encode()


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write JSON so that readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_json_bytes(obj, indent))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a read-only directory: leave no temporary behind
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


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
                self._write_parts(parts)
            except Exception:  # noqa: BLE001
                self.errors += 1

    @staticmethod
    def _encode(parts) -> bytes:
        return "".join(p if type(p) is str else "".join(dumps_compact(r) + "\n" for r in p)
                       for p in parts).encode("utf-8")

    def _write_parts(self, parts) -> None:
        """Append the queued lines (under the lock; an exception counts as an error)."""
        data = self._encode(parts)
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

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
                      "device_name": m.get("device_name"), "coords": m.get("coords") or {},
                      **({"node": m["node"]} if m.get("node") else {})})
    return {"world_size": world, "ranks_seen": len(ranks), "mesh": mesh,
            "torch_version": sorted(v for v in versions if v)[0] if any(versions) else None,
            "ranks": ranks}


# --------------------------------------------------------------------------- reading


class RunDirError(Exception):
    """A run directory (or a file in it) cannot be read; the message names the file."""


class SchemaVersionError(RunDirError):
    """The run directory was written by a newer trainprof (or names no schema version we can
    trust): refused, with the version named."""


MAX_PROBLEMS_PER_FILE = 5  # bad lines listed one by one; past that one line counts the rest


def read_json(path: Path) -> Any:
    """A small JSON document (manifest.json, meta.json, a hang dump): a regular file within
    the input limit (trainprof/safeio.py)."""
    try:
        data = safeio.read_doc(path)
    except safeio.InputRefused as e:
        raise RunDirError(str(e)) from e
    except OSError as e:
        raise RunDirError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise RunDirError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from e


UNREADABLE = object()  # read_json_or_problem's default where a JSON null must differ from a loss


def read_json_or_problem(path: Path, problems: list[str] | None, note: str = "",
                         default: Any = None) -> Any:
    """``read_json(path)``, or ``default`` with the reason (and ``note``) appended to
    ``problems`` when the document cannot be read: for inputs whose loss the analysis states
    and survives."""
    try:
        return read_json(path)
    except RunDirError as e:
        if problems is not None:
            problems.append(f"{e}{note}")
        return default


def iter_jsonl(path: Path, problems: list[str] | None = None,
               stream: str | None = None) -> Iterator[dict]:
    """Records of a JSONL stream. A torn last line (a writer killed mid-record) is skipped
    silently; any other bad line, and (``stream`` named) a record whose fields do not have the
    documented types (trainprof/rundir/schema.py), is skipped and described in ``problems``
    (the first few one by one, then a count)."""
    try:
        data = safeio.read_limited(path, what="stream")
    except OSError as e:
        if problems is not None:
            problems.append(str(e) if isinstance(e, safeio.InputRefused)
                            else f"{path}: cannot read: {e.strerror or e}")
        return
    lines = data.split(b"\n")
    del data
    spec = rundir_schema.STREAMS.get(stream) if stream else None
    required = rundir_schema.REQUIRED.get(stream, ()) if stream else ()
    nested = rundir_schema.STREAM_NESTED.get(stream) if stream else None
    bad = 0

    def report(msg: str) -> None:
        nonlocal bad
        bad += 1
        if problems is not None and bad <= MAX_PROBLEMS_PER_FILE:
            problems.append(msg)

    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            if i != last:  # a torn tail (no newline after it: the writer died mid-line) is silent
                report(f"{path}:{i + 1}: malformed JSON line skipped")
            continue
        if not isinstance(rec, dict):
            report(f"{path}:{i + 1}: record is not a JSON object, skipped")
            continue
        if spec is not None:
            why = rundir_schema.record_error(spec, required, rec, nested)
            if why:
                report(f"{path}:{i + 1}: record skipped: {why}")
                continue
        yield rec
    if bad > MAX_PROBLEMS_PER_FILE and problems is not None:
        problems.append(f"{path}: {bad - MAX_PROBLEMS_PER_FILE} more bad lines skipped "
                        f"({bad} in all)")


def _listdir(d: Path, problems: list[str]) -> list[Path]:
    """Entries of a directory, sorted; [] and one problem when it cannot be listed."""
    try:
        return sorted(d.iterdir())
    except OSError as e:
        problems.append(f"{d}: cannot list: {e.strerror or e}; its files are not analyzed")
        return []


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:
        return False


def _size_mtime(p: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def _exists(p: Path, problems: list[str] | None = None) -> bool:
    """Path.exists() that says "no" (and, given ``problems``, why) instead of raising when a
    parent directory cannot be searched."""
    try:
        os.stat(p)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if problems is not None and not isinstance(e, NotADirectoryError):
            problems.append(f"{p}: cannot read: {e.strerror or e}")
        return False
