"""One Chrome-trace document (bytes) -> Columns, in one pass.

Fastest path: the C scan (trainprof/trace/_kineto.c, ``_from_scan``) goes from the JSON bytes
to the columns with no Python object per event, and hands any document it does not take exactly
as the typed decoder would to that decoder (``_typed``).

Typed path: msgspec decodes straight into slotted structs that declare only the fields we keep,
so the rest of each event (kernel occupancy figures, flow ids, ...) is skipped without creating
Python objects. Fallback (no msgspec, or a trace whose field types surprise the typed decoder):
orjson into dicts (``_from_dicts``).

Structs -> columns goes a column at a time through C-level maps (``map(attrgetter(f), structs)``
into ``np.fromiter``): ~5 ms per column of 123k events, several times less than one Python loop
appending to every column.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, Optional, Union

import numpy as np

from trainprof.trace._columns import (COMM_KEYS, LAUNCH_KEYS, META_KEYS, Columns, factorize, int_or_missing,
                                      ints, launch_values)


class DecodeError(Exception):
    """The bytes are not JSON (message says where)."""


try:  # msgspec: optional accelerator
    import msgspec

    # Field lookup is a linear scan over a struct's fields, and every key the struct does not
    # declare ("Ev Idx", "grid", "registers per thread", ...) scans them all: args of complete
    # and of instant events are two structs, each with only the fields its events use.
    class _XArgs(msgspec.Struct, gc=False):
        # -1 defaults (not None) so these columns go straight into int64 arrays
        external_id: int = msgspec.field(default=-1, name="External id")
        stream: int = -1
        correlation: int = -1
        input_dims: Any = msgspec.field(default=None, name="Input Dims")
        input_type: Any = msgspec.field(default=None, name="Input type")
        concrete: Any = msgspec.field(default=None, name="Concrete Inputs")  # scalars, e.g. is_causal
        collective: Any = msgspec.field(default=None, name="Collective name")
        in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
        out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
        group_size: Any = msgspec.field(default=None, name="Group size")
        dtype: Any = None
        pg_name: Any = msgspec.field(default=None, name="Process Group Name")
        pg_desc: Any = msgspec.field(default=None, name="Process Group Description")
        pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
        seq: Any = msgspec.field(default=None, name="Seq")
        coll_rank: Any = msgspec.field(default=None, name="Rank")
        src_rank: Any = msgspec.field(default=None, name="Src Rank")
        dst_rank: Any = msgspec.field(default=None, name="Dst Rank")
        external_id_lc: int = msgspec.field(default=-1, name="external id")  # PyTorch 1.8-1.10
        input_dims_lc: Any = msgspec.field(default=None, name="Input dims")  # PyTorch 1.8-1.10
        grid: Any = None
        block: Any = None
        regs: Any = msgspec.field(default=None, name="registers per thread")
        smem: Any = msgspec.field(default=None, name="shared memory")
        blocks_per_sm: Any = msgspec.field(default=None, name="blocks per SM")
        warps_per_sm: Any = msgspec.field(default=None, name="warps per SM")
        occupancy: Any = msgspec.field(default=None, name="est. achieved occupancy %")

    class _MemArgs(msgspec.Struct, gc=False):  # Kineto's order: the scan finds each at once
        device_type: Any = msgspec.field(default=-1, name="Device Type")
        device_id: Any = msgspec.field(default=-1, name="Device Id")
        addr: Any = msgspec.field(default=0, name="Addr")
        mem_bytes: Any = msgspec.field(default=0, name="Bytes")
        total_allocated: Any = msgspec.field(default=-1, name="Total Allocated")
        total_reserved: Any = msgspec.field(default=-1, name="Total Reserved")

    # One struct type per Chrome phase, tagged on "ph" (Kineto writes it first): 'X' and 'i'
    # keep their fields (declared in Kineto's key order), every other phase (flow arrows,
    # metadata, counters) is skipped whole.
    class _Complete(msgspec.Struct, tag_field="ph", tag="X", gc=False):
        cat: str = ""
        name: str = ""
        pid: Union[int, str, None] = None
        tid: Union[int, str, None] = None
        ts: float = 0.0
        dur: float = 0.0
        args: Optional[_XArgs] = None

    class _Instant(msgspec.Struct, tag_field="ph", tag="i", gc=False):
        name: str = ""
        ts: float = 0.0
        args: Optional[_MemArgs] = None

    _SKIPPED = tuple(msgspec.defstruct(f"_Phase{ord(t)}", [], tag_field="ph", tag=t, gc=False)
                     for t in "BEIbnesStfPONDMRCc()")
    _Doc = msgspec.defstruct("_Doc", [("traceEvents", list[Union[(_Complete, _Instant, *_SKIPPED)]])]
                             + [(k, Any, None) for k in META_KEYS], gc=False)
    _DECODER = msgspec.json.Decoder(_Doc)
except ImportError:  # pragma: no cover - exercised by forcing the fallback in tests
    msgspec = None


try:  # the one-pass C scan (trainprof/trace/_kineto.c): optional, built with the install
    from trainprof.trace import _kineto
except ImportError:  # pragma: no cover - an install without a C compiler
    _kineto = None


def _typed(data) -> Columns:
    """The columns of a document: the C scan's where it takes the document, else the typed
    decoder's (whose errors, msgspec.ValidationError / DecodeError, pass through)."""
    c = _from_scan(data)
    return c if c is not None else _from_structs(_DECODER.decode(data))


