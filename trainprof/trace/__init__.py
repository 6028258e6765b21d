"""Profiler-trace parsing: each rank's Chrome trace parsed once into columnar frames.

    traces, errors = load_traces({0: path0, 1: path1})   # in parallel across ranks
    tr = load_trace(path)                                 # one file; raises TraceError

``Trace`` (one rank):

- ``rank``: from ``distributedInfo.rank`` (JSON field, never a regex over raw text), else the
  rank the caller gave, else None.
- ``meta``: every top-level key except traceEvents (distributedInfo, deviceProperties,
  baseTimeNanoseconds, schemaVersion, ...), plus ``"path"``.
- ``events``: pandas DataFrame, one row per complete ('X') event, sorted by ts_ns:
    name (category), cat (category: cpu_op, user_annotation, kernel, gpu_memcpy, gpu_memset,
    cuda_runtime, cuda_driver, gpu_user_annotation, python_function, ...),
    ts_ns / dur_ns / end_ns (int64; absolute epoch ns when the trace has baseTimeNanoseconds,
    whose ts are µs relative to it; older traces carry absolute µs),
    pid, tid (int64; -1 when not an integer), stream (int64 GPU stream, -1 on the host),
    is_gpu (bool), step (int64 index N of the ProfilerStep#N that contains the event — host
    events by time, GPU events through their launch's correlation id; -1 outside any step),
    correlation, external_id (int64, -1 when absent),
    input_dims, input_types (object: lists, or None; present when record_shapes was on).
- ``comm``: DataFrame of collective arguments, one row per event that has them (PyTorch's
    record_param_comms / nccl: / gloo: annotations and NCCL kernels): ``row`` (index into
    events), collective, in_nelems, out_nelems, group_size, dtype, pg_name, pg_desc, pg_ranks
    (object list), seq (int64, -1).
- ``memory``: DataFrame of ``[memory]`` instant events: ts_ns, bytes, total_allocated,
    total_reserved, device_type, device_id, addr.
- ``steps``: DataFrame of ProfilerStep spans: step, start_ns, end_ns.
"""

from __future__ import annotations

import gzip
import os
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
_COMM_KEYS = (("Collective name", "collective"), ("In msg nelems", "in_nelems"),
              ("Out msg nelems", "out_nelems"), ("Group size", "group_size"), ("dtype", "dtype"),
              ("Process Group Name", "pg_name"), ("Process Group Description", "pg_desc"),
              ("Process Group Ranks", "pg_ranks"), ("Seq", "seq"))


class TraceError(Exception):
    """A trace file that cannot be read; the message names the file and what is wrong."""


@dataclass
class Trace:
    path: Path
    rank: int | None
    meta: dict
    events: pd.DataFrame
    comm: pd.DataFrame
    memory: pd.DataFrame
    steps: pd.DataFrame
    stats: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int | None:
        return (self.meta.get("distributedInfo") or {}).get("world_size")

    def host_events(self) -> pd.DataFrame:
        return self.events[~self.events["is_gpu"]]

    def gpu_events(self) -> pd.DataFrame:
        return self.events[self.events["is_gpu"]]


# --------------------------------------------------------------------------- reading
def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return zlib.decompress(raw, wbits=31)
        except zlib.error:
            try:  # concatenated gzip members
                return gzip.decompress(raw)
            except (OSError, EOFError, zlib.error) as e:
                raise TraceError(f"{path}: corrupt or truncated gzip ({e})") from None
    return raw


def _loads(path: Path, data: bytes):
    try:
        import orjson

        return orjson.loads(data)
    except ImportError:  # pragma: no cover - orjson is a dependency
        import json

        return json.loads(data)
    except Exception as e:  # noqa: BLE001 - orjson.JSONDecodeError is a ValueError subclass
        raise TraceError(f"{path}: not valid JSON ({e}); truncated trace?") from None


