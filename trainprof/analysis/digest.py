"""Per-rank trace digests: each rank's profiler trace reduced once, one trace at a time, to what
the job-level analyzers need, and cached in the run directory.

    RUN/digests/rank-NNNNN.json      one per rank with a profiler trace (docs/run-directory.md)

A digest holds, per analyzer module that exposes ``trace_digest(run, rank, trace) -> dict``
(the modules of ``trainprof.analyzers.ANALYZER_MODULES`` that have it), that function's result
— or the error it raised, for that section only — plus the facts the reader needs about the
trace without parsing it (distributedInfo, deviceProperties, steps, whole-trace window, GPU ops
without a launch). It is valid while the trace (path, size, mtime), trainprof's version, the
analysis code and the digest schema are the ones it was built from; anything else (a changed
trace, a newer trainprof, a malformed file) makes it rebuilt. It is reused only where a parse
today would read its trace (within_limit: the input limit, for a gzip trace the JSON size it
inflated to), else the trace is parsed, and refused, as without a digest.

Building: ``build(run_dir, ranks=None, workers=None)`` (the launcher at the end of a job with its
node's local ranks; ``python -m trainprof.analysis.reduce RUN_DIR`` under torchrun for traces on a shared
file system; ``trainprof analyze`` for whatever is still missing) parses the traces in a process
pool, each worker one trace at a time, so memory is bounded by workers × one parsed trace
whatever the number of ranks. Workers are forked only from a process without other threads; a
process with threads (the launcher) runs the pool in a fresh child (run_jobs). Digests are
written atomically, only inside the run directory;
for bare trace inputs (a folder of the user's traces) nothing is written: the digests are
computed the same way and kept in memory.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import time
import traceback
from pathlib import Path

from trainprof import __version__
from trainprof.rundir import schema as rundir_schema
from trainprof import safeio
from trainprof.analysis import pool
from trainprof.analysis.pool import GZIP_RATIO_EST, WORKERS_ENV  # noqa: F401 - WORKERS_ENV re-exported
from trainprof.rundir.files import (PROFILER_DIR, UNREADABLE, RunDirError, rank_dirname,
                                    read_json_or_problem, write_json_atomic)
from trainprof.analysis.run import RunDir
from trainprof.analyzers import ANALYZER_MODULES
from trainprof.trace import load_traces
from trainprof.trace._discover import name_rank, prepare_window, trace_rank
import trainprof.analyzers
import trainprof.trace

SCHEMA_VERSION = 1
KIND = "trainprof-trace-digest"
DIGESTS_DIR = "digests"


def digest_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / DIGESTS_DIR / f"{rank_dirname(rank)}.json"


def digest_root(run: RunDir, rank: int, trace: Path) -> Path:
    """The run directory a rank's digest lives in: the one whose profiler/ holds the trace,
    else the one holding the rank's files (several per-node run directories), else the run's."""
    roots = list(getattr(run, "roots", None) or [run.path])
    for root in roots:
        if Path(trace).parent == root / PROFILER_DIR:
            return root
    if len(roots) > 1 and hasattr(run, "rank_path"):
        return run.rank_path(rank).parent.parent
    return run.path


def _run_spec(run: RunDir):
    """How a pool worker opens the same run (several per-node run directories: their list)."""
    roots = list(getattr(run, "roots", None) or [run.path])
    return [str(r) for r in roots] if len(roots) > 1 else str(run.path)


# --------------------------------------------------------------------------- what is digested
def section_names() -> list[str]:
    """The analyzer modules with a ``trace_digest`` (modules that fail to import are skipped:
    the analysis reports them)."""
    out = []
    for name in ANALYZER_MODULES:
        try:
            mod = importlib.import_module(f"trainprof.analyzers.{name}")
        except Exception:  # noqa: BLE001
            continue
        if callable(getattr(mod, "trace_digest", None)):
            out.append(name)
    return out


_CODE: list[str] = []


def code_fingerprint() -> str:
    """A hash of the code a digest depends on (the analyzers, the trace parser, this module):
    a digest built by other code is rebuilt, even within one trainprof version."""
    if not _CODE:
        import hashlib

        h = hashlib.sha256(__version__.encode())
        files = [Path(__file__), Path(trainprof.trace.__file__).parents[1] / "devices.py"]
        for pkg in (trainprof.analyzers, trainprof.trace):
            files += sorted(Path(pkg.__file__).parent.glob("*.py"))
        for p in files:
            try:
                h.update(p.name.encode() + b"\0" + p.read_bytes())
            except OSError:
                h.update(p.name.encode())
        _CODE.append(h.hexdigest()[:20])
    return _CODE[0]


def trace_stamp(run_dir: Path, path: Path) -> dict:
    """Which trace file a digest was built from: path (relative to the run directory when
    inside it), size and mtime. OSError when it cannot be stat'ed."""
    st = os.stat(path)
    try:
        shown = str(Path(os.path.abspath(path)).relative_to(os.path.abspath(run_dir)))
    except ValueError:
        shown = str(os.path.abspath(path))
    return {"path": shown, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def trace_facts(tr) -> dict:
    """What the reader needs about a trace without parsing it again (RunDir: problems, a bare
    trace's rank and meta facts, the run facts; see TraceHead)."""
    meta = tr.meta
    dist = meta.get("distributedInfo")
    devs = meta.get("deviceProperties")
    span = meta.get("span_ns")
    return _plain({
        "path": str(tr.path), "rank": tr.rank,
        **({"distributedInfo": dist} if isinstance(dist, dict) else {}),
        **({"deviceProperties": devs} if isinstance(devs, list) else {}),
        "whole_trace_window": bool(meta.get("whole_trace_window")),
        "span_ns": [int(span[0]), int(span[1])] if span else None,
        "steps": int(len(tr.tables.steps)), "events": int(tr.stats.get("events") or 0),
        "gpu_ops_without_launch": int(tr.stats.get("gpu_ops_without_launch") or 0)})


class TraceHead:
    """A parsed trace's facts, standing in for the trace where only they are needed
    (trainprof/trace/_discover.py's rank assignment and rank/run facts): ``path``, ``rank``,
    ``meta`` (distributedInfo, deviceProperties, whole_trace_window, span_ns, path)."""

    def __init__(self, doc: dict):
        f = doc["facts"]
        self.doc = doc
        self.path = Path(f["path"])
        self.rank = doc.get("rank")
        self.steps = f.get("steps") or 0
        self.meta = {k: f[k] for k in ("distributedInfo", "deviceProperties", "whole_trace_window",
                                       "span_ns", "path") if k in f}

    @property
    def world_size(self):
        return (self.meta.get("distributedInfo") or {}).get("world_size")


def _np_default(o):
    import numpy as np

    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"a {type(o).__name__} is not JSON-able")


