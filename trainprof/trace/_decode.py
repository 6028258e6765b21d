"""Chrome-trace bytes -> plain column lists, in one pass.

Fastest path: the C scan (trainprof/trace/_kineto.c, ``_from_scan``) goes from the JSON bytes
to the columns with no Python object per event, and hands any document it does not take exactly
as the typed decoder would to that decoder (``_typed``).

Typed path: msgspec decodes straight into slotted structs that declare only the fields we keep,
so the rest of each event (kernel occupancy figures, flow ids, ...) is skipped without creating
Python objects. Fallback (no msgspec, or a trace whose field types surprise the typed decoder):
orjson into dicts. Both run with the cyclic GC paused: the decoders create hundreds of thousands
of containers that are never cyclic, and GC passes over them cost as much as the decode itself.

A large trace is decoded in pieces by forked children (``decode(data, pieces=k)``): Kineto writes
one event per block, so ``"\n  },\n  {\n"`` separates two events of the traceEvents array and,
holding raw newlines (never inside a JSON string), cannot fall inside a string. Each piece is
made a document of its own, decoded, and the columns come back pickled; any surprise (another
layout, a child that fails) falls back to decoding the whole document here. A gzip trace is cut
while it inflates (``decode_stream``): a child starts on the first part as soon as it is
inflated, and this process inflates and decodes the last.

Structs -> columns goes a column at a time through C-level maps (``map(attrgetter(f), structs)``
into ``np.fromiter``): ~5 ms per column of 123k events, several times less than one Python loop
appending to every column.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import pickle
import re
from itertools import chain, count, repeat
from operator import attrgetter, is_not
from typing import Any, Optional, Union

import numpy as np

# args keys of PyTorch's record_param_comms / NCCL kernels -> our column names
COMM_KEYS = (("Collective name", "collective"), ("In msg nelems", "in_nelems"),
             ("Out msg nelems", "out_nelems"), ("Group size", "group_size"), ("dtype", "dtype"),
             ("Process Group Name", "pg_name"), ("Process Group Description", "pg_desc"),
             ("Process Group Ranks", "pg_ranks"), ("Seq", "seq"), ("Rank", "coll_rank"),
             ("Src Rank", "src_rank"), ("Dst Rank", "dst_rank"))
# args keys of a kernel's launch figures (Kineto writes them on CUDA kernels; AMD traces have
# grid and block) -> the columns of the launch table (trainprof.trace's docstring): grid and
# block as their product (blocks, threads per block), the others as numbers
LAUNCH_KEYS = (("grid", "grid_blocks"), ("block", "block_threads"),
               ("registers per thread", "regs_per_thread"), ("shared memory", "shared_mem"),
               ("blocks per SM", "blocks_per_sm"), ("warps per SM", "warps_per_sm"),
               ("est. achieved occupancy %", "est_occupancy_pct"))
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
                 "types", "concrete", "comm", "mem", "meta", "n_events", "n_bad", "launch")

    def __init__(self):
        for s in self.__slots__:
            setattr(self, s, [])
        self.meta, self.n_events, self.n_bad = {}, 0, 0
        self.launch = {}  # launch column -> numeric array (launch_values); {} when none

    def __len__(self) -> int:
        return len(self.ts)

    def finish(self) -> "Columns":
        self.name, self.cat = factorize(self.name), factorize(self.cat)
        self.ts, self.dur = np.asarray(self.ts, np.float64), np.asarray(self.dur, np.float64)
        for col in ("pid", "tid", "stream", "corr", "ext"):
            setattr(self, col, ints(getattr(self, col)))
        if isinstance(self.launch, dict) and self.launch and \
                isinstance(next(iter(self.launch.values())), list):
            self.launch = {col: launch_values(col, v) for col, v in self.launch.items()}
        return self


def _launch_number(col: str, v):
    """One launch figure as a number: grid/block the product of their positive integer
    dimensions, integer fields an int, the others a finite float; None where it is not that."""
    if col in ("grid_blocks", "block_threads"):
        if isinstance(v, list) and v and all(type(x) is int and 0 < x < 2**31 for x in v):
            return math.prod(v)
        return None
    if type(v) is bool or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    if col in ("regs_per_thread", "shared_mem"):
        return int(v) if float(v).is_integer() and 0 <= v < 2**62 else None
    return float(v)


def launch_values(col: str, values) -> np.ndarray:
    """Per-row launch figures (objects, None where absent) -> float64 with NaN where absent or
    not a number (grid/block as their product)."""
    n = len(values)
    have = np.flatnonzero(np.fromiter(map(is_not, values, repeat(None)), bool, n))
    out = np.full(n, np.nan)
    if len(have):  # kernels only: the other rows stay NaN without a Python call each
        sub = [values[i] for i in have.tolist()]
        fast = _launch_numbers(col, sub)
        out[have] = fast if fast is not None else np.fromiter(
            (np.nan if (x := _launch_number(col, v)) is None else x for v in sub), np.float64, len(sub))
    return out


def _launch_numbers(col: str, sub: list) -> np.ndarray | None:
    """_launch_number of every value at numpy speed where the values have the usual types (3-int
    lists for grid/block, ints and floats otherwise); None when some value has another type."""
    types = set(map(type, sub))
    if col in ("grid_blocks", "block_threads"):
        if types != {list} or set(map(len, sub)) != {3}:
            return None
        flat = list(chain.from_iterable(sub))
        if set(map(type, flat)) != {int}:  # a float, a bool, a nested list: row by row
            return None
        try:
            a = np.array(flat, np.int64).reshape(-1, 3)
        except OverflowError:
            return None
        ok = np.all((a > 0) & (a < 2**31), axis=1)
        return np.where(ok, np.prod(np.where(ok[:, None], a, 1), axis=1).astype(np.float64), np.nan)
    if not types <= {int, float}:
        return None
    try:
        a = np.array(sub, dtype=np.float64)
    except OverflowError:
        return None
    ok = np.isfinite(a)
    if col in ("regs_per_thread", "shared_mem"):
        ok &= (a == np.floor(a)) & (a >= 0) & (a < 2.0**62)
    return np.where(ok, a, np.nan)


def factorize(values, n: int | None = None) -> tuple[np.ndarray, list]:
    """(codes, distinct values in first-seen order) of a sequence, or of an iterable of n values.
    One pass: each value's dict lookup yields the row where it was first seen, and those rows,
    numbered in order, are the codes (a C-level map; no list of the values is built)."""
    if n is None:
        n = len(values)
    seen: dict = {}
    firsts = np.fromiter(map(seen.setdefault, values, count()), np.int64, n)
    rank = np.empty(n, np.int64)  # first-seen row -> code; the dict keeps first-seen order
    rank[np.fromiter(seen.values(), np.int64, len(seen))] = np.arange(len(seen))
    return rank[firsts], list(seen)


def ints(values) -> np.ndarray:
    """Lists of int/None (rarely str) -> int64 with -1 for missing/non-numeric: a float with an
    integer part in range gives that part, a string of ASCII digits its number ("7" is 7); a
    bool, another string or an int beyond int64 -1."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        return values
    n = len(values)
    # np.fromiter alone would also take bools, numeric strings and any float (garbage beyond
    # int64): the exact type of every value, checked at C speed, says when it is all ints
    if list(map(type, values)).count(int) != n:
        values = [v if type(v) is int else _int_or_missing(v) for v in values]
    try:
        return np.fromiter(values, np.int64, n)
    except OverflowError:  # an int beyond int64
        return np.fromiter((v if -2**63 <= v < 2**63 else -1 for v in values), np.int64, n)


