"""The frame builder behind trainprof.trace (see its docstring for the Trace schema): decoded
columns (_decode.py, _columns.py) -> numpy tables (_table.py), steps and step assignment, and the
per-rank loading pool. Imported on first use of trainprof.trace's names, so that finding traces
(_discover.py) and commands that never parse one do not import numpy; pandas is imported only by
a pandas view (``Trace.events`` and the like)."""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainprof import safeio, settings
from trainprof.trace import _columns, _decode, _dialects, _document
from trainprof.trace._table import Cat, Table, objects

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


class TraceError(Exception):
    """A trace file that cannot be read; the message names the file and what is wrong."""


class Tables:
    """A parsed trace's tables (trainprof/trace/_table.py; numpy only): events, comm, memory,
    steps, launch, with the columns trainprof.trace's docstring lists."""

    __slots__ = ("events", "comm", "memory", "steps", "launch")

    def __init__(self, events: Table, comm: Table, memory: Table, steps: Table,
                 launch: Table | None = None):
        self.events, self.comm, self.memory, self.steps = events, comm, memory, steps
        self.launch = launch if launch is not None else _launch_table({}, np.arange(0))


@dataclass
class Trace:
    path: Path
    rank: int | None
    meta: dict
    tables: Tables
    stats: dict = field(default_factory=dict)
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def world_size(self) -> int | None:
        dist = self.meta.get("distributedInfo")
        return dist.get("world_size") if isinstance(dist, dict) else None

    # pandas views of the tables, built (and pandas imported) on first use
    def _view(self, name: str):
        v = self._views.get(name)
        if v is None:
            v = self._views[name] = getattr(self.tables, name).to_pandas()
        return v

    @property
    def events(self):
        return self._view("events")

    @property
    def comm(self):
        return self._view("comm")

    @property
    def memory(self):
        return self._view("memory")

    @property
    def steps(self):
        return self._view("steps")

    def host_events(self):
        return self.events[~self.events["is_gpu"]]

    def gpu_events(self):
        return self.events[self.events["is_gpu"]]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_views"] = {}  # rebuilt on use: never pickled to or from a pool worker
        return state


def name_mask(col, pred) -> np.ndarray:
    """pred(str) -> bool evaluated once per distinct name instead of once per row (a Cat, a
    pandas Categorical Series, or any sequence of strings)."""
    if isinstance(col, Cat):
        return col.mask(lambda v: pred(str(v)))
    dtype = getattr(col, "dtype", None)
    if dtype is not None and type(dtype).__name__ == "CategoricalDtype":
        cats = np.fromiter((bool(pred(str(c))) for c in col.cat.categories), bool,
                           len(col.cat.categories))
        codes = col.cat.codes.to_numpy()
        return np.where(codes >= 0, cats[np.clip(codes, 0, None)] if len(cats) else False, False)
    return np.fromiter((bool(pred(str(v))) for v in col), bool, len(col))


# --------------------------------------------------------------------------- reading
try:  # ISA-L's inflate: same streams as zlib, 2x faster (0.10 -> 0.05 s on the 53 MB fixture)
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - optional accelerator
    _zlib = zlib


def _read_raw(path: Path) -> bytes:
    """The file's bytes: a regular file within the input limit (trainprof/safeio.py)."""
    try:
        return safeio.read_limited(path, what="profiler trace")
    except OSError as e:
        raise TraceError(str(e) if isinstance(e, safeio.InputRefused)
                         else f"{path}: cannot read: {e.strerror or e}") from None


def _read_bytes(path: Path) -> bytes:
    """The trace's JSON bytes: a regular file within the input limit, inflated (gzip) within
    the limit and a sane compression ratio (trainprof/safeio.py)."""
    raw = _read_raw(path)
    return _read_gzip(raw, path) if raw[:2] == b"\x1f\x8b" else raw


def _read_decoded(path: Path, fast: bool, pieces: int):
    """(columns or None, the JSON bytes when not decoded yet, their size, pieces still worth
    trying). A large gzip trace read with pieces > 1 is decoded while it inflates
    (_decode.decode_stream): children decode its first parts as soon as they are inflated."""
    raw = _read_raw(path)
    if raw[:2] != b"\x1f\x8b":
        return None, raw, len(raw), pieces
    if pieces < 2 or not fast:
        data = _read_gzip(raw, path)
        return None, data, len(data), pieces
    try:
        cols, data, size, tried = _decode.decode_stream(
            safeio.gunzip_chunks(raw, path, _zlib, 1 << 20), safeio.gzip_size_hint(raw), pieces, fast)
    except (safeio.InputRefused, safeio.GzipError) as e:
        raise TraceError(str(e)) from None
    return cols, data, size, 1 if tried else pieces