def _from_scan(data) -> Columns | None:
    """The C scan's columns of a document, or None where the typed decoder must decide (a
    document it does not take exactly as _DECODER would, or no C scan in this install)."""
    if _kineto is None or msgspec is None:
        return None
    r = _kineto.scan(data)
    if r is None:
        return None
    try:
        return _scanned_columns(r, memoryview(data))
    except (ValueError, msgspec.DecodeError, RecursionError):
        return None  # a value the typed decoder refuses too (say, a string that is not UTF-8)


def _scanned_columns(r: dict, view: memoryview) -> Columns | None:
    dec = msgspec.json.decode  # values of Any fields: decoded as the typed decoder decodes them
    top = {}
    for key, lo, hi in r["top"]:
        if key in top:  # a repeated top-level key: the typed decoder's rule applies
            return None
        top[key] = (lo, hi)
    c = Columns()
    c.meta = {k: v for k in META_KEYS if k in top
              for v in (dec(view[top[k][0]:top[k][1]]),) if v is not None}
    c.n_events, n = r["n_events"], r["n"]
    c.name, c.cat = _distinct(r["name"], r["names"]), _distinct(r["cat"], r["cats"])
    c.pid, c.tid = (_scanned_ids(r[k], r[k + "_s"], r[k + "_strs"]) for k in ("pid", "tid"))
    c.ts, c.dur = (np.frombuffer(r[k], np.float64).copy() for k in ("ts", "dur"))
    c.stream, c.corr, c.ext = (np.frombuffer(r[k], np.int64).copy() for k in ("stream", "corr", "ext"))
    for col in ("dims", "types", "concrete"):  # one object per distinct value (read-only)
        values = [dec(view[lo:hi]) for lo, hi in r[col + "_spans"]] + [None]
        codes = np.frombuffer(r[col], np.int32)
        setattr(c, col, list(map(values.__getitem__, codes.tolist())) if len(values) > 1
                else [None] * n)
    for row, spans in r["comm"]:
        out = {"row": row}
        for (_, col), span in zip(COMM_KEYS, spans):
            if span is not None:
                v = dec(view[span[0]:span[1]])
                if v is not None:
                    out[col] = v
        c.comm.append(out)
    for (_, col), (codes, spans) in zip(LAUNCH_KEYS, r["launch"]):
        if spans:
            values = np.array([launch_values(col, [dec(view[lo:hi])])[0] for lo, hi in spans]
                              + [np.nan])
            c.launch[col] = values[np.frombuffer(codes, np.int32)]  # code -1: the NaN at the end
    c.mem = r["mem"]
    for lo, hi in r["check"]:  # values the typed decoder decodes and the columns do not keep
        dec(view[lo:hi])
    return c