_DIGITS = re.compile(r"[+-]?[0-9]{1,19}")


def _int_or_missing(v) -> int:
    if type(v) is float:
        return int(v) if math.isfinite(v) and abs(v) < 2**63 else -1
    if type(v) is str and _DIGITS.fullmatch(v.strip()):
        i = int(v)
        return i if -2**63 <= i < 2**63 else -1
    return -1


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


# Per piece: fork, copy-on-write faults, pickling and merging cost ~10 ms, the decode of ~2 MB;
# pieces of 8 MB or more pay that back when a CPU is idle (9.8 MB in 2 pieces: this process's
# CPU time 53 -> 37 ms, the child's 36 ms).
PIECE_MIN_BYTES = 8 << 20
# This process's piece, relative to a child's: it also frees its structs and merges the others'
# columns, and a Kineto trace's first part (CPU ops, memory events) has more events per byte.
OWN_SHARE = 0.8
# decode_stream: this process's (last) piece relative to a child's (first) ones. It inflates the
# rest of the file after the last fork and merges the children's columns, but a trace's last
# part (GPU kernels, flows) holds fewer complete events per byte.
STREAM_OWN_SHARE = 1.2
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
                return _typed(data)
            except msgspec.ValidationError:
                pass  # valid JSON of unexpected shape: the tolerant path sorts it out
            except msgspec.DecodeError as e:
                raise DecodeError(str(e)) from None
        return _from_dicts(data)


