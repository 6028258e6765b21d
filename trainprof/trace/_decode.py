"""Chrome-trace bytes -> plain column lists, in one pass.

Fast path: msgspec decodes straight into slotted structs that declare only the fields we keep,
so the rest of each event (kernel occupancy figures, flow ids, ...) is skipped without creating
Python objects. Fallback (no msgspec, or a trace whose field types surprise the typed decoder):
orjson into dicts. Both run with the cyclic GC paused: the decoders create hundreds of thousands
of containers that are never cyclic, and GC passes over them cost as much as the decode itself.
"""

from __future__ import annotations

import gc
from operator import attrgetter
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
    """What the frame builder needs: parallel lists for 'X' events, tuples for memory events,
    collective-arg rows, and the top-level metadata."""

    __slots__ = ("name", "cat", "ts", "dur", "pid", "tid", "stream", "corr", "ext", "dims",
                 "types", "concrete", "comm", "mem", "meta", "n_events", "n_bad")

    def __init__(self):
        for s in self.__slots__:
            setattr(self, s, [])
        self.meta, self.n_events, self.n_bad = {}, 0, 0


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


def decode(data: bytes, fast: bool = True) -> Columns:
    """Raise DecodeError on invalid JSON, TypeError/ValueError on a JSON that is no trace."""
    was = gc.isenabled()
    gc.disable()
    try:
        if fast and msgspec is not None:
            try:
                return _from_structs(_DECODER.decode(data))
            except msgspec.ValidationError:
                pass  # valid JSON of unexpected shape: the tolerant path sorts it out
            except msgspec.DecodeError as e:
                raise DecodeError(str(e)) from None
        return _from_dicts(data)
    finally:
        if was:
            gc.enable()


def _from_structs(doc) -> Columns:
    # column-at-a-time through C-level map/attrgetter: several times faster than one Python
    # loop appending to ten lists
    c = Columns()
    c.meta = {k: getattr(doc, k) for k in META_KEYS if getattr(doc, k) is not None}
    events = doc.traceEvents
    c.n_events = len(events)
    xs = [e for e in events if type(e) is _Complete]
    n = len(xs)
    for col in ("name", "cat", "pid", "tid"):
        setattr(c, col, list(map(attrgetter(col), xs)))
    c.ts = np.fromiter(map(attrgetter("ts"), xs), np.float64, n)
    c.dur = np.fromiter(map(attrgetter("dur"), xs), np.float64, n)
    empty = _Args()
    args = [empty if a is None else a for a in map(attrgetter("args"), xs)]
    for col, attr in (("stream", "stream"), ("corr", "correlation"), ("ext", "external_id")):
        setattr(c, col, np.fromiter(map(attrgetter(attr), args), np.int64, n))
    c.dims = list(map(attrgetter("input_dims"), args))
    c.types = list(map(attrgetter("input_type"), args))
    c.concrete = list(map(attrgetter("concrete"), args))
    # (object arrays of 123k entries compared elementwise cost 55 ms; a comprehension 10)
    for i in [i for i, a in enumerate(args) if a.collective is not None or a.pg_name is not None]:
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
    return c


def _num(v) -> float:
    if isinstance(v, (int, float)):
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0
