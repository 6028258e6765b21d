"""The run directory: the only contract between capture (probes) and analysis (analyzers).

Layout (schema version 1, documented in docs/run-directory.md)::

    RUN/
      manifest.json                      written by the launcher (`trainprof wrap`) at start and end
      ranks/rank-00000/meta.json         written by each rank's probes when they activate
      ranks/rank-00000/<stream>.jsonl    append-only per-rank streams (steps, collectives, ...)
      profiler/rank-00000.pt.trace.json.gz   torch.profiler Chrome traces (HTA-loadable folder)
      digests/rank-00000.json            each trace reduced for job-level analysis (trainprof/digest.py)
      summary.json, report.html          written by `trainprof analyze`

Writers here are used inside training processes: they import only the standard library, write
whole lines (a killed process leaves at most one torn line; the probes' streams are flushed every
TRAINPROF_FLUSH_S seconds by a background thread, so a kill loses at most that much) and never
raise into the job. Readers
tolerate a torn last line and report every other defect with the file it came from; they read
only regular files within the input limits (trainprof/safeio.py), check every record against the
documented field types (trainprof/rundir_schema.py), check the world size against the ranks
present, and refuse a run directory of a newer schema (SchemaVersionError).
"""

from __future__ import annotations

import collections
import json
import math
import os
import stat
import threading
from pathlib import Path
from typing import Any, Iterator

from trainprof import rundir_schema, safeio
SCHEMA_VERSION = 1
MAX_ABSENT_FACTOR, MAX_ABSENT_EXTRA = 4, 64  # a world size is trusted up to 4 x ranks present + 64
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


JOB_TRACES_DIR = "job"  # RUN/profiler/job/rank-NNNNN/: links to the traces the job's profiler wrote


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
                      "device_name": m.get("device_name"), "coords": m.get("coords") or {},
                      **({"node": m["node"]} if m.get("node") else {})})
    return {"world_size": world, "ranks_seen": len(ranks), "mesh": mesh,
            "torch_version": sorted(v for v in versions if v)[0] if any(versions) else None,
            "ranks": ranks}


# --------------------------------------------------------------------------- reading


SNAPSHOT_SUFFIXES = (".pickle", ".pkl")
TRACE_SUFFIXES = (".json", ".json.gz")  # a bare profiler trace (trainprof/trace/_discover.py)
NOT_SNAPSHOTS = ("flight-recorder",)  # the hang watchdog's pickles in a rank directory


def _rank_from_name(name: str) -> int | None:
    """rank-00003_x.pickle, rank3.pickle, snapshot_rank_3.pickle -> 3; else None."""
    import re

    m = re.search(r"rank[-_]?(\d+)", name)
    return int(m.group(1)) if m else None


MAX_WORKER_EXITS_BYTES = 64 << 20  # a real one: one line per worker and restart
FATAL_STACKS = "fatal-stacks.txt"  # probes/fatal_dump.py
MAX_FATAL_STACKS_BYTES = 1 << 20


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