def _plain(obj):
    """``obj`` as it reads back from JSON: a digest computed now and one read from its file are
    the same objects (str keys, lists, plain floats whose repr round-trips exactly)."""
    return json.loads(json.dumps(obj, allow_nan=True, default=_np_default))


# --------------------------------------------------------------------------- one trace
def digest_trace(run, rank: int, tr, names: list[str]) -> dict:
    """The digest of one parsed trace (``run``: the RunDir the analyzers' trace_digest read).
    ``code`` (what a cached digest is checked against) is None for a bare trace: its digest is
    never cached."""
    bare = bool(getattr(run, "trace_inputs", None))
    doc = {"schema_version": SCHEMA_VERSION, "kind": KIND, "trainprof_version": __version__,
           "code": None if bare else code_fingerprint(), "rank": rank, "trace": None,
           "facts": trace_facts(tr), "sections": {}, "problems": [], "seconds": {}}
    n0 = len(run.problems)
    for name in names:
        t0 = time.perf_counter()
        try:
            fn = importlib.import_module(f"trainprof.analyzers.{name}").trace_digest
            data = _plain(fn(run, rank, tr))
            doc["sections"][name] = {"data": data if isinstance(data, dict) else {"value": data}}
        except Exception as e:  # noqa: BLE001 - one analyzer's bug costs only its section
            doc["sections"][name] = {"error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc(limit=6)}
        doc["seconds"][name] = round(time.perf_counter() - t0, 4)
    doc["problems"] = list(dict.fromkeys(str(p) for p in run.problems[n0:]))
    return doc


def _json_bytes(tr) -> int | None:
    n = (getattr(tr, "stats", None) or {}).get("json_bytes")
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def within_limit(doc: dict, stamp: dict) -> bool:
    """Whether a parse of the trace today would read it, as the digest's parse did: the file
    within ``--max-input-mb`` / TRAINPROF_MAX_INPUT_MB, and, for a gzip trace, its JSON
    (``trace_bytes``, what the digest's parse inflated) within what safeio lets that file
    inflate to now. A digest that does not say how large its JSON was is not reused."""
    if stamp["size"] > safeio.max_input_bytes():
        return False
    n = doc.get("trace_bytes")
    if not isinstance(n, int) or isinstance(n, bool):
        return False
    return n == stamp["size"] or n <= safeio.inflate_limit(stamp["size"])[0]


def _parse(path: Path, rank: int | None, pieces: int):
    traces, errors = load_traces({rank if rank is not None else -1: path}, workers=pieces)
    if errors:
        return None, errors[0]
    return next(iter(traces.values())), None


_WORKER_RUNS: dict[str, RunDir] = {}  # a pool worker's view of its run directory, built once


def _job(job: tuple, run=None, collect: bool = True) -> tuple:
    """One digest (in a pool worker, or in-process with the caller's ``run``). job = (kind,
    run_dir, rank, trace path, stamp, write, names, pieces); kind "run": a run directory's rank;
    "job": a run directory's rank whose trace the job's own profiler wrote (as "run", with its
    trailing stub steps dropped and ``window`` in its facts); "bare": a bare trace whose rank
    (None: not known yet) is given; "window": only what a trace's window holds (its facts with
    ``window``, no section). Returns (key: the rank for "run" and "job", else the path; doc or
    None, error or None). ``collect``: a full garbage collection after it, so that the next
    trace parsed in this process finds the memory of this one free."""
    kind, base, rank, path, stamp, write, names, pieces = job
    in_run = kind in ("run", "job")
    t0 = time.perf_counter()
    try:
        tr, err = _parse(Path(path), rank, pieces)
        if err:
            return rank if in_run else path, None, err
        parse_s = time.perf_counter() - t0
        window, said = None, []
        if kind != "run":  # what the window holds (the caller may choose among a process's
            # windows), its trailing stub steps dropped before any analyzer reads it
            window, said = prepare_window(tr)
        if kind == "window":
            tr.rank = rank
            doc = {"rank": rank, "facts": {**trace_facts(tr), "path": str(path), "window": window},
                   "sections": {}, "problems": said}
        elif in_run:
            if run is None:
                key = json.dumps(base)
                run = _WORKER_RUNS.get(key)
                if run is None:
                    run = _WORKER_RUNS.setdefault(key, RunDir(base))
            doc = digest_trace(run, rank, tr, names)
        else:
            r = rank if rank is not None else trace_rank(tr)
            r = r if r is not None else name_rank(Path(path).name)
            tr.rank = r
            if r is None:  # its rank is assigned among the others' (a second pass digests it)
                doc = {"rank": None, "facts": trace_facts(tr), "sections": {}, "problems": []}
            else:
                head = TraceHead({"rank": r, "facts": trace_facts(tr)})
                view = RunDir(Path(path), _preset={"trace_paths": {r: Path(path)},
                                                   "trace_heads": {r: head}, "digest_docs": {}})
                doc = digest_trace(view, r, tr, names)
        if window is not None and kind != "window":
            doc["facts"]["window"] = window
            doc["problems"] = list(dict.fromkeys(said + doc["problems"]))
        doc["trace"] = stamp
        doc["trace_bytes"] = _json_bytes(tr)
        doc["seconds"] = {"parse": round(parse_s, 4), **doc.get("seconds", {})}
        del tr
        if in_run and run is _WORKER_RUNS.get(json.dumps(base)):
            # a worker's view outlives the job: drop the rank's streams the sections read
            for k in [k for k in run._cache if isinstance(k, str) and k.startswith("stream:")
                      and k.endswith(f":{rank}") and not k.startswith("stream:groups:")]:
                del run._cache[k]
        if write:
            try:
                write_json_atomic(write, doc, indent=None)
            except OSError:
                pass  # a read-only run directory: the digest is used, not cached
        return rank if in_run else path, doc, None
    except Exception as e:  # noqa: BLE001 - one bad trace must not lose the other ranks
        return (rank if in_run else path, None,
                f"{path}: could not digest the trace: {type(e).__name__}: {e}")
    finally:
        if collect and _parsed_enough(path):
            gc.collect()


COLLECT_EVERY = 64 << 20  # bytes of trace (inflated, estimated) parsed between full collections
_since_collect = [0]


def _parsed_enough(path) -> bool:
    """Whether this process parsed COLLECT_EVERY bytes of trace since its last full garbage
    collection (counting this one): a large trace is followed by one at once, tiny ones share
    one. A full collection walks every live object, the digests already kept included: one
    after each of 5,000 tiny traces cost 245 s, growing with the square of their number."""
    try:
        size = os.stat(path).st_size
    except (OSError, TypeError, ValueError):
        size = COLLECT_EVERY
    _since_collect[0] += size * (GZIP_RATIO_EST if str(path).endswith(".gz") else 1)
    if _since_collect[0] < COLLECT_EVERY:
        return False
    _since_collect[0] = 0
    return True


def run_jobs(jobs: list[tuple], workers: int | None = None, run=None, progress=None,
             isolate: bool = False) -> list[tuple]:
    """Digest jobs (_job) in the trace pool (trainprof/analysis/pool.py run_jobs), results in the
    jobs' order."""
    return pool.run_jobs(_job, jobs, workers, run, progress, isolate)


def pool_child_main(src: str) -> int:
    """The pool's child process (``python -m trainprof.analysis.reduce --pool FILE``): the parser
    and the analyzers imported once, before its workers fork."""

    def prepare():
        code_fingerprint()
        section_names()
        importlib.import_module("trainprof.trace._frames")

    return pool.child_main(_job, src, prepare)


# --------------------------------------------------------------------------- cached digests
def check(doc) -> str | None:
    """Why a digest document is malformed (None when its fields have the documented types)."""
    if not isinstance(doc, dict):
        return f"not a JSON object but {type(doc).__name__}"
    if doc.get("kind") != KIND:
        return f'"kind" is not "{KIND}"'
    why = rundir_schema.record_error(rundir_schema.DIGEST, rundir_schema.DIGEST_REQUIRED, doc,
                                     rundir_schema.DIGEST_NESTED)
    if why:
        return why
    if not isinstance(doc["facts"].get("path"), str):
        return '"facts" lacks "path"'
    for name, sec in doc["sections"].items():
        if not isinstance(sec, dict) or not (isinstance(sec.get("data"), dict)
                                             or isinstance(sec.get("error"), str)):
            return f'section "{name}" holds neither "data" (an object) nor "error" (a string)'
    return None


def read_cached(run, p: Path, rank: int, stamp: dict | None, names: list[str]) -> dict | None:
    """The cached digest ``p`` of ``rank`` when it is current (same trace, trainprof, code,
    schema, and every section in ``names``); None otherwise. A malformed file is a problem (and
    is rebuilt by the caller)."""
    try:
        os.stat(p)
    except OSError:
        return None
    doc = read_json_or_problem(p, run.problems, "; malformed trace digest, rebuilt from the trace",
                               default=UNREADABLE)
    if doc is UNREADABLE:
        return None
    why = check(doc)
    if why is None and doc["rank"] != rank:
        why = f"says rank {doc['rank']}"
    if why:
        run.problems.append(f"{p}: malformed trace digest ({why}); rebuilt from the trace")
        return None
    if (doc["schema_version"] != SCHEMA_VERSION or doc.get("trainprof_version") != __version__
            or doc.get("code") != code_fingerprint() or stamp is None or doc["trace"] != stamp):
        return None
    if not within_limit(doc, stamp):  # parsed again: refused as any parse would be
        return None
    secs = doc["sections"]
    if any(n not in secs or "error" in secs[n] for n in names):  # errors are retried
        return None
    return doc


def ensure(run: RunDir, names: list[str] | None = None, ranks=None, workers: int | None = None,
           progress=None, write: bool = True, isolate: bool = False) -> tuple[dict[int, dict], dict]:
    """{rank: digest} for the run's traces (``ranks``: only those), reading the current cached
    digests and building the others in a process pool (``write``: written into RUN/digests/ of
    a run directory; bare trace inputs: kept in memory only). Traces that cannot be digested
    are problems. Returns (digests, {"built": [...], "reused": [...], "failed": {rank: why}})."""
    names = list(dict.fromkeys(list(names or section_names())))
    paths = run.profiler_traces()
    if ranks is not None:
        want = {int(r) for r in ranks}
        paths = {r: p for r, p in paths.items() if r in want}
    bare = bool(run.trace_inputs)
    # ranks whose trace the job's own profiler wrote -> the windows it chose among
    job_windows = {} if bare else run.job_windows()
    docs: dict[int, dict] = {}
    jobs = []
    targets: dict[int, Path] = {}  # the digests of the job's traces: written here, windows in
    spec = None if bare else _run_spec(run)
    for r, p in sorted(paths.items()):
        root = p.parent if bare else digest_root(run, r, p)
        try:
            stamp = trace_stamp(root, p)
        except OSError:
            stamp = None
        target = None if bare else digest_path(root, r)
        keep = write and not bare and _own_digest_dir(run, root)
        if keep and r in job_windows:
            targets[r] = target
        # a trace over today's --max-input-mb (its file, or the JSON it inflates to) is refused
        # as its parse would be, cached or not (read_cached: within_limit)
        doc = None if bare else read_cached(run, target, r, stamp, names)
        if doc is not None:
            docs[r] = doc
        else:
            kind = "bare" if bare else "job" if r in job_windows else "run"
            jobs.append((kind, spec, r, str(p), stamp,
                         str(target) if keep and kind == "run" else None, names, 1))
    report = {"reused": sorted(docs), "built": [], "failed": {}}
    for r, doc, err in run_jobs(jobs, workers, run, progress, isolate=isolate):
        if err:
            run.problems.append(err)
            report["failed"][r] = err
        else:
            docs[r] = doc
            report["built"].append(r)
    report["built"].sort()
    for r, windows in job_windows.items():
        # what each of the job's windows holds goes with the digest: the next analysis chooses
        # among the same files without parsing them again (RunDir._job_traces)
        doc = docs.get(r)
        if doc is None or (r not in report["built"] and doc.get("windows") == windows):
            continue
        doc["windows"] = windows
        if r in targets:
            try:
                write_json_atomic(targets[r], doc, indent=None)
            except OSError:
                pass  # a read-only run directory: the digest is used, not cached
    for r in sorted(docs):
        run.problems.extend(docs[r].get("problems") or [])
    return dict(sorted(docs.items())), report


def _own_digest_dir(run, root: Path) -> bool:
    """RUN/digests/ may be written: a directory of its own or none yet. A symlink (or anything
    else of that name) is never written through: the digests would land outside the run
    directory, over files trainprof did not write. Said once in the run's problems."""
    d = Path(root) / DIGESTS_DIR
    if not os.path.lexists(d) or (d.is_dir() and not d.is_symlink()):
        return True
    said = f"{d}: not a directory of the run (a symlink?); trace digests are not cached there"
    if said not in run.problems:
        run.problems.append(said)
    return False


def build(run_dir: str | os.PathLike, ranks=None, workers: int | None = None,
          progress=None, isolate: bool = False) -> dict:
    """Build the missing or stale digests of a run directory (``ranks``: only those, e.g. a
    node's local ranks at the end of its job) with a pool of ``workers`` processes (default
    min(CPUs, traces, what the memory holds); ``isolate``: never in this process, see
    run_jobs). Returns {"built": [ranks], "reused": [ranks], "failed": {rank: why},
    "seconds": wall}. Raises RunDirError for what is not a run directory (bare traces are
    never digested to disk)."""
    t0 = time.perf_counter()
    run = RunDir(run_dir)
    if run.trace_inputs or run.snapshot_only:
        raise RunDirError(f"{run_dir}: not a trainprof run directory; trace digests are cached "
                          f"only in run directories (`trainprof analyze` digests bare traces "
                          f"in memory)")
    _, report = ensure(run, ranks=ranks, workers=workers, progress=progress, isolate=isolate)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def bare_digests(paths: list[Path], names: list[str] | None = None, ranks: dict | None = None,
                 workers: int | None = None, failed: dict | None = None) -> tuple[dict, list[str]]:
    """Digests of bare trace files, computed in the pool and returned (nothing written).
    ``ranks``: path -> the rank to digest it as (else the trace's own, when it says). Each
    digest's facts hold ``window`` (trainprof/trace/_discover.py prepare_window). Returns
    ({path: digest}, [errors]); ``failed``, when given, gets path -> error."""
    names = list(names or section_names())
    ranks = ranks or {}
    jobs = [("bare", None, ranks.get(p), str(p), _stamp_or_none(p), None, names, 1) for p in paths]
    out, errors = {}, []
    for key, doc, err in run_jobs(jobs, workers):
        if err:
            errors.append(err)
            if failed is not None:
                failed[Path(key)] = err
        else:
            out[Path(key)] = doc
    return out, errors


def _stamp_or_none(p: Path) -> dict | None:
    try:
        return trace_stamp(p.parent, p)
    except OSError:
        return None