def _distinct(codes: bytes, values: list) -> tuple[np.ndarray, list]:
    """(codes, distinct values) of a scanned string column: spans that differ only in their
    escapes decode to one value."""
    codes = np.frombuffer(codes, np.int64)
    if len(set(values)) == len(values):
        return codes.copy(), values
    seen: dict = {}
    remap = np.fromiter((seen.setdefault(v, len(seen)) for v in values), np.int64, len(values))
    return remap[codes], list(seen)


def _scanned_ids(values: bytes, str_codes: bytes, strs: list) -> np.ndarray:
    """pid/tid: the scanned integers, a string id through _int_or_missing ("7" is 7)."""
    out = np.frombuffer(values, np.int64).copy()
    if strs:
        idx = np.frombuffer(str_codes, np.int32)
        m = idx >= 0
        out[m] = np.array([int_or_missing(v) for v in strs], np.int64)[idx[m]]
    return out


_NAME, _CAT, _PID, _TID, _TS, _DUR, _ARGS = map(
    attrgetter, ("name", "cat", "pid", "tid", "ts", "dur", "args"))


def _from_structs(doc) -> Columns:
    """The typed decoder's document -> Columns, column at a time through C-level maps over the
    structs (several times faster than one Python loop appending to ten lists)."""
    c = Columns()
    c.meta = {k: getattr(doc, k) for k in META_KEYS if getattr(doc, k) is not None}
    events = doc.traceEvents
    c.n_events = len(events)
    xs = [e for e in events if type(e) is _Complete]
    n = len(xs)
    c.name, c.cat = factorize(map(_NAME, xs), n), factorize(map(_CAT, xs), n)
    c.pid, c.tid = _id_column(map(_PID, xs), n), _id_column(map(_TID, xs), n)
    c.ts = np.fromiter(map(_TS, xs), np.float64, n)
    c.dur = np.fromiter(map(_DUR, xs), np.float64, n)
    args = list(map(_ARGS, xs))
    if args.count(None):
        empty = _XArgs()
        args = [empty if a is None else a for a in args]
    c.stream, c.corr, c.ext = (_int_column(args, attr, n)
                               for attr in ("stream", "correlation", "external_id"))
    lc = _int_column(args, "external_id_lc", n)
    c.ext = np.where(c.ext >= 0, c.ext, lc)
    for (_, col), attr in zip(LAUNCH_KEYS, ("grid", "block", "regs", "smem", "blocks_per_sm",
                                             "warps_per_sm", "occupancy")):
        vals = list(map(attrgetter(attr), args))
        if vals.count(None) != n:
            c.launch[col] = launch_values(col, vals)
    c.dims, c.types, c.concrete = (list(map(attrgetter(attr), args))
                                   for attr in ("input_dims", "input_type", "concrete"))
    old = list(map(attrgetter("input_dims_lc"), args))
    if old.count(None) != n:  # "Input dims" where "Input Dims" is absent or null
        c.dims = [d if d is not None else o for d, o in zip(c.dims, old)]
    c.comm = _comm_rows(args, n)
    inst = [e for e in events if type(e) is _Instant]
    c.mem = [(e.ts, e.args.mem_bytes, e.args.total_allocated, e.args.total_reserved,
              e.args.device_type, e.args.device_id, e.args.addr)
             for e in inst if e.name == "[memory]" and e.args is not None]
    return c