def _cuts(data: bytes, k: int) -> list[int]:
    """Offsets of the ``}`` closing an event where the traceEvents array can be cut in k parts,
    the first (this process's) OWN_SHARE the size of each other."""
    start = data.find(_EVENTS_AT)
    if start < 0 or k < 2:
        return []
    step = (len(data) - start) / (k - 1 + OWN_SHARE)
    cuts: list[int] = []
    for j in range(1, k):
        at = start + int((j - 1 + OWN_SHARE) * step)
        p = data.find(_BETWEEN, max(at, cuts[-1] + 4 if cuts else start))
        if p < 0:
            break
        cuts.append(p + 3)
    return cuts


def _piece(data: bytes, cuts: list[int], i: int) -> bytes:
    head = b'{"traceEvents": [' if i else b""
    lo = cuts[i - 1] + 2 if i else 0          # past "}," of the previous piece's last event
    hi = cuts[i] + 1 if i < len(cuts) else len(data)
    return b"".join((head, memoryview(data)[lo:hi], b"]}" if i < len(cuts) else b""))  # one copy


def _fork_decoder(make_piece) -> tuple[int, int]:
    """(pid, read end of a pipe) of a forked child that decodes ``make_piece()`` and writes its
    pickled columns to the pipe, then leaves without cleanup."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # child
        code = 1
        try:
            os.close(r)
            out = pickle.dumps(_typed(make_piece()), protocol=5)
            with os.fdopen(w, "wb") as fh:
                fh.write(out)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _collect(kids: list) -> list[Columns] | None:
    """The children's columns in order (``kids`` emptied as they are reaped); None when one
    failed (the caller decodes the whole document, which says what is wrong)."""
    parts = []
    while kids:
        pid, r = kids[0]
        with os.fdopen(r, "rb", closefd=False) as fh:
            payload = fh.read()
        os.close(r)
        kids.pop(0)
        _, status = os.waitpid(pid, 0)
        if status != 0 or not payload:
            return None
        parts.append(pickle.loads(payload))
    return parts


def _reap(kids: list) -> None:
    for pid, r in kids:  # not collected: a failure
        os.close(r)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except OSError:
            pass
    kids.clear()


def _decode_pieces(data: bytes, k: int) -> Columns | None:
    cuts = _cuts(data, k)
    if not cuts:
        return None
    # this process's piece is copied before forking: after it, the first write to each page of
    # the heap the children share costs a copy-on-write fault (a 4x slower copy)
    own = _piece(data, cuts, 0)
    kids: list = []
    try:
        for i in range(1, len(cuts) + 1):
            kids.append(_fork_decoder(lambda i=i: _piece(data, cuts, i)))
        parts = [_typed(own)]
        del own
        rest = _collect(kids)
        if rest is None:
            return None  # the whole document, decoded here, says what is wrong
        parts += rest
    except (msgspec.ValidationError, msgspec.DecodeError, OSError, pickle.UnpicklingError, EOFError):
        return None
    finally:
        _reap(kids)
    return _concat(parts)


class _Spans:
    """Byte ranges of a document held as the chunks it was inflated in (no joined copy)."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.starts: list[int] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.starts.append(self.size)
        self.size += len(chunk)

    def views(self, lo: int, hi: int) -> list:
        out = []
        for c, s in zip(self.chunks, self.starts):
            if s + len(c) <= lo or s >= hi:
                continue
            out.append(memoryview(c)[max(lo - s, 0):min(hi - s, len(c))])
        return out

    def joined(self) -> bytes:
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)


