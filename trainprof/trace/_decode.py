"""Chrome-trace bytes -> plain column lists, in one pass.

Fast path: msgspec decodes straight into slotted structs that declare only the fields we keep,
so the rest of each event (kernel occupancy figures, flow ids, ...) is skipped without creating
Python objects. Fallback (no msgspec, or a trace whose field types surprise the typed decoder):
orjson into dicts. Both run with the cyclic GC paused: the decoders create hundreds of thousands
of containers that are never cyclic, and GC passes over them cost as much as the decode itself.

A large trace is decoded in pieces by forked children (``decode(data, pieces=k)``): Kineto writes
one event per block, so ``"\n  },\n  {\n"`` separates two events of the traceEvents array and,
holding raw newlines (never inside a JSON string), cannot fall inside a string. Each piece is
made a document of its own, decoded, and the columns come back pickled; any surprise (another
layout, a child that fails) falls back to decoding the whole document here.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import pickle
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, Optional, Union

import numpy as np

# args keys of PyTorch's record_param_comms / NCCL kernels -> our column names
COMM_KEYS = (("Collective name", "collective"), ("In msg nelems", "in_nelems"),
             ("Out msg nelems", "out_nelems"), ("Group size", "group_size"), ("dtype", "dtype"),
             ("Process Group Name", "pg_name"), ("Process Group Description", "pg_desc"),
             ("Process Group Ranks", "pg_ranks"), ("Seq", "seq"), ("Rank", "coll_rank"),
             ("Src Rank", "src_rank"), ("Dst Rank", "dst_rank"))
META_KEYS = ("schemaVersion", "deviceProperties", "distributedInfo", "baseTimeNanoseconds",
             "displayTimeUnit", "traceName", "record_shapes", "profile_memory", "with_stack",
             "with_flops", "trace_id", "host_name")


class DecodeError(Exception):
    """The bytes are not JSON (message says where)."""


class Columns:
    """What the frame builder needs: parallel columns for 'X' events (name and cat factorized:
    (int64 codes, distinct values in first-seen order); ts, dur float64; pid, tid, stream, corr,
    ext int64 with -1 for missing; dims, types, concrete lists), tuples for memory events,
    collective-arg rows, and the top-level metadata. ``finish()`` turns the lists the tolerant
    path appends to into those arrays."""

    __slots__ = ("name", "cat", "ts", "dur", "pid", "tid", "stream", "corr", "ext", "dims",
                 "types", "concrete", "comm", "mem", "meta", "n_events", "n_bad")

    def __init__(self):
        for s in self.__slots__:
            setattr(self, s, [])
        self.meta, self.n_events, self.n_bad = {}, 0, 0

    def __len__(self) -> int:
        return len(self.ts)

    def finish(self) -> "Columns":
        self.name, self.cat = factorize(self.name), factorize(self.cat)
        self.ts, self.dur = np.asarray(self.ts, np.float64), np.asarray(self.dur, np.float64)
        for col in ("pid", "tid", "stream", "corr", "ext"):
            setattr(self, col, ints(getattr(self, col)))
        return self


def factorize(values) -> tuple[np.ndarray, list]:
    """(codes, distinct values in first-seen order) from one C-level dict build (few names,
    many events) and a dict lookup per value: 4x faster than pd.Categorical(values)."""
    seen = dict.fromkeys(values)
    for i, k in enumerate(seen):
        seen[k] = i
    return np.fromiter(map(seen.__getitem__, values), np.int64, len(values)), list(seen)


def ints(values) -> np.ndarray:
    """Lists of int/None (rarely str) -> int64 with -1 for missing/non-numeric."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        return values
    n = len(values)
    try:
        return np.fromiter(values, np.int64, n)  # all ints: one C loop
    except (TypeError, ValueError, OverflowError):
        pass
    # a few strings ("Spans", "Traces" pids) or None: ints pass through a comprehension (7 ms
    # for 123k; np.array(values, float) walked them all before failing on a string: 0.4 s)
    vals = [v if type(v) is int else _int_or_missing(v) for v in values]
    try:
        return np.fromiter(vals, np.int64, n)
    except OverflowError:  # an int beyond int64
        return np.fromiter((v if -2**63 <= v < 2**63 else -1 for v in vals), np.int64, n)


def _int_or_missing(v) -> int:
    return int(v) if type(v) is float and math.isfinite(v) and abs(v) < 2**63 else -1