def _read_gzip(raw: bytes, path: Path) -> bytes:
    try:
        return safeio.gunzip_limited(raw, path, _zlib)
    except (safeio.InputRefused, safeio.GzipError) as e:
        raise TraceError(str(e)) from None


def parse_trace(path: str | os.PathLike, rank: int | None = None, fast: bool = True,
                pieces: int = 1) -> Trace:
    """pieces > 1: forked processes decode parts of one large trace (16 MB or more) in
    parallel; load_traces passes the CPUs its pool leaves idle."""
    # the GC stays off until the frames are built: passes over the decoded columns' containers
    # (none cyclic) cost 30-50 ms a trace
    with _decode.gc_paused():
        return _parse(Path(path), rank, fast, pieces)


def _parse(path: Path, rank: int | None, fast: bool, pieces: int) -> Trace:
    cols, data, json_bytes, pieces = _read_decoded(path, fast, pieces)
    if cols is None:
        if not data or (len(data) < 4096 and not data.strip()):
            raise TraceError(f"{path}: empty file")
        try:
            cols = _decode.decode(data, fast=fast, pieces=pieces)
        except _document.DecodeError as e:
            raise TraceError(f"{path}: not valid JSON ({e}); truncated or corrupt trace?") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"{path}: not a Chrome trace ({e})") from None
    del data  # json_bytes: the input limit's measure (digests record it)
    meta = cols.meta
    dist = meta.get("distributedInfo")
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int):
        rank = dist["rank"]
    base = meta.get("baseTimeNanoseconds")
    base = int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) \
        and abs(base) < 2**62 else 0  # a base beyond that leaves no room for the timestamps

    events = _events_table(cols, base, meta)
    steps = _steps(events)
    meta["whole_trace_window"] = False  # ours, whatever the file's top level holds
    if steps.empty and len(events):
        # no ProfilerStep (a profiler used without schedule/step()): one window over the whole
        # trace, as HTA does; RunDir.traces() says so in a problem line
        steps = Table({"step": np.zeros(1, np.int64),
                       "start_ns": np.array([events["ts_ns"].min()], np.int64),
                       "end_ns": np.array([events["end_ns"].max()], np.int64)})
        meta["whole_trace_window"] = True
        events["step"] = np.zeros(len(events), np.int64)
    else:
        events["step"] = _assign_steps(events, steps)
    unlaunched = _unlaunched(events)
    if unlaunched.any():  # queued before recording started: in no window (HTA drops them too)
        events["step"][unlaunched] = -1
    ts = events["ts_ns"]
    if len(ts) > 1 and (ts[1:] < ts[:-1]).any():  # Kineto writes host events mostly in order
        order = np.argsort(ts, kind="stable")
        events = events.take(order)
        remap = np.empty_like(order)
        remap[order] = np.arange(len(order))
    else:
        remap = np.arange(len(ts))
    meta["path"] = str(path)
    meta["span_ns"] = ([int(events["ts_ns"][0]), int(events["end_ns"].max())]
                       if len(events) else None)
    tables = Tables(events, _comm_table(cols.comm, remap), _memory_table(cols.mem, base), steps,
                    _launch_table(cols.launch, remap))
    return Trace(path=path, rank=rank, meta=meta, tables=tables,
                 stats={"events": cols.n_events, "complete": len(events), "malformed": cols.n_bad,
                        "gpu_ops_without_launch": int(unlaunched.sum()),
                        "json_bytes": json_bytes,
                        "decoder": "msgspec" if fast and _document.msgspec is not None else "orjson"})


_ints = _columns.ints


def _us_to_ns(values) -> np.ndarray:
    """µs floats -> int64 ns without losing the ns digits of large absolute µs values."""
    a = np.asarray(values, dtype=np.float64)
    whole = np.floor(a)
    return whole.astype(np.int64) * 1000 + np.rint((a - whole) * 1000.0).astype(np.int64)