def decode_stream(chunks, size_hint: int, pieces: int, fast: bool = True):
    """Decode a document as it is inflated: once ``chunks`` (an iterator of its bytes) has
    passed each of the first pieces' share of ``size_hint`` bytes, a forked child decodes that
    piece while this process inflates the rest, then decodes the last piece itself. Returns
    (columns, None, size, True) or, when it did not decode the document (a small one, no fork,
    another layout, a piece that failed), (None, the document's bytes, size, whether pieces were
    tried) for ``decode``. Errors of ``chunks`` (input limits, corrupt gzip) pass
    through, after any children are stopped."""
    spans = _Spans()
    k = min(pieces, size_hint // PIECE_MIN_BYTES)
    if not (fast and msgspec is not None and hasattr(os, "fork") and k >= 2):
        for ch in chunks:
            spans.add(ch)
        return None, spans.joined(), spans.size, False
    unit = size_hint / (k - 1 + STREAM_OWN_SHARE)
    cuts: list[int] = []        # offsets of the "}" closing each child's last event
    kids: list = []
    failed = False              # a fork that failed: no more pieces, the document decoded whole
    with gc_paused():
        try:
            for ch in chunks:  # its errors (input limits, corrupt gzip) propagate
                spans.add(ch)
                if failed or len(cuts) >= k - 1 or spans.size < (len(cuts) + 1) * unit:
                    continue
                if not cuts and spans.chunks[0].find(_EVENTS_AT, 0, 1 << 24) < 0:
                    failed = True  # not Kineto's layout
                    continue
                at = max(int((len(cuts) + 1) * unit) - spans.starts[-1], 0)
                p = ch.find(_BETWEEN, at)
                if p < 0:
                    continue  # the next chunk holds the cut
                cut = spans.starts[-1] + p + 3
                lo = cuts[-1] + 2 if cuts else 0
                head = b'{"traceEvents": [' if lo else b""
                views = spans.views(lo, cut + 1)
                try:
                    kids.append(_fork_decoder(lambda h=head, v=views: b"".join((h, *v, b"]}"))))
                except OSError:
                    failed = True
                    continue
                cuts.append(cut)
            if failed or not kids:
                return None, spans.joined(), spans.size, bool(kids)
            own = b"".join((b'{"traceEvents": [', *spans.views(cuts[-1] + 2, spans.size)))
            try:
                last = _typed(own)
            except (msgspec.ValidationError, msgspec.DecodeError):
                last = None
            del own
            try:
                parts = _collect(kids) if last is not None else None
            except (OSError, pickle.UnpicklingError, EOFError):
                parts = None
        finally:
            _reap(kids)
    if parts is None:
        return None, spans.joined(), spans.size, True
    return _concat(parts + [last]), None, spans.size, True


def _concat(parts: list[Columns]) -> Columns:
    c = Columns()
    offset = 0
    for p in parts:
        for k, v in p.meta.items():
            c.meta.setdefault(k, v)
        for col in ("dims", "types", "concrete", "mem"):
            getattr(c, col).extend(getattr(p, col))
        for col in set(c.launch) | set(p.launch):  # absent in a part: NaN rows
            c.launch[col] = np.concatenate([c.launch.get(col, np.full(offset, np.nan)),
                                            p.launch.get(col, np.full(len(p), np.nan))])
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
        out[m] = np.array([_int_or_missing(v) for v in strs], np.int64)[idx[m]]
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