def _id_column(values, n: int) -> np.ndarray:
    """pid/tid values (int, str or None: the decoder admits no other type, so no two distinct
    values compare equal) -> int64 through their few distinct values: a Kineto trace's "Spans"
    pid costs nothing more."""
    codes, uniq = factorize(values, n)
    return ints(uniq)[codes] if uniq else codes


def _int_column(args: list, attr: str, n: int) -> np.ndarray:
    """An int field of the args structs (the decoder checked the type) as int64; one beyond
    int64 is -1."""
    try:
        return np.fromiter(map(attrgetter(attr), args), np.int64, n)
    except OverflowError:
        return ints(list(map(attrgetter(attr), args)))


def _comm_rows(args: list, n: int) -> list[dict]:
    """{"row": i, column: value, ...} for the args with a collective name or a process group
    (list.count skips the None of every other row at C speed)."""
    coll = list(map(attrgetter("collective"), args))
    pg = list(map(attrgetter("pg_name"), args))
    if coll.count(None) == n and pg.count(None) == n:
        return []
    has = np.fromiter(map(is_not, coll, repeat(None)), bool, n)
    has |= np.fromiter(map(is_not, pg, repeat(None)), bool, n)
    rows = []
    for i in np.flatnonzero(has).tolist():
        a = args[i]
        row = {"row": i}
        for _, col in COMM_KEYS:
            v = getattr(a, col)
            if v is not None:
                row[col] = v
        rows.append(row)
    return rows


def _loads(data: bytes):
    try:
        import orjson
    except ImportError:  # a declared dependency, but an install without it still parses
        import json

        try:
            return json.loads(data)
        except ValueError as e:
            raise DecodeError(str(e)) from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise DecodeError(str(e)) from None


def _from_dicts(data: bytes) -> Columns:
    doc = _loads(data)
    if isinstance(doc, list):  # the bare-array form of the Chrome trace format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TypeError("no traceEvents list")
    c = Columns()
    events = doc.pop("traceEvents")
    c.meta = doc
    c.n_events = len(events)
    for e in events:
        if not isinstance(e, dict):
            c.n_bad += 1
            continue
        ph = e.get("ph")
        if ph == "X":
            a = e.get("args")
            a = a if isinstance(a, dict) else {}
            c.name.append(str(e.get("name", "")))
            c.cat.append(str(e.get("cat", "")))
            c.ts.append(_num(e.get("ts")))
            c.dur.append(_num(e.get("dur")))
            c.pid.append(e.get("pid"))
            c.tid.append(e.get("tid"))
            c.stream.append(a.get("stream"))
            c.corr.append(a.get("correlation"))
            ext = a.get("External id")
            if "external id" in a and (-1 if ext is None else ints([ext])[0]) < 0:
                ext = a["external id"]  # PyTorch 1.8-1.10 name
            c.ext.append(ext)
            for key, col in LAUNCH_KEYS:
                if key in a:
                    c.launch.setdefault(col, [None] * (len(c.name) - 1)).append(a[key])
            for col, vals in c.launch.items():
                if len(vals) < len(c.name):
                    vals.append(None)
            dims = a.get("Input Dims")
            c.dims.append(dims if dims is not None else a.get("Input dims"))
            c.types.append(a.get("Input type"))
            c.concrete.append(a.get("Concrete Inputs"))
            if "Collective name" in a or "Process Group Name" in a:
                row = {"row": len(c.name) - 1}
                for key, col in COMM_KEYS:
                    if key in a:
                        row[col] = a[key]
                c.comm.append(row)
        elif ph == "i" and e.get("name") == "[memory]" and isinstance(e.get("args"), dict):
            a = e["args"]
            c.mem.append((_num(e.get("ts")), a.get("Bytes", 0), a.get("Total Allocated", -1),
                          a.get("Total Reserved", -1), a.get("Device Type", -1),
                          a.get("Device Id", -1), a.get("Addr", 0)))
    return c.finish()


def _num(v) -> float:
    if isinstance(v, (int, float)):
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0