try:  # msgspec: optional accelerator
    import msgspec

    class _Args(msgspec.Struct, gc=False):
        # -1 defaults (not None) so these columns go straight into int64 arrays
        stream: int = -1
        correlation: int = -1
        external_id: int = msgspec.field(default=-1, name="External id")
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
        mem_bytes: Any = msgspec.field(default=0, name="Bytes")
        total_allocated: Any = msgspec.field(default=-1, name="Total Allocated")
        total_reserved: Any = msgspec.field(default=-1, name="Total Reserved")
        device_type: Any = msgspec.field(default=-1, name="Device Type")
        device_id: Any = msgspec.field(default=-1, name="Device Id")
        addr: Any = msgspec.field(default=0, name="Addr")

    # One struct type per Chrome phase, tagged on "ph" (Kineto writes it first): 'X' and 'i'
    # keep their fields, every other phase (flow arrows, metadata, counters) is skipped whole.
    class _Complete(msgspec.Struct, tag_field="ph", tag="X", gc=False):
        name: str = ""
        cat: str = ""
        pid: Union[int, str, None] = None
        tid: Union[int, str, None] = None
        ts: float = 0.0
        dur: float = 0.0
        args: Optional[_Args] = None

    class _Instant(msgspec.Struct, tag_field="ph", tag="i", gc=False):
        name: str = ""
        ts: float = 0.0
        args: Optional[_Args] = None

    _SKIPPED = tuple(msgspec.defstruct(f"_Phase{ord(t)}", [], tag_field="ph", tag=t, gc=False)
                     for t in "BEIbnesStfPONDMRCc()")
    _Doc = msgspec.defstruct("_Doc", [("traceEvents", list[Union[(_Complete, _Instant, *_SKIPPED)]])]
                             + [(k, Any, None) for k in META_KEYS], gc=False)
    _DECODER = msgspec.json.Decoder(_Doc)
except ImportError:  # pragma: no cover - exercised by forcing the fallback in tests
    msgspec = None