def _events_table(c, base: int, meta: dict) -> Table:
    ts_ns = _us_to_ns(c.ts) + base
    dur_ns = np.maximum(_us_to_ns(c.dur), 0)
    cat_values, meta["dialect"] = _dialects.canonical(c.cat[1])  # ours, like whole_trace_window
    cat = Cat.from_factorized(c.cat[0], cat_values)
    is_gpu = cat.isin(GPU_CATS)
    stream = c.stream  # Columns' int columns are int64 arrays already (-1 = missing)
    stream[~is_gpu] = -1
    return Table({
        "name": Cat.from_factorized(*c.name), "cat": cat, "ts_ns": ts_ns, "dur_ns": dur_ns,
        "end_ns": ts_ns + dur_ns, "pid": c.pid, "tid": c.tid, "stream": stream,
        "is_gpu": is_gpu, "correlation": c.corr, "external_id": c.ext,
        "input_dims": objects(c.dims), "input_types": objects(c.types),
        "concrete_inputs": objects(c.concrete),
    })


def _ranks(v):
    if isinstance(v, list):
        return [int(x) for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)
                and x == x and abs(x) < 2**63]
    if isinstance(v, str):
        try:
            return [int(x) for x in v.strip("[] ").split(",") if x.strip()]
        except ValueError:
            return None
    return None


_STR_COMM = ("pg_name", "pg_desc", "collective", "dtype")


def _comm_table(rows: list, remap: np.ndarray) -> Table:
    """Collective-argument rows -> a table sorted by event row: ``row`` and ``seq`` int64 (seq -1
    when absent); pg_ranks a list of ints or None; pg_name, pg_desc, collective, dtype str or
    None; the other columns (present when some row has them) int64 when every row has an
    integer, else objects with None where missing."""
    if not rows:
        return Table({"row": np.empty(0, np.int64), "seq": np.empty(0, np.int64)})
    keys = list(dict.fromkeys(k for r in rows for k in r))
    row = remap[np.fromiter((r["row"] for r in rows), np.int64, len(rows))]
    order = np.argsort(row, kind="stable")
    rows = [rows[i] for i in order.tolist()]
    out: dict = {"row": row[order]}
    for k in keys:
        if k == "row":
            continue
        vals = [r.get(k) for r in rows]
        if k == "pg_ranks":
            out[k] = objects([_ranks(v) for v in vals])
        elif k in _STR_COMM:
            out[k] = objects([None if v is None or v != v else str(v) for v in vals])
        elif k == "seq":
            out[k] = _ints(vals)
        elif all(type(v) is int and -2**63 <= v < 2**63 for v in vals):
            out[k] = np.fromiter(vals, np.int64, len(vals))
        else:
            out[k] = objects(vals)
    if "seq" not in out:
        out["seq"] = np.full(len(rows), -1, np.int64)
    return Table(out)


LAUNCH_COLUMNS = tuple(col for _, col in _columns.LAUNCH_KEYS)


def _launch_table(launch: dict, remap: np.ndarray) -> Table:
    """A kernel's launch figures, one row per event that has any: ``row`` (int64 index into
    events, sorted) and the LAUNCH_COLUMNS as float64 (NaN where absent)."""
    if not launch:
        return Table({"row": np.empty(0, np.int64),
                      **{c: np.empty(0, np.float64) for c in LAUNCH_COLUMNS}})
    n = len(next(iter(launch.values())))
    have = np.zeros(n, bool)
    for v in launch.values():
        have |= ~np.isnan(v)
    rows = np.flatnonzero(have)
    new = remap[rows]
    order = np.argsort(new, kind="stable")
    out = {"row": new[order]}
    for col in LAUNCH_COLUMNS:
        v = launch.get(col)
        out[col] = v[rows][order] if v is not None else np.full(len(rows), np.nan)
    return Table(out)


def _memory_table(rows: list, base: int) -> Table:
    cols = ("ts", "bytes", "total_allocated", "total_reserved", "device_type", "device_id", "addr")
    arr = list(zip(*rows)) if rows else [[] for _ in cols]
    out = {"ts_ns": _us_to_ns(arr[0]) + base}
    for k, v in zip(cols[1:], arr[1:]):
        out[k] = _ints(list(v))
    return Table(out)


_STEP_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _step_number(name: str):
    """N of "ProfilerStep#N" (a number as JSON writes one; an integral part beyond int64, or
    anything else, None: the span is no step)."""
    text = name[len("ProfilerStep#"):].strip()
    if not _STEP_NUMBER.fullmatch(text):
        return None
    try:
        v = int(text)
    except ValueError:
        f = float(text)
        if f != f or abs(f) >= 2**63:
            return None
        v = int(f)
    return v if -2**63 <= v < 2**63 else None