def iter_jsonl(path: Path, problems: list[str] | None = None,
               stream: str | None = None) -> Iterator[dict]:
    """Records of a JSONL stream. A torn last line (a writer killed mid-record) is skipped
    silently; any other bad line, and (``stream`` named) a record whose fields do not have the
    documented types (trainprof/rundir_schema.py), is skipped and described in ``problems``
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


def _below(sub: Path, root: Path) -> str:
    """``sub`` as a path under ``root`` ("lightning_logs/version_0/"), else as it is."""
    try:
        return f"{Path(sub).relative_to(root)}/"
    except ValueError:
        return str(sub)


# what choosing among a job's windows reads of each (kept with the rank's digest)
_WINDOW_FACTS = ("path", "whole_trace_window", "span_ns", "steps", "window")


def _window_facts_ok(facts: dict) -> bool:
    """Window facts kept in a digest have the types choosing among windows reads."""
    w, span = facts.get("window"), facts.get("span_ns")
    return (isinstance(facts.get("path"), str) and isinstance(w, dict)
            and all(type(w.get(k, 0)) is int for k in ("work_steps", "events"))
            and (span is None or (isinstance(span, list) and len(span) == 2
                                  and all(type(x) is int for x in span))))


def _distinct_steps(heads) -> int:
    """How many distinct steps (ProfilerStep numbers) the traces of ``heads`` profiled, each
    step once whatever the number of ranks that hold it; a trace whose step numbers its digest
    does not list counts its own number of steps."""
    nums: set = set()
    counted = 0
    for h in heads:
        steps = (h.doc.get("facts", {}).get("window") or {}).get("steps")
        if isinstance(steps, list):
            nums.update(s for s in steps if isinstance(s, int))
        else:
            counted = max(counted, h.steps)
    return max(len(nums), counted)


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


def _job_candidates(root: Path, rank: int, jp: dict, paths: list[Path],
                    linked: Path | None) -> list[tuple[Path, Path]]:
    """A rank's job traces as (path read, path said: the job's own), each file once. Each is
    read from the run directory where it holds it: ``linked`` (RUN/profiler/rank-NNNNN.*, the
    job's last trace when meta's ``linked`` names it, or the same file), else its link in
    RUN/profiler/job/rank-NNNNN/ (meta's ``links``), else the job's path; so a run directory
    copied elsewhere, or whose job folder was cleaned, reads the same windows. Files met twice
    (hard links, repeats): the last. A ``linked`` that is none of them (the job's files moved,
    meta without ``linked``) is the last, unless it is a copy of one of them (same size and
    mtime: copytree, cp -p)."""
    links = jp.get("links") if isinstance(jp.get("links"), dict) else {}
    last = paths[-1] if paths and linked is not None and jp.get("linked") == linked.name else None
    out: list[tuple[Path, Path]] = []
    for p in paths:
        options = [linked] if linked is not None and (p == last or _same_file(p, linked)) else []
        rel = links.get(str(p))
        parts = rel.split("/") if isinstance(rel, str) else []
        if (len(parts) == 3 and parts[:2] == [JOB_TRACES_DIR, rank_dirname(rank)]
                and is_job_trace_name(parts[2])):
            options.append(job_trace_dir(root, rank) / parts[2])
        read = next((q for q in options + [p] if _is_file(q)), None)
        if read is not None:
            out = [c for c in out if not _same_file(c[0], read)] + [(read, p)]
    if linked is not None and _is_file(linked) and not any(read == linked for read, _ in out):
        sig = _size_mtime(linked)
        if sig is None or all(_size_mtime(read) != sig for read, _ in out):
            out = [c for c in out if not _same_file(c[0], linked)] + [(linked, linked)]
    return out


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


def _host_map(hosts: dict, wanted: set) -> dict[int, str]:
    """{"node001": "8-15,24"} (meta.json ``hosts``) -> {rank: host} for the ranks in wanted."""
    out: dict[int, str] = {}
    for h, spec in hosts.items():
        if not isinstance(spec, str):
            continue
        for part in spec.split(","):
            a, _, b = part.partition("-")
            if a.isdigit() and (not b or b.isdigit()):
                lo, hi = int(a), int(b or a)
                out.update((r, str(h)) for r in wanted if lo <= r <= hi)
    return out


class RunDir:
    """Read-side view of a run directory. Everything is loaded lazily and cached, so all
    analyzers share one parse of each file (profiler traces included)."""

    def __init__(self, path: str | os.PathLike | list | tuple, _preset: dict | None = None):
        # ``_preset``: cache entries known already (trainprof/digest.py's view of one bare trace)
        # several inputs (trace files or folders of traces) are analyzed as one job
        inputs = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
        if not inputs:
            raise RunDirError("no input given")
        self.path = inputs[0]
        # Bare allocator snapshots (torch.cuda.memory._dump_snapshot pickles), given as one file
        # or a folder of them, are analysed as a "run" that holds nothing else.
        self.bare_snapshots: list[Path] = []
        # Bare torch.profiler traces (a folder of them, files, or several of those), analysed as
        # a run that holds only traces (trainprof/trace/_discover.py finds their ranks).
        self.trace_inputs: list[Path] = []
        self.input_facts: dict = {}
        self.problems: list[str] = []
        self._cache: dict[str, Any] = dict(_preset or {})
        self._unreadable: set[int] = set()  # rank folders that cannot be read (said once)
        # several run directories of one job (a per-node --out each) are analyzed as one run:
        # ``roots`` are those directories, ``_rank_roots`` says which one holds a rank's files
        self.roots: list[Path] = [self.path]
        self._rank_roots: dict[int, Path] = {}
        if len(inputs) > 1 and all(_is_dir(p) and (_exists(p / MANIFEST) or _is_dir(p / RANKS_DIR))
                                   for p in inputs):
            self._several_run_dirs(inputs)
        elif len(inputs) > 1:
            self._bare_trace_inputs(inputs)
        else:
            self._classify(self.path)
        self.launcher  # noqa: B018 - read now: a newer schema is refused before any analysis
        self._census()

    def _classify(self, path: Path) -> None:
        from trainprof.trace._discover import is_trace_name

        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise RunDirError(f"{path}: no such directory") from None
        except OSError as e:
            raise RunDirError(f"{path}: cannot read: {e.strerror or e}") from None
        if stat.S_ISREG(mode):
            if not is_trace_name(path.name) and path.name.endswith(TRACE_SUFFIXES):
                raise RunDirError(f"{path}: a run-directory document, not a profiler trace; "
                                  f"analyze the folder it belongs to")
            if path.name.endswith(TRACE_SUFFIXES):
                self._bare_trace_inputs([path])
                return
            if not path.name.endswith(SNAPSHOT_SUFFIXES):
                raise RunDirError(f"{path}: not a directory (nor a profiler trace *.json[.gz] "
                                  f"nor an allocator snapshot *.pickle written by "
                                  f"torch.cuda.memory._dump_snapshot)")
            self.bare_snapshots = [path]
            self.path = path.parent
        elif not stat.S_ISDIR(mode):
            raise RunDirError(f"{path}: not a directory nor a regular file; not read")
        elif not _exists(path / MANIFEST) and not _is_dir(path / RANKS_DIR) \
                and _is_dir(path / PROFILER_DIR):
            # only profiler/: traces copied into the run-directory layout, named any way
            self._bare_trace_inputs([path / PROFILER_DIR])
            self.path = path
        elif not _exists(path / MANIFEST) and not _is_dir(path / RANKS_DIR):
            listed: list[str] = []
            entries = _listdir(path, listed)
            if listed:
                raise RunDirError(listed[0])
            if any(is_trace_name(p.name) and safeio.is_regular(p) for p in entries):
                self._bare_trace_inputs([path])
                snaps = [p for p in entries if p.name.endswith(SNAPSHOT_SUFFIXES)]
                if snaps:
                    self.problems.append(f"{path}: {len(snaps)} allocator snapshot(s) beside the "
                                         f"traces are not analyzed with them; analyze them one by "
                                         f"one (trainprof analyze {snaps[0]})")
                return
            self.bare_snapshots = [p for p in entries
                                   if p.name.endswith(SNAPSHOT_SUFFIXES) and safeio.is_regular(p)]
            if not self.bare_snapshots:
                self._traces_below(path)

    def _traces_below(self, path: Path) -> None:
        """A folder holding nothing trainprof reads: the traces in its subfolders (a bounded
        search, trainprof/trace/_discover.py trace_folders). One folder of them: analyzed, the
        outputs in ``path``, said in a problem line; several: refused, naming them; none:
        refused."""
        from trainprof.trace._discover import SEARCH_DEPTH, trace_folders

        found, cut = trace_folders(path)
        if len(found) == 1:
            self._bare_trace_inputs(found)
            self.path = path
            self.problems.append(
                f"{path}: no profiler trace in the folder itself; analyzed the traces in "
                f"{_below(found[0], path)}, the only subfolder (down to {SEARCH_DEPTH} levels) "
                f"that holds any")
            return
        if found:
            shown = ", ".join(_below(f, path) for f in found[:6]) + (", …" if len(found) > 6 else "")
            raise RunDirError(
                f"{path}: no profiler trace in the folder itself; traces found in {len(found)} "
                f"subfolders: {shown}; analyze one at a time (trainprof analyze {found[-1]}), or "
                f"name the ones of one job together")
        searched = (f"nor in its subfolders (down to {SEARCH_DEPTH} levels"
                    f"{'; the search stopped at its bound' if cut else ''})")
        raise RunDirError(
            f"{path}: not a trainprof run directory (no {MANIFEST}, {RANKS_DIR}/ or "
            f"{PROFILER_DIR}/), no profiler traces (*.json, *.json.gz) {searched} and no "
            f"allocator snapshots (*.pickle); create one with `trainprof wrap --out {path} -- CMD`")

    def _several_run_dirs(self, dirs: list[Path]) -> None:
        """Run directories of one job, each holding some of its ranks (one per node): refused
        when they are the same directory twice, or name different jobs (manifest.json
        ``job_id``) or world sizes; ranks found in two of them are refused in ``ranks``."""
        seen: dict[str, Path] = {}
        for d in dirs:
            key = os.path.realpath(d)
            if key in seen:
                raise RunDirError(f"{d}: given twice (also as {seen[key]})")
            seen[key] = d
        self.roots = list(dirs)
        jobs: dict[str, list[str]] = {}
        worlds: dict[int, list[str]] = {}
        for d in dirs:
            p = d / MANIFEST
            try:
                man = read_json(p) if _exists(p) else {}
            except RunDirError:
                man = {}
            if not isinstance(man, dict):
                continue
            if isinstance(man.get("job_id"), str):
                jobs.setdefault(man["job_id"], []).append(str(p))
            if type(man.get("world_size")) is int:
                worlds.setdefault(man["world_size"], []).append(str(p))
        for what, claims in (("jobs", jobs), ("world sizes", worlds)):
            if len(claims) > 1:
                said = "; ".join(f"{', '.join(files)}: {v!r}" for v, files in claims.items())
                raise RunDirError(f"these run directories are of different {what} ({said}); "
                                  f"analyze together only the directories of one job")

    def rank_path(self, rank: int) -> Path:
        """ranks/rank-N of the run directory that holds the rank (several with per-node dirs)."""
        return rank_dir(self._rank_roots.get(rank, self.path), rank)

    def _bare_trace_inputs(self, inputs: list[Path]) -> None:
        for p in inputs:
            try:
                mode = os.stat(p).st_mode
            except OSError as e:
                raise RunDirError(f"{p}: cannot read: {e.strerror or e}") from None
            if stat.S_ISDIR(mode) and (_exists(p / MANIFEST) or _is_dir(p / RANKS_DIR)):
                raise RunDirError(f"{p}: a trainprof run directory cannot be analyzed together "
                                  f"with other inputs; analyze it alone")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise RunDirError(f"{p}: not a directory nor a regular file; not read")
        self.trace_inputs = inputs
        dirs = [p if p.is_dir() else p.parent for p in inputs]
        self.path = dirs[0] if len(set(dirs)) == 1 else Path(os.path.commonpath(
            [os.path.abspath(d) for d in dirs]))

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
            d = self.rank_path(r)
            if _is_dir(d):
                out += [(r, p) for p in _listdir(d, self.problems)
                        if p.name.endswith(SNAPSHOT_SUFFIXES) and not p.name.startswith(NOT_SNAPSHOTS)]
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
        """manifest.json as the launcher wrote it ({} when missing, e.g. a probe-only run), its
        wrongly typed fields dropped (each a problem). A newer schema_version, or one that is not
        a version number, raises SchemaVersionError."""
        if "launcher" not in self._cache:
            p = self.path / MANIFEST
            man: dict = {}
            if not self.bare_snapshots and not self.trace_inputs and _exists(p, self.problems):
                try:
                    raw = read_json(p)
                except RunDirError as e:
                    self.problems.append(str(e))
                    raw = {}
                if not isinstance(raw, dict):
                    self.problems.append(f"{p}: expected a JSON object, not {type(raw).__name__}; ignored")
                    raw = {}
                if raw.get("schema_version") is not None:
                    raw = dict(raw, schema_version=self._schema_version(p, raw["schema_version"]))
                man = rundir_schema.clean_object(rundir_schema.MANIFEST, raw, str(p), self.problems,
                                                 rundir_schema.MANIFEST_NESTED)
            if not self.bare_snapshots and not self.trace_inputs:
                man = self._merge_nodes(man)
            self._cache["launcher"] = man
        return self._cache["launcher"]

    def _merge_nodes(self, man: dict) -> dict:
        """The launcher records of every node (RUN/nodes/*.json of each run directory; with
        several run directories, the manifest.json of one without node records stands for its
        node) merged over the first manifest (trainprof/nodes.py merge)."""
        from trainprof import nodes

        def clean(rec, where):
            return rundir_schema.clean_object(rundir_schema.NODE, rec, where, self.problems,
                                              rundir_schema.MANIFEST_NESTED)

        several = len(self.roots) > 1
        records = []
        for i, root in enumerate(self.roots):
            recs = nodes.read_records(root, self.problems, clean)
            for r in recs:
                r["_file"] = str(root / r["_file"]) if several else r["_file"]
            if not recs and several:
                other = man if i == 0 else self._other_manifest(root / MANIFEST)
                if other:
                    recs = [dict(other, _file=str(root / MANIFEST),
                                 ranks=[e["rank"] for e in other.get("ranks") or []
                                        if isinstance(e, dict) and type(e.get("rank")) is int])]
            records += recs
        return nodes.merge(man, records)

    def _other_manifest(self, p: Path) -> dict:
        """manifest.json of another run directory of the job (several run directories)."""
        if not _exists(p, self.problems):
            return {}
        try:
            raw = read_json(p)
        except RunDirError as e:
            self.problems.append(str(e))
            return {}
        if not isinstance(raw, dict):
            return {}
        if raw.get("schema_version") is not None:
            raw = dict(raw, schema_version=self._schema_version(p, raw["schema_version"]))
        return rundir_schema.clean_object(rundir_schema.MANIFEST, raw, str(p), self.problems,
                                          rundir_schema.MANIFEST_NESTED)

    def _schema_version(self, p: Path, v) -> int:
        if type(v) is str and v.strip().isdigit() and len(v.strip()) < 10:
            self.problems.append(f'{p}: "schema_version" is the string {v!r}, read as {int(v)}')
            v = int(v)
        if type(v) is not int or v < 1:
            raise SchemaVersionError(
                f"{p}: schema_version {str(v)[:40]!r} is not a version number; this trainprof "
                f"reads run directories of schema version {SCHEMA_VERSION}: refused")
        if v > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{p}: schema_version {v} is newer than this trainprof reads ({SCHEMA_VERSION}); "
                f"upgrade trainprof to analyze it: refused")
        return v

    @property
    def ranks(self) -> list[int]:
        """Ranks with files: a readable ranks/rank-N directory or a profiler trace."""
        if "ranks" not in self._cache:
            if self.bare_snapshots:
                self._cache["ranks"] = []
                self._cache["rank_dirs"] = set()
                return []
            found: set[int] = set()
            for root in self.roots if not self.trace_inputs else ():
                self._rank_dirs_of(root, found)
            self._cache["rank_dirs"] = set(found)
            found.update(self.profiler_traces().keys())
            self._cache["ranks"] = sorted(found)
        return self._cache["ranks"]

    def _rank_dirs_of(self, root: Path, found: set[int]) -> None:
        """Add the readable ranks/rank-N folders of one run directory to ``found``; a rank
        already found in another run directory is refused (RunDirError naming both)."""
        rd = root / RANKS_DIR
        if not _is_dir(rd):
            return
        for d in _listdir(rd, self.problems):
            if not d.name.startswith("rank-") or not _is_dir(d):
                continue
            num = d.name[5:]
            if not (num.isdigit() and len(num) <= 9):
                self.problems.append(f"{d}: unexpected folder name, ignored")
                continue
            if not os.access(d, os.R_OK | os.X_OK):
                self.problems.append(f"{d}: cannot read (permission denied); rank "
                                     f"{int(num)}'s files are not analyzed")
                self._unreadable.add(int(num))
                continue
            if int(num) in found and len(self.roots) > 1:
                raise RunDirError(f"rank {int(num)} is in two run directories: "
                                  f"{self.rank_path(int(num))} and {d}; analyze together "
                                  f"only run directories holding different ranks")
            found.add(int(num))
            if len(self.roots) > 1:
                self._rank_roots[int(num)] = root

    def rank_meta(self, rank: int) -> dict:
        """ranks/rank-N/meta.json ({} when missing), its wrongly typed fields dropped (each a
        problem naming the file and the field)."""
        key = f"meta:{rank}"
        if key not in self._cache and self.trace_inputs:
            self._cache[key] = self._trace_meta(rank)
        if key not in self._cache:
            p = self.rank_path(rank) / META
            meta: dict = {}
            if _exists(p, self._problems_of(rank)):
                try:
                    raw = read_json(p)
                except RunDirError as e:
                    self.problems.append(str(e))
                    raw = {}
                if isinstance(raw, dict):
                    meta = rundir_schema.clean_object(rundir_schema.META, raw, str(p), self.problems,
                                                      rundir_schema.META_NESTED)
                else:
                    self.problems.append(f"{p}: expected a JSON object, not {type(raw).__name__}; ignored")
                if meta.get("rank") is not None and meta["rank"] != rank:
                    self.problems.append(f"{p}: says rank {meta['rank']} but lives in "
                                         f"{rank_dirname(rank)}; the folder's rank is used")
            self._cache[key] = meta
        return self._cache[key]

    # -- world size and completeness
    def _census(self) -> dict:
        """World size checked against the ranks present, and the ranks missing. A world size
        is taken from the files (each rank's meta.json, the manifest) only when they agree with
        each other and with the ranks present; it is never trusted beyond 4x the ranks present
        + 64 (a loop bound for the analyses). One problem line per inconsistency."""
        if "census" in self._cache:
            return self._cache["census"]
        ranks = self.ranks
        claims: dict[int, list[str]] = {}
        for r in ranks:
            ws = self.rank_meta(r).get("world_size")
            if ws is not None:
                claims.setdefault(ws, []).append(self._meta_source(r))
        ws = self.launcher.get("world_size")
        if ws is not None:
            claims.setdefault(ws, []).append(MANIFEST)
        declared = None
        if claims:
            declared = max(claims, key=lambda w: (len(claims[w]), -w))
            if len(claims) > 1:
                said = "; ".join(f"{', '.join(srcs[:2])}{' …' if len(srcs) > 2 else ''} say {w}"
                                 for w, srcs in sorted(claims.items(), key=lambda kv: -len(kv[1])))
                self.problems.append(f"{self.path}: the files disagree on the world size ({said}); "
                                     f"using {declared}")
        n = len(ranks)
        top = (max(ranks) + 1) if ranks else 0
        bound = MAX_ABSENT_FACTOR * n + MAX_ABSENT_EXTRA
        if declared is not None and top > declared:
            self.problems.append(f"{self.path}: rank {top - 1} has files but the world size is "
                                 f"{declared}; using {top}")
            declared = top
        if declared is not None and declared > bound:
            self.problems.append(
                f"{self.path}: world size {declared} but only {n} rank(s) have files: not trusted "
                f"(at most {bound} for {n} rank(s) present); analyzing the ranks present, "
                f"job-level figures are partial")
            world = top if top <= bound else n
        else:
            world = declared if declared is not None else n
        have = (self._cache.get("rank_dirs", set()) if not self.trace_inputs
                and any(_is_dir(root / RANKS_DIR) for root in self.roots) else set(ranks))
        # without a declared world size nothing says which ranks should be there
        missing = [r for r in range(world) if r not in have] if declared is not None else []
        absent = max(0, (declared or 0) - world) + len(missing)
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (", …" if len(missing) > 10 else "")
            where = ("no trace" if self.trace_inputs else f"{RANKS_DIR}/{rank_dirname(missing[0])}"
                     f"{' …' if len(missing) > 1 else ''} missing")
            self.problems.append(
                f"{self.path}: world size {world}, {world - len(missing)} rank(s) present; "
                f"missing: {self._missing_where(missing, have)} — {len(missing)} of {world} "
                f"rank(s) have no readable files ({where}): rank(s) {shown}; job-level figures "
                f"that need every rank (step time, MFU, pipeline bubble, ...) are partial or withheld")
        shape = self.mesh.get("shape") or []
        if shape and declared is not None and math.prod(shape) != declared:
            self.problems.append(f"{self.path}: the DeviceMesh {shape} holds {math.prod(shape)} "
                                 f"ranks but the world size is {declared}")
        self._cache["census"] = {"world_size": world, "declared": declared, "missing": missing,
                                 "absent": absent}
        return self._cache["census"]

    def _missing_where(self, missing: list[int], have) -> str:
        """"8–15 (host node001), 40 (host unknown)": missing ranks as compact ranges with the
        host each ran on, where known: from the torchrun agents' worker-exits.jsonl, else from
        a present rank of the same node (torchrun numbers each node's ranks contiguously:
        rank // local world size), else from the only node record without ranks."""
        from trainprof.rankranges import ranges

        host: dict[int, str] = {}
        try:
            from trainprof.worker_exits import summarize

            for r, row in summarize(self.worker_exits()).get("workers", {}).items():
                if row.get("host") and row["host"] != "None":
                    host[r] = row["host"]
        except Exception:  # noqa: BLE001 - a hint only
            pass
        local_ws, by_group, mapped = None, {}, False
        present = sorted(have)[:4096]  # a bounded sample is enough to place whole nodes
        for r in present:
            meta = self.rank_meta(r)
            if isinstance(meta.get("hosts"), dict) and not mapped:  # probes/hostmap.py
                mapped = True
                for k, h in _host_map(meta["hosts"], set(missing)).items():
                    host.setdefault(k, h)
            env = meta.get("env") if isinstance(meta.get("env"), dict) else {}
            lws = env.get("LOCAL_WORLD_SIZE")
            if local_ws is None and isinstance(lws, str) and lws.isdigit() and int(lws) > 0:
                local_ws = int(lws)
            if local_ws and meta.get("host"):
                by_group.setdefault(r // local_ws, meta["host"])
        nodes_without = [n.get("host") for n in self.launcher.get("nodes") or []
                         if not n.get("ranks") and n.get("host")]
        groups: dict[str, list[int]] = {}
        for r in missing:
            h = host.get(r) or (by_group.get(r // local_ws) if local_ws else None) \
                or (nodes_without[0] if len(nodes_without) == 1 else None)
            groups.setdefault(h or "unknown", []).append(r)
        parts = [(min(rs), ranges(rs, "–") + (f" (host {h})" if h != "unknown" else ""))
                 for h, rs in groups.items()]
        text = ", ".join(t for _, t in sorted(parts))
        return text if len(text) < 600 else text[:600] + " …"

    def _meta_source(self, rank: int) -> str:
        """Where a rank's facts come from, for problem lines."""
        if self.trace_inputs:
            p = self.profiler_traces().get(rank)
            return p.name if p else f"rank {rank}'s trace"
        return f"{RANKS_DIR}/{rank_dirname(rank)}/{META}"

    @property
    def world_size(self) -> int:
        """The job's world size as far as the files can be trusted (see _census)."""
        return self._census()["world_size"]

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of the job without readable files (rank directory absent or unreadable)."""
        return list(self._census()["missing"])

    def partial(self) -> dict | None:
        """None when every rank of the job has files; else what job-level figures should say:
        {"world_size", "ranks_present", "missing_ranks" (first 50), "missing_count"}."""
        c = self._census()
        if not c["absent"]:
            return None
        return {"world_size": max(c["declared"] or 0, c["world_size"]),
                "ranks_present": len(self.ranks), "missing_ranks": c["missing"][:50],
                "missing_count": c["absent"]}

    def profiled(self) -> dict | None:
        """Which ranks recorded the profiler window, as each rank decided by --profile-ranks
        (meta.json ``profiled``, ``profile_policy``, ``profile_ranks``): {"count", "of" (the
        world size), "ranks" (the first 256), "ranges", "policy", "spec", "not_profiled" (ranks
        that skipped it on purpose), "text"}; None when no rank recorded a decision."""
        yes, no, policies, specs = [], 0, collections.Counter(), collections.Counter()
        for r in self.ranks:
            m = self.rank_meta(r)
            if m.get("profiled") is None:
                continue
            if m["profiled"]:
                yes.append(r)
            else:
                no += 1
            policies[m.get("profile_policy") or "?"] += 1
            specs[m.get("profile_ranks") or "?"] += 1
        if not yes and not no:
            return None
        from trainprof.rankranges import ranges

        policy = policies.most_common(1)[0][0]
        return {"count": len(yes), "of": self.world_size, "ranks": yes[:256],
                "ranges": ranges(yes), "policy": policy, "spec": specs.most_common(1)[0][0],
                "not_profiled": no,
                "text": f"{len(yes)} of {self.world_size} rank{'s' * (self.world_size != 1)} "
                        f"profiled (policy {policy})"}

    @property
    def mesh(self) -> dict:
        """{"dim_names": [...], "shape": [...]} of the job's DeviceMesh ({} when none)."""
        for r in self.ranks:
            m = self.rank_meta(r).get("mesh")
            if m and m.get("dim_names"):
                return {"dim_names": m["dim_names"], "shape": m["shape"]}
        return {}

    def coords(self, rank: int) -> dict:
        """Mesh coordinates of a rank, e.g. {"dp": 1, "pp": 0, "tp": 1} ({} when unknown);
        without a DeviceMesh, from its labelled process groups (plain DDP: {"dp": i})."""
        got = self.rank_meta(rank).get("coords")
        if got or self.trace_inputs:
            return dict(got or {})
        from trainprof.meshinfo import group_coords

        return group_coords(self.stream(rank, "groups"), rank)

    def hang_dump(self, path: Path):
        """A hang dump (ranks/rank-N/hang-dump.json) with its wrongly typed fields dropped (each
        a problem); RunDirError when it cannot be read; a non-object is returned as it is."""
        doc = read_json(path)
        if not isinstance(doc, dict):
            return doc
        return rundir_schema.clean_object(rundir_schema.HANG_DUMP, doc, str(path), self.problems,
                                          rundir_schema.HANG_DUMP_NESTED)

    def fatal_stacks(self, rank: int) -> str | None:
        """ranks/rank-N/fatal-stacks.txt (probes/fatal_dump.py: faulthandler's dump of a rank
        killed by a fatal signal), or None when absent; past MAX_FATAL_STACKS_BYTES its header
        line and its last bytes (the newest dump), with a problem."""
        p = self.rank_path(rank) / FATAL_STACKS
        if not _exists(p, self._problems_of(rank)):
            return None
        try:
            fd, size = safeio.open_regular(p)
        except (OSError, safeio.InputRefused) as e:
            self.problems.append(f"{p}: {e}" if str(p) not in str(e) else str(e))
            return None
        with open(fd, "rb") as f:
            if size <= MAX_FATAL_STACKS_BYTES:
                data = f.read(MAX_FATAL_STACKS_BYTES)
            else:
                head = f.readline(1024)
                f.seek(size - MAX_FATAL_STACKS_BYTES)
                data = head + f.read(MAX_FATAL_STACKS_BYTES)
                self.problems.append(f"{p}: {size} bytes, over the {MAX_FATAL_STACKS_BYTES} read; "
                                     "its last bytes used")
        return data.decode("utf-8", "replace")

    def worker_exits(self) -> list[dict]:
        """The records of RUN/worker-exits.jsonl (how the launcher's workers ended); [] when it
        is absent, not a regular file or too large (each a problem)."""
        from trainprof.worker_exits import STREAM

        out: list[dict] = []
        for p in [root / STREAM for root in self.roots]:
            try:
                st = os.stat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                self.problems.append(f"{p}: not a regular file, ignored")
                continue
            if st.st_size > MAX_WORKER_EXITS_BYTES:
                self.problems.append(f"{p}: {st.st_size} bytes, over the {MAX_WORKER_EXITS_BYTES} "
                                     "read; ignored")
                continue
            out += iter_jsonl(p, self.problems)
        return out

    def rank_file(self, rank: int, name: str) -> Path | None:
        """ranks/rank-N/NAME if it exists (None also when it cannot be checked, with a problem)."""
        p = self.rank_path(rank) / name
        return p if _exists(p, self._problems_of(rank)) else None

    def _problems_of(self, rank: int) -> list[str] | None:
        """Where to say that a rank's file cannot be checked: nowhere when its whole folder
        was already said to be unreadable."""
        return None if rank in self._unreadable else self.problems

    # -- streams
    def stream_path(self, rank: int, name: str) -> Path:
        return self.rank_path(rank) / f"{name}.jsonl"

    def stream(self, rank: int, name: str) -> list[dict]:
        """A rank's records of a stream, checked against the documented field types (bad
        records skipped, each a problem with file and line)."""
        key = f"stream:{name}:{rank}"
        if key not in self._cache:
            from trainprof.rundir_streams import read_records

            p = self.stream_path(rank, name)
            self._cache[key] = (read_records(p, self.problems, name,
                                             self._cache.setdefault("shared_lists", {}))
                                if _exists(p, self._problems_of(rank)) else [])
        return self._cache[key]

    def frame(self, name: str):
        """All ranks' records of a stream as one pandas DataFrame with a ``rank`` column (built
        column by column, without keeping every rank's records: trainprof/rundir_streams.py).
        Without any rank directory (bare traces, allocator snapshots) no stream exists: an
        empty stand-in (rundir_streams.NO_RECORDS) that answers ``.empty`` without pandas."""
        key = f"frame:{name}"
        if key not in self._cache:
            from trainprof import rundir_streams

            self._cache[key] = (rundir_streams.build_frame(self, name) if self._has_rank_dirs()
                                else rundir_streams.NO_RECORDS)
        return self._cache[key]

    def _has_rank_dirs(self) -> bool:
        """Whether any rank has a readable ranks/rank-N folder (where its streams live)."""
        self.ranks  # noqa: B018 - finds the rank folders
        return bool(self._cache.get("rank_dirs"))

    def stream_once(self, rank: int, name: str) -> list[dict]:
        """stream(), without keeping the records for other readers: for a stream one analyzer
        reads (at 1,000 ranks every rank's records held at once cost hundreds of MB)."""
        key = f"stream:{name}:{rank}"
        if key in self._cache:
            return self._cache[key]
        from trainprof.rundir_streams import read_records

        p = self.stream_path(rank, name)
        return read_records(p, self.problems, name, self._cache.setdefault("shared_lists", {})) \
            if _exists(p, self._problems_of(rank)) else []

    def stream_tail(self, rank: int, name: str) -> dict | None:
        """A rank's last record of a stream (None when it has none), without caching the
        whole stream when only its frame was read."""
        key = f"stream:{name}:{rank}"
        if key in self._cache or f"frame:{name}" not in self._cache:
            recs = self.stream(rank, name)
            return recs[-1] if recs else None
        return self._cache.get("tails:" + name, {}).get(rank)

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
        if "trace_paths" not in self._cache and self.trace_inputs:
            self._load_bare_traces()
        if "trace_paths" not in self._cache:
            out: dict[int, Path] = {}
            for d in [root / PROFILER_DIR for root in self.roots]:
                if not _is_dir(d):
                    continue
                for p in _listdir(d, self.problems):
                    if not p.name.endswith((".json", ".json.gz")):
                        continue
                    if p.name.startswith("rank-"):
                        try:
                            r = int(p.name[5:10])
                        except ValueError:
                            r = None
                        if r is not None and r in out and out[r].parent != p.parent:
                            raise RunDirError(f"rank {r} has a trace in two run directories: "
                                              f"{out[r]} and {p}; analyze together only run "
                                              f"directories holding different ranks")
                        if r is not None:
                            out[r] = p
                            continue
                    self.problems.append(f"{p}: trace file not named rank-NNNNN.*, ignored")
            self._job_traces(out)
            self._cache["trace_paths"] = out
        return self._cache["trace_paths"]

    def _job_traces(self, out: dict[int, Path]) -> None:
        """Ranks whose job ran its own profiler (meta.json ``job_profiler``): where trainprof
        has no trace of its own, the job's exported traces stand in (read from their links in
        RUN/profiler/ where the run directory holds them, else where the job wrote them: those
        still there, _job_candidates); said in problems. Of several, the window that holds the
        most training is analyzed, chosen as among bare traces (_choose_job_windows)."""
        said: dict[str, list[int]] = {}
        several: dict[int, list[tuple[Path, Path]]] = {}
        self._cache["job_windows"] = {}
        for m in sorted(m for root in self.roots for m in (root / RANKS_DIR).glob(f"rank-*/{META}")):
            try:
                r = int(m.parent.name[5:])
            except ValueError:
                continue
            jp = self.rank_meta(r).get("job_profiler")
            if not isinstance(jp, dict) or (r in out and not jp.get("window_skipped")):
                continue
            paths = [Path(p) for p in jp.get("traces") or []
                     if isinstance(p, str) and p.endswith((".json", ".json.gz"))]
            # (path read, path said): the copies the run directory holds read first
            cands = _job_candidates(m.parent.parent.parent, r, jp, paths, out.get(r))
            if cands:
                out[r] = cands[-1][0]
                self._cache["job_windows"][r] = []
            if len(cands) > 1:
                several[r] = cands
            where = (f"its traces are at {paths[-1].parent}" + ("" if r in out else " (not found: "
                     "no profiler analysis)") if paths else "it exported no trace: no profiler analysis")
            skipped = "trainprof's window skipped; " if jp.get("window_skipped") else ""
            said.setdefault(f"job runs its own profiler: {skipped}{where}", []).append(r)
        for msg, ranks in said.items():
            self.problems.append(f"{msg} (ranks {', '.join(map(str, ranks[:8]))}"
                                 f"{', …' if len(ranks) > 8 else ''})")
        if several:
            self._choose_job_windows(out, several)

    def _choose_job_windows(self, out: dict[int, Path], several: dict) -> None:
        """Ranks with several of the job's traces (torch writes one per cycle of a schedule, and
        a last, cut off one when the profiler stops before its cycle ends): the window that
        holds the most training is analyzed (trainprof/trace/_discover.py choose_window, its
        trailing stub steps dropped), a problem line naming those left out. What each window
        holds is read from the rank's digest when it lists those very files (same path, size
        and mtime), else parsed (in the digest pool, no analyzer run) and kept with the digest
        (trainprof/digest.py ensure)."""
        from trainprof import digest
        from trainprof.trace import _discover as disc

        known: dict[tuple[int, Path], dict] = {}
        stamps: dict[tuple[int, Path], dict] = {}
        todo = []
        for r, cands in sorted(several.items()):
            root = digest.digest_root(self, r, out[r])
            cached = self._cached_windows(digest.digest_path(root, r))
            for p, _ in cands:
                try:
                    stamp = digest.trace_stamp(root, p)
                except OSError:
                    continue
                stamps[r, p] = stamp
                hit = next((w for w in cached if w["trace"] == stamp), None)
                if hit is not None:
                    known[r, p] = hit["facts"]
                else:
                    todo.append(("window", None, r, str(p), stamp, None, [], 1))
        for (key, doc, err), job in zip(digest.run_jobs(todo), todo):
            if err:
                self.problems.append(err)
            else:
                known[job[2], Path(key)] = {k: doc["facts"][k] for k in _WINDOW_FACTS
                                            if k in doc["facts"]}
        for r, cands in sorted(several.items()):
            heads, link = [], {}
            for p, shown in cands:
                facts = known.get((r, p))
                if facts is None:
                    continue
                # named as the job named it (the trace linked into RUN/profiler/ too)
                heads.append(digest.TraceHead({"rank": r, "facts": {**facts, "path": str(shown)}}))
                link[shown] = p
            if not heads:
                continue
            best = disc.choose_window(f"rank {r}", heads, self.problems)
            out[r] = link[best.path]
            self._cache["job_windows"][r] = [
                {"trace": stamps[r, p], "facts": known[r, p]} for p, _ in cands if (r, p) in known]

    def _cached_windows(self, path: Path) -> list[dict]:
        """The windows a rank's cached digest lists (``windows``: what each of the job's traces
        holds), when the digest is of this code; [] otherwise."""
        from trainprof import digest

        try:
            os.stat(path)
            doc = read_json(path)
        except (OSError, RunDirError):
            return []
        if not isinstance(doc, dict) or doc.get("code") != digest.code_fingerprint():
            return []
        ws = doc.get("windows")
        if not isinstance(ws, list):
            return []
        return [w for w in ws if isinstance(w, dict) and isinstance(w.get("trace"), dict)
                and isinstance(w.get("facts"), dict) and _window_facts_ok(w["facts"])]

    def job_windows(self) -> dict[int, list[dict]]:
        """Ranks whose trace the job's own profiler wrote -> what each of its windows holds
        ([{"trace": stamp, "facts": ...}]; [] when there was one window only)."""
        self.profiler_traces()
        return self._cache.get("job_windows", {})

    def traces(self, progress=None) -> dict:
        """rank -> parsed trace (trainprof.trace.Trace), parsed once, in parallel across ranks.
        Every trace stays in memory: for per-rank detail only. Job-level analysis reads
        trace_digests(), which needs one trace in memory at a time."""
        paths = self.profiler_traces()
        if "traces" not in self._cache:
            from trainprof.trace import load_traces

            traces, errors = load_traces(paths, progress=progress)
            self.problems.extend(errors)
            from trainprof.trace._discover import prepare_window

            if self.trace_inputs:  # a bare trace is the rank its discovery gave it
                for r, t in traces.items():
                    t.rank = r
                    prepare_window(t)  # stub steps dropped as in its digest (said there)
            else:
                for r in self.job_windows():  # the job's own traces: as bare traces
                    if r in traces:
                        prepare_window(traces[r])
            self._cache["traces"] = traces
        self._say_trace_facts([(r, t.path, t.stats.get("gpu_ops_without_launch"),
                                t.meta.get("whole_trace_window"), t.meta.get("span_ns"))
                               for r, t in sorted(self._cache["traces"].items())])
        return self._cache["traces"]

    def _say_trace_facts(self, facts: list[tuple]) -> None:
        """Problems about how the traces were read, once: (rank, path, GPU ops without a launch,
        whole-trace window, span) of each (from the parsed traces or from their digests)."""
        if "traces_said" in self._cache:
            return
        self._cache["traces_said"] = True
        for r, path, n, whole, span in facts:
            if n:
                self.problems.append(
                    f"{path}: {n} GPU op(s) have no launching runtime call in the trace "
                    f"(queued before recording started): left out of the step windows")
            if whole:
                span = span or [0, 0]
                self.problems.append(
                    f"{path}: no ProfilerStep in the trace (torch.profiler used without "
                    f"schedule/step()): rank {r} analyzed as one window covering the whole "
                    f"trace ({(span[1] - span[0]) / 1e6:.3f} ms), not per step")

    def trace_digests(self, name: str) -> dict[int, dict]:
        """rank -> the per-rank digest section ``name`` of that rank's profiler trace: what the
        analyzer ``name`` computes from one trace alone (its module's ``trace_digest(run, rank,
        trace) -> dict``, small and JSON-able). Job-level analysis reads these, never the traces
        themselves, so that it needs one trace in memory at a time (digest_docs). A rank whose
        section failed is left out, with a problem; when it failed on every rank, RunDirError."""
        key = ("digest", name)
        if key not in self._cache:
            out, failed = {}, []
            for r, doc in self.digest_docs(extra=name).items():
                sec = doc["sections"].get(name) or {}
                if isinstance(sec.get("data"), dict):
                    out[r] = sec["data"]
                else:
                    failed.append((r, sec.get("error") or "not computed"))
            if failed:
                shown = ", ".join(str(r) for r, _ in failed[:8]) + (", …" if len(failed) > 8 else "")
                self.problems.append(f"{name}: the reduction of the profiler trace failed on rank(s) "
                                     f"{shown} ({failed[0][1]}); left out of its figures")
                if not out:
                    raise RunDirError(f"{name}: trace_digest failed on every rank: {failed[0][1]}")
            self._cache[key] = out
        return self._cache[key]

    def digest_docs(self, progress=None, extra: str | None = None,
                    write: bool = False) -> dict[int, dict]:
        """rank -> the whole digest of its profiler trace (trainprof/digest.py): read from
        RUN/digests/ when current, else built in a process pool, one trace per worker at a
        time, and (``write``: what `trainprof analyze` does when its outputs go into the run
        directory) cached there; bare trace inputs are never written beside.
        ``extra``: an analyzer whose section is wanted besides ANALYZER_MODULES' ones."""
        from trainprof import digest

        self.profiler_traces()  # bare traces are digested while their ranks are found
        names = digest.section_names()
        if extra and extra not in names:
            names.append(extra)
        docs = self._cache.get("digest_docs")
        if docs is None or any(n not in d["sections"] for d in docs.values() for n in names):
            docs, _ = digest.ensure(self, names, progress=progress, write=write)
            self._cache["digest_docs"] = docs
        self._say_trace_facts([(r, d["facts"]["path"], d["facts"].get("gpu_ops_without_launch"),
                                d["facts"].get("whole_trace_window"), d["facts"].get("span_ns"))
                               for r, d in sorted(docs.items())])
        return docs

    # -- bare profiler traces (no run directory)
    def _load_bare_traces(self) -> None:
        """Digest every trace among the inputs (in a process pool, one trace per worker at a
        time, nothing written), keep one job and the window of each of its processes that holds
        the most training, and key them by rank (trainprof/trace/_discover.py); what was found
        and read goes to ``input_facts``. JSON files that are not traces are said once; inputs
        with no trace at all, or traces of several jobs given as several inputs, are refused."""
        from trainprof import digest
        from trainprof.trace import _discover as disc

        files = disc.candidates(self.trace_inputs, self.problems)
        failed: dict[Path, str] = {}
        docs, _ = digest.bare_digests(files, failed=failed)
        not_traces = [p for p, err in failed.items()
                      if "not a Chrome trace" in err and disc.lacks_trace_events(p)]
        self.problems.extend(err for p, err in failed.items() if p not in not_traces)
        if not_traces:
            shown = ", ".join(p.name for p in not_traces[:6]) + (", …" if len(not_traces) > 6 else "")
            if len(not_traces) == len(files):
                raise RunDirError(self._no_trace(not_traces, shown))
            self.problems.append(f"{len(not_traces)} JSON file(s) are not profiler traces (no "
                                 f"traceEvents), not analyzed: {shown}")
        heads = [digest.TraceHead(docs[p]) for p in files if p in docs]
        other_jobs: list[Path] = []
        jobs = disc.group_jobs(heads)
        if len(jobs) > 1:
            said = "; ".join(f"job {i + 1} ({j.describe(jobs[0] if i else None, 'job 1', paths=True)})"
                             for i, j in enumerate(jobs[:4])) + ("; …" if len(jobs) > 4 else "")
            if len(self.trace_inputs) > 1:
                raise RunDirError(
                    f"these traces are of {len(jobs)} different jobs (time spans that do not "
                    f"overlap, or distributedInfo that differs): {said}; analyze the traces of "
                    f"one job at a time")
            job = disc.pick_job(jobs)
            for j in jobs:
                if j is not job:
                    other_jobs += [h.path for h in j.heads]
                    self.problems.append(
                        f"{self.trace_inputs[0]}: traces of another job left out "
                        f"({j.describe(job)}); analyzed: the latest "
                        f"{'complete ' if job.complete else ''}job ({job.describe()})")
            heads = job.heads
        heads, skipped = disc.choose_windows(heads, self.problems)
        ranked = disc.assign_ranks([(h.path, h) for h in heads], self.problems)
        # a trace digested before its rank was known (or as another rank): once more as its rank
        redo = {h.path: r for r, h in ranked.items() if h.doc.get("rank") != r}
        if redo:
            again, errors = digest.bare_digests(list(redo), ranks=redo)
            self.problems.extend(errors)
            ranked = {r: digest.TraceHead(again[h.path]) if h.path in again else h
                      for r, h in ranked.items() if h.path not in redo or h.path in again}
        for h in ranked.values():
            self.problems.extend(h.doc.get("problems") or [])
        self._cache["trace_heads"] = ranked
        self._cache["trace_paths"] = {r: h.path for r, h in ranked.items()}
        self._cache["digest_docs"] = {r: h.doc for r, h in ranked.items()}
        whole = sum(1 for h in ranked.values() if h.meta.get("whole_trace_window"))
        stubs = sum(len((h.doc["facts"].get("window") or {}).get("stub_steps") or [])
                    for h in ranked.values())
        self.input_facts = {
            "kind": "profiler traces", "inputs": [str(p) for p in self.trace_inputs],
            "files": len(files) - len(not_traces), "older_windows_skipped": skipped["older"],
            "traces_read": len(docs), "unreadable": len(files) - len(not_traces) - len(docs),
            "ranks": len(ranked), "steps": _distinct_steps(ranked.values()),
            "rank_steps": sum(h.steps for h in ranked.values()),
            **({"later_windows_skipped": skipped["later"]} if skipped["later"] else {}),
            **({"other_job_files": len(other_jobs)} if other_jobs else {}),
            **({"not_traces": len(not_traces)} if not_traces else {}),
            **({"stub_steps_dropped": stubs} if stubs else {}),
            **({"whole_trace_windows": whole} if whole else {})}

    def _no_trace(self, not_traces: list[Path], shown: str) -> str:
        """Why inputs whose every JSON file is something else than a trace are refused."""
        where = ", ".join(str(p) for p in self.trace_inputs[:3]) + \
            (" …" if len(self.trace_inputs) > 3 else "")
        msg = (f"{where}: no profiler trace: {shown} {'is' if len(not_traces) == 1 else 'are'} "
               f"JSON but not a Chrome trace (no traceEvents); expected traces written by "
               f"torch.profiler (tensorboard_trace_handler or export_chrome_trace)")
        if len(self.trace_inputs) == 1 and _is_dir(self.trace_inputs[0]):
            from trainprof.trace._discover import trace_folders

            found, _ = trace_folders(self.trace_inputs[0])
            if found:
                msg += (f"; traces found in {', '.join(_below(f, self.trace_inputs[0]) for f in found[:6])}"
                        f": run trainprof analyze {found[0]}")
        return msg

    def _trace_heads(self) -> dict:
        """rank -> the facts of its trace (trainprof.digest.TraceHead), without parsing it."""
        if self.trace_inputs:
            self.profiler_traces()
            return self._cache.get("trace_heads", {})
        from trainprof.digest import TraceHead

        return {r: TraceHead(d) for r, d in self.digest_docs().items()}

    def _trace_meta(self, rank: int) -> dict:
        """A rank's facts from its bare trace (distributedInfo, deviceProperties, torch's
        <host>_<pid> file name), checked like meta.json."""
        from trainprof.trace._discover import rank_facts

        head = self._trace_heads().get(rank)
        if head is None:
            return {}
        return rundir_schema.clean_object(rundir_schema.META, rank_facts(head, rank),
                                          str(head.path), self.problems)

    def trace_run_facts(self) -> dict:
        """Run facts only a trace carries (bare traces): the process groups (pg_config) and the
        devices (deviceProperties) of the first rank that has them."""
        from trainprof.trace._discover import run_facts

        heads = self._trace_heads()
        return run_facts([heads[r] for r in self.ranks if r in heads])