@contextlib.contextmanager
def gc_paused():
    """The cyclic GC off for a block that builds many non-cyclic containers (nests)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


PIECE_MIN_BYTES = 16 << 20  # per piece: smaller ones cost more in fork + pickling than they save
_EVENTS_AT = b'\n  "traceEvents": ['
_BETWEEN = b"\n  },\n  {\n"


def decode(data: bytes, fast: bool = True, pieces: int = 1) -> Columns:
    """Raise DecodeError on invalid JSON, TypeError/ValueError on a JSON that is no trace.
    pieces > 1: decode that many parts of a large Kineto trace in parallel processes."""
    with gc_paused():
        if fast and msgspec is not None:
            try:
                if pieces > 1 and hasattr(os, "fork"):
                    c = _decode_pieces(data, min(pieces, len(data) // PIECE_MIN_BYTES))
                    if c is not None:
                        return c
                return _from_structs(_DECODER.decode(data))
            except msgspec.ValidationError:
                pass  # valid JSON of unexpected shape: the tolerant path sorts it out
            except msgspec.DecodeError as e:
                raise DecodeError(str(e)) from None
        return _from_dicts(data)


def _cuts(data: bytes, k: int) -> list[int]:
    """Offsets of the ``}`` closing an event where the traceEvents array can be cut in k parts."""
    start = data.find(_EVENTS_AT)
    if start < 0 or k < 2:
        return []
    cuts, step = [], (len(data) - start) // k
    for j in range(1, k):
        p = data.find(_BETWEEN, max(start + j * step, cuts[-1] + 4 if cuts else start))
        if p < 0:
            break
        cuts.append(p + 3)
    return cuts


def _piece(data: bytes, cuts: list[int], i: int) -> bytes:
    head = b'{"traceEvents": [' if i else b""
    lo = cuts[i - 1] + 2 if i else 0          # past "}," of the previous piece's last event
    hi = cuts[i] + 1 if i < len(cuts) else len(data)
    return b"".join((head, memoryview(data)[lo:hi], b"]}" if i < len(cuts) else b""))  # one copy


def _decode_pieces(data: bytes, k: int) -> Columns | None:
    cuts = _cuts(data, k)
    if not cuts:
        return None
    kids = []
    try:
        for i in range(1, len(cuts) + 1):
            r, w = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(r)
                os.close(w)
                raise
            if pid == 0:  # child: decode one piece, send its columns, leave without cleanup
                code = 1
                try:
                    os.close(r)
                    out = pickle.dumps(_from_structs(_DECODER.decode(_piece(data, cuts, i))), protocol=5)
                    with os.fdopen(w, "wb") as fh:
                        fh.write(out)
                    code = 0
                finally:
                    os._exit(code)
            os.close(w)
            kids.append((pid, r))
        parts = [_from_structs(_DECODER.decode(_piece(data, cuts, 0)))]
        while kids:
            pid, r = kids[0]
            with os.fdopen(r, "rb", closefd=False) as fh:
                payload = fh.read()
            os.close(r)
            kids.pop(0)
            _, status = os.waitpid(pid, 0)
            if status != 0 or not payload:
                return None  # the whole document, decoded here, says what is wrong
            parts.append(pickle.loads(payload))
    except (msgspec.ValidationError, msgspec.DecodeError, OSError, pickle.UnpicklingError, EOFError):
        return None
    finally:
        for pid, r in kids:  # not collected: a failure above
            os.close(r)
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except OSError:
                pass
    return _concat(parts)


def _concat(parts: list[Columns]) -> Columns:
    c = Columns()
    offset = 0
    for p in parts:
        for k, v in p.meta.items():
            c.meta.setdefault(k, v)
        for col in ("dims", "types", "concrete", "mem"):
            getattr(c, col).extend(getattr(p, col))
        for row in p.comm:
            row["row"] += offset
            c.comm.append(row)
        c.n_events += p.n_events
        c.n_bad += p.n_bad
        offset += len(p)
    for col in ("ts", "dur", "pid", "tid", "stream", "corr", "ext"):
        setattr(c, col, np.concatenate([getattr(p, col) for p in parts]))
    for col in ("name", "cat"):  # one set of distinct values, codes renumbered into it
        seen: dict = {}
        codes = []
        for p in parts:
            pc, pv = getattr(p, col)
            remap = np.fromiter((seen.setdefault(v, len(seen)) for v in pv), np.int64, len(pv))
            codes.append(remap[pc] if len(pc) else pc)
        setattr(c, col, (np.concatenate(codes), list(seen)))
    return c


def _from_structs(doc) -> Columns:
    # column-at-a-time through C-level map/attrgetter: several times faster than one Python
    # loop appending to ten lists
    c = Columns()
    c.meta = {k: getattr(doc, k) for k in META_KEYS if getattr(doc, k) is not None}
    events = doc.traceEvents
    c.n_events = len(events)
    xs = [e for e in events if type(e) is _Complete]
    n = len(xs)
    for col in ("name", "cat"):
        setattr(c, col, factorize(list(map(attrgetter(col), xs))))
    for col in ("pid", "tid"):
        setattr(c, col, ints(list(map(attrgetter(col), xs))))
    c.ts = np.fromiter(map(attrgetter("ts"), xs), np.float64, n)
    c.dur = np.fromiter(map(attrgetter("dur"), xs), np.float64, n)
    empty = _Args()
    args = [empty if a is None else a for a in map(attrgetter("args"), xs)]
    for col, attr in (("stream", "stream"), ("corr", "correlation"), ("ext", "external_id")):
        setattr(c, col, np.fromiter(map(attrgetter(attr), args), np.int64, n))
    c.dims = list(map(attrgetter("input_dims"), args))
    c.types = list(map(attrgetter("input_type"), args))
    c.concrete = list(map(attrgetter("concrete"), args))
    # rows with collective args, by C-level maps (a comprehension over the structs: 25 ms)
    has = np.fromiter(map(is_not, map(attrgetter("collective"), args), repeat(None)), bool, n)
    has |= np.fromiter(map(is_not, map(attrgetter("pg_name"), args), repeat(None)), bool, n)
    for i in np.flatnonzero(has).tolist():
        a = args[i]
        row = {"row": int(i)}
        for _, col in COMM_KEYS:
            v = getattr(a, col)
            if v is not None:
                row[col] = v
        c.comm.append(row)
    inst = [e for e in events if type(e) is _Instant]
    c.mem = [(e.ts, e.args.mem_bytes, e.args.total_allocated, e.args.total_reserved,
              e.args.device_type, e.args.device_id, e.args.addr)
             for e in inst if e.name == "[memory]" and e.args is not None]
    return c


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
            c.ext.append(a.get("External id"))
            c.dims.append(a.get("Input Dims"))
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