def _steps(events: Table) -> Table:
    name = events["name"]
    m = name.startswith("ProfilerStep#") & ~events["is_gpu"]
    rows = np.flatnonzero(m)
    num_of = [_step_number(v) if v.startswith("ProfilerStep#") else None for v in name.values]
    nums = [num_of[c] for c in name.codes[rows].tolist()]
    keep = np.fromiter((v is not None for v in nums), bool, len(nums))
    rows = rows[keep]
    step = np.fromiter((v for v in nums if v is not None), np.int64, len(rows))
    start, end = events["ts_ns"][rows], events["end_ns"][rows]
    order = np.argsort(start, kind="stable")
    step, start, end = step[order], start[order], end[order]
    _, first = np.unique(step, return_index=True)  # the first of each step number, by start
    first = np.sort(first)
    return Table({"step": step[first], "start_ns": start[first], "end_ns": end[first]})


def _assign_steps(events: Table, steps: Table) -> np.ndarray:
    """Host events by the ProfilerStep span that contains their start; GPU events by the step of
    the runtime call that launched them (same correlation id), else by time."""
    n = len(events)
    out = np.full(n, -1, dtype=np.int64)
    if steps.empty or n == 0:
        return out
    starts, ends, ids = (steps[c] for c in ("start_ns", "end_ns", "step"))
    ts = events["ts_ns"]
    i = np.searchsorted(starts, ts, side="right") - 1
    ok = (i >= 0) & (ts < ends[np.clip(i, 0, None)])
    out[ok] = ids[i[ok]]
    gpu = events["is_gpu"]
    corr = events["correlation"]
    if gpu.any():
        host = np.flatnonzero(~gpu & (corr >= 0))
        hc = corr[host]
        order = np.argsort(hc, kind="stable")
        hc, hstep = hc[order], out[host][order]
        g = np.flatnonzero(gpu & (corr >= 0))
        j = np.searchsorted(hc, corr[g])
        found = j < len(hc)
        found[found] = hc[j[found]] == corr[g][found]
        out[g[found]] = hstep[j[found]]
    return out


def _unlaunched(events: Table) -> np.ndarray:
    """Kernels, memcpys and memsets whose correlation id matches no host call of the trace:
    work queued before the profiler started recording. Only where the trace has host calls
    with correlation ids at all (a trace of GPU activity alone keeps its ops)."""
    gpu = events["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"])
    corr = events["correlation"]
    host = corr[~events["is_gpu"] & (corr >= 0)]
    if not gpu.any() or not len(host):
        return np.zeros(len(events), bool)
    return gpu & (corr >= 0) & ~np.isin(corr, host)


def load_trace(path: str | os.PathLike, rank: int | None = None) -> Trace:
    """Parse one trace file. Raises TraceError naming the file and what is wrong."""
    return parse_trace(path, rank)


def _load_one(item):
    rank, path, pieces = item
    try:
        return rank, parse_trace(path, rank, pieces=pieces), None
    except TraceError as e:
        return rank, None, str(e)
    except Exception as e:  # noqa: BLE001 - one bad file must not lose the other ranks
        return rank, None, f"{path}: could not parse trace: {type(e).__name__}: {e}"


def load_traces(paths: dict, progress=None, workers: int | None = None):
    """Parse every rank's trace once, in parallel processes (frames come back pickled as numpy
    columns). Returns ({rank: Trace}, [error strings]); a bad file costs only its own rank."""
    items = sorted(paths.items())
    traces, errors = {}, []
    if not items:
        return traces, errors
    cpus = workers or settings.available_cpus()
    workers = min(cpus, len(items))
    # CPUs the pool leaves idle (fewer files than CPUs) decode pieces of each large file
    items = [(rank, path, max(1, cpus // len(items))) for rank, path in items]
    pool = None
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        results = pool.map(_load_one, items)
    else:
        results = map(_load_one, items)
    try:
        for i, (rank, trace, err) in enumerate(results):
            if progress:
                progress(f"traces {i + 1}/{len(items)}")
            if err:
                errors.append(err)
            else:
                traces[rank] = trace
    finally:
        if pool is not None:
            pool.shutdown()
    return traces, errors