def _int(v, default=-1) -> int:
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def parse_trace(path: str | os.PathLike, rank: int | None = None) -> Trace:
    path = Path(path)
    doc = _loads(path, _read_bytes(path))
    if isinstance(doc, list):  # the bare-array form of the Chrome trace format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"{path}: not a Chrome trace (no traceEvents list)")
    events = doc.pop("traceEvents")
    meta = doc
    meta["path"] = str(path)
    dist = meta.get("distributedInfo") or {}
    if isinstance(dist.get("rank"), int):
        rank = dist["rank"]
    base = meta.get("baseTimeNanoseconds")
    base = int(base) if isinstance(base, (int, float)) else 0

    names, cats, ts, dur, pid, tid, stream, corr, ext, dims, types = ([] for _ in range(11))
    comm_rows: list[dict] = []
    mem_rows: list[tuple] = []
    n_bad = 0
    for e in events:
        if not isinstance(e, dict):
            n_bad += 1
            continue
        ph = e.get("ph")
        if ph == "X":
            args = e.get("args") or {}
            names.append(e.get("name", ""))
            cats.append(e.get("cat", ""))
            ts.append(e.get("ts", 0))
            dur.append(e.get("dur", 0))
            p, t = e.get("pid"), e.get("tid")
            pid.append(p if type(p) is int else _int(p))
            tid.append(t if type(t) is int else _int(t))
            if args:
                stream.append(args.get("stream", -1))
                corr.append(args.get("correlation", -1))
                ext.append(args.get("External id", -1))
                d = args.get("Input Dims")
                dims.append(d)
                types.append(args.get("Input type") if d is not None else None)
                if "Collective name" in args or "Process Group Name" in args:
                    row = {"row": len(names) - 1}
                    for k, col in _COMM_KEYS:
                        if k in args:
                            row[col] = args[k]
                    comm_rows.append(row)
            else:
                stream.append(-1)
                corr.append(-1)
                ext.append(-1)
                dims.append(None)
                types.append(None)
        elif ph == "i" and e.get("name") == "[memory]":
            a = e.get("args") or {}
            mem_rows.append((e.get("ts", 0), a.get("Bytes", 0), a.get("Total Allocated", -1),
                             a.get("Total Reserved", -1), a.get("Device Type", -1),
                             a.get("Device Id", -1), a.get("Addr", 0)))

    def ns(values) -> np.ndarray:
        arr = np.asarray(values, dtype=np.float64)
        return np.rint(arr * 1000.0).astype(np.int64)

    ts_ns = ns(ts) + base
    dur_ns = ns(dur)
    cat_arr = pd.Categorical(cats)
    is_gpu = np.asarray(cat_arr.isin(list(GPU_CATS)))
    frame = pd.DataFrame({
        "name": pd.Categorical(names), "cat": cat_arr, "ts_ns": ts_ns, "dur_ns": dur_ns,
        "end_ns": ts_ns + dur_ns, "pid": np.asarray(pid, dtype=np.int64),
        "tid": np.asarray(tid, dtype=np.int64),
        "stream": np.asarray([s if type(s) is int else -1 for s in stream], dtype=np.int64),
        "is_gpu": is_gpu, "correlation": np.asarray(corr, dtype=np.int64),
        "external_id": np.asarray([x if type(x) is int else -1 for x in ext], dtype=np.int64),
        "input_dims": pd.Series(dims, dtype=object), "input_types": pd.Series(types, dtype=object),
    })
    frame.loc[~frame["is_gpu"], "stream"] = -1
    steps = _steps(frame)
    frame["step"] = _assign_steps(frame, steps)
    order = np.argsort(frame["ts_ns"].to_numpy(), kind="stable")
    remap = np.empty_like(order)
    remap[order] = np.arange(len(order))
    frame = frame.iloc[order].reset_index(drop=True)
    comm = pd.DataFrame(comm_rows)
    if len(comm):
        comm["row"] = remap[comm["row"].to_numpy()]
        comm["seq"] = [_int(v) for v in comm.get("seq", pd.Series([-1] * len(comm)))]
    memory = pd.DataFrame(mem_rows, columns=["ts", "bytes", "total_allocated", "total_reserved",
                                             "device_type", "device_id", "addr"])
    memory.insert(0, "ts_ns", ns(memory.pop("ts")) + base if len(memory) else np.array([], np.int64))
    return Trace(path=path, rank=rank, meta=meta, events=frame, comm=comm, memory=memory,
                 steps=steps, stats={"events": len(events), "complete": len(frame),
                                     "malformed": n_bad})


def _steps(frame: pd.DataFrame) -> pd.DataFrame:
    names = frame["name"].astype(str)
    m = names.str.startswith("ProfilerStep#") & ~frame["is_gpu"]
    s = frame.loc[m, ["name", "ts_ns", "end_ns"]]
    out = pd.DataFrame({"step": s["name"].astype(str).str[len("ProfilerStep#"):].astype(np.int64),
                        "start_ns": s["ts_ns"], "end_ns": s["end_ns"]})
    return out.sort_values("start_ns").drop_duplicates("step").reset_index(drop=True)


def _assign_steps(frame: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """Host events by the ProfilerStep span that contains their start; GPU events by the step of
    the runtime call that launched them (same correlation id), else by time."""
    n = len(frame)
    out = np.full(n, -1, dtype=np.int64)
    if steps.empty or n == 0:
        return out
    starts, ends, ids = (steps[c].to_numpy() for c in ("start_ns", "end_ns", "step"))
    ts = frame["ts_ns"].to_numpy()
    i = np.searchsorted(starts, ts, side="right") - 1
    ok = (i >= 0) & (ts < ends[np.clip(i, 0, None)])
    out[ok] = ids[i[ok]]
    gpu = frame["is_gpu"].to_numpy()
    corr = frame["correlation"].to_numpy()
    if gpu.any():
        host_with_corr = (~gpu) & (corr >= 0)
        lookup = pd.Series(out[host_with_corr], index=corr[host_with_corr])
        lookup = lookup[~lookup.index.duplicated()]
        g = np.flatnonzero(gpu & (corr >= 0))
        via = lookup.reindex(corr[g]).to_numpy()
        has = ~np.isnan(via)
        out[g[has]] = via[has].astype(np.int64)
    return out


def load_trace(path: str | os.PathLike, rank: int | None = None) -> Trace:
    return parse_trace(path, rank)


def _load_one(item):
    rank, path = item
    try:
        return rank, parse_trace(path, rank), None
    except TraceError as e:
        return rank, None, str(e)
    except Exception as e:  # noqa: BLE001 - one bad file must not lose the other ranks
        return rank, None, f"{path}: could not parse trace: {type(e).__name__}: {e}"


def load_traces(paths: dict, progress=None, workers: int | None = None):
    """Parse every rank's trace once, in parallel processes. Returns ({rank: Trace}, [errors])."""
    items = sorted(paths.items())
    traces, errors = {}, []
    if not items:
        return traces, errors
    workers = workers or min(len(items), os.cpu_count() or 1)
    if workers <= 1 or len(items) == 1:
        results = map(_load_one, items)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        results = pool.map(_load_one, items)
    try:
        for i, (rank, trace, err) in enumerate(results):
            if progress:
                progress(f"traces {i + 1}/{len(items)}")
            if err:
                errors.append(err)
            else:
                traces[rank] = trace
    finally:
        if workers > 1 and len(items) > 1:
            pool.shutdown()
    return traces, errors
