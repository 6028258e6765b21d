"""Fast reading of the per-rank JSONL streams: records and all-rank frames.

Same results as ``list(rundir.iter_jsonl(path, problems, stream))`` and as a DataFrame built
from every rank's records (``pd.DataFrame([{"rank": r, **rec}, ...])``: same columns, order,
dtypes and values), at a fraction of the time and memory:

- lines are parsed with orjson, and the documented field types (trainprof/rundir/schema.py)
  are checked per column (one pass over each field's values, bounds with numpy) instead of per
  record; a file where anything is off (a malformed line, a wrongly typed field, a value orjson
  does not read, such as NaN) is read again by ``iter_jsonl``, which skips and reports exactly
  as before;
- a frame is built a chunk of ranks at a time, each column converted to a compact array at
  once (int64 / float64 / bool, strings shared), without keeping every rank's record dicts:
  at 1,000 ranks the collective log is ~700,000 records.
"""

from __future__ import annotations

import json
from itertools import chain
from operator import itemgetter
import os
from pathlib import Path

import numpy as np

from trainprof.rundir import schema as rundir_schema
from trainprof import safeio
from trainprof.rundir.files import iter_jsonl

try:
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - a dependency; the standard parser is exact, only slower
    _loads = json.loads

# orjson reads integers beyond 64 bits as floats, json as integers (which the schema refuses):
# a file with a run of 20 digits, or of 19 after a minus, goes to the careful reader
_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_LONG, _LONG_NEG = b"0" * 20, b"-" + b"0" * 19
CHUNK_ROWS = 20_000  # records converted to arrays at a time (bounds their transient objects)


class _Missing:
    """A record without the field (pandas fills NaN there, unlike an explicit null)."""

    __slots__ = ()


MISSING = _Missing()
_MISS_T = _Missing


def _parse(data: bytes) -> list | None:
    """The records of a stream's bytes, or None when the careful reader must decide (a line
    orjson cannot read, a line that is not an object, a blank line of spaces)."""
    zeros = data.translate(_DIGITS)
    if _LONG in zeros or _LONG_NEG in zeros:
        return None
    del zeros
    lines = data.split(b"\n")
    tail = lines.pop()
    try:
        recs = [_loads(x) for x in lines if x]
    except (ValueError, RecursionError):
        return None
    if tail.strip():
        try:
            recs.append(_loads(tail))
        except (ValueError, RecursionError):
            try:  # a torn last line is skipped silently, as iter_jsonl does
                json.loads(tail)
                return None
            except (ValueError, RecursionError):
                pass
    if not all(type(r) is dict for r in recs):
        return None
    return recs


def _columns(recs: list[dict]) -> tuple[list[str], dict[str, list], dict[str, set]]:
    """Keys in first-appearance order, each key's values (MISSING where absent), value types."""
    keys = list(recs[0]) if recs else []
    cols = None
    if keys and set(map(len, recs)) == {len(keys)}:
        try:  # every record has the first one's keys (the usual case): transpose at C speed
            rows = list(map(itemgetter(*keys), recs))
            cols = {keys[0]: rows} if len(keys) == 1 else dict(zip(keys, map(list, zip(*rows))))
        except KeyError:
            pass
    if cols is None:
        keys = list(dict.fromkeys(chain.from_iterable(recs)))
        cols = {k: [r.get(k, MISSING) for r in recs] for k in keys}
    return keys, cols, {k: set(map(type, v)) for k, v in cols.items()}


def _ints_within(ints: list, lo, hi) -> bool:
    """lo <= x < hi for every int, exactly (bounds may be floats)."""
    if not ints:
        return True
    try:
        a = np.asarray(ints, dtype=np.int64)
        mn, mx = int(a.min()), int(a.max())
    except OverflowError:
        mn, mx = min(ints), max(ints)
    return lo <= mn and mx < hi


def _field_ok(f: rundir_schema.Field, vals: list, types: set) -> bool:
    """Every value of the column passes f (record_error's test; null / absent pass)."""
    present = types - {type(None), _MISS_T}
    if not present:
        return True
    if not present <= f.types:
        return False
    if f.lo is None and f.extra is None:
        return True
    xs = vals if len(present) == len(types) else [x for x in vals if x is not None and x is not MISSING]
    if len(present) == 1:
        ints = xs if int in present else []
        floats = xs if float in present else []
    else:
        ints = [x for x in xs if type(x) is int]
        floats = [x for x in xs if type(x) is float]
    if f.lo is not None:
        if not _ints_within(ints, f.lo, f.hi):
            return False
        if floats:
            a = np.asarray(floats, dtype=np.float64)
            if not (np.isfinite(a).all() and f.lo <= float(a.min()) and float(a.max()) < f.hi):
                return False
    if f.extra is not None:
        if f is rundir_schema.NUM:  # floats pass; integers must fit in 64 bits
            return _ints_within(ints, -(2 ** 63), 2 ** 63)
        if f is rundir_schema.INTS:  # member lists: 1,000 ranks name 1,000 members each
            return all(not v or (set(map(type, v)) == {int} and _ints_within(v, -(2 ** 63), 2 ** 63))
                       for v in xs)
        return all(f.extra(x) for x in xs)
    return True


def _valid(stream: str | None, keys, cols, types) -> bool:
    """Every record passes rundir_schema.record_error (checked per column)."""
    if not stream:
        return True
    spec = rundir_schema.STREAMS.get(stream)
    if spec is None:
        return True
    for k in rundir_schema.REQUIRED.get(stream, ()):
        if k not in types or types[k] & {type(None), _MISS_T}:
            return False
    nested = rundir_schema.STREAM_NESTED.get(stream) or {}
    for k in keys:
        f = spec.get(k)
        if f is not None and not _field_ok(f, cols[k], types[k]):
            return False
        sub = nested.get(k)
        if sub is not None:
            for v in cols[k]:
                if v is None or v is MISSING:
                    continue
                for x in (v if type(v) is list else (v,)):
                    if type(x) is not dict or rundir_schema.record_error(sub, (), x):
                        return False
    return True


def _read(path: Path, problems: list[str] | None, stream: str | None):
    """(records, their columns as _columns gives them), records as iter_jsonl gives them."""
    try:
        data = safeio.read_limited(path, what="stream")
    except OSError:
        data = None
    recs = _parse(data) if data is not None else None
    del data
    if recs is not None:
        cols = _columns(recs)
        if not recs or _valid(stream, *cols):
            return recs, cols
    recs = list(iter_jsonl(path, problems, stream))  # skips and says why, as it always did
    return recs, _columns(recs)


# fields that hold a member list: every member of a 1,000-rank group writes the same 1,000
# ranks, so equal lists are kept once per run (``shared``), not once per rank
MEMBER_LISTS = {"groups": ("ranks",), "nan": ("replay_with",)}


def read_records(path: Path, problems: list[str] | None, stream: str | None,
                 shared: dict | None = None) -> list[dict]:
    """``list(iter_jsonl(path, problems, stream))``, fast when the file is clean. ``shared``: a
    run-wide table through which equal member lists become one list object, and long lines
    already read clean on another rank are not parsed again (see _read_known)."""
    fields = MEMBER_LISTS.get(stream or "")
    if fields and shared is not None:
        recs = _read_known(path, stream, fields, shared)
        if recs is not None:
            return recs
    recs = _read(path, problems, stream)[0]
    if fields and shared is not None:
        _share(recs, fields, shared)
    return recs


def _share(recs: list[dict], fields, shared: dict) -> None:
    for rec in recs:
        for k in fields:
            v = rec.get(k)
            if type(v) is list and len(v) > 8:
                try:
                    rec[k] = shared.setdefault(tuple(v), v)
                except TypeError:  # unhashable members (checked later, or not at all)
                    pass


SAME_LINE_MIN = 1024  # bytes: a line this long is remembered (a member list, as a rule)
_PLAIN = (str, int, float, bool, type(None))


def _read_known(path: Path, stream: str, fields, shared: dict) -> list[dict] | None:
    """The records of a clean stream file whose long lines may repeat other ranks' lines
    verbatim (every member of a group writes the same groups.jsonl line, and the NaN watch's
    root record, 4,096 members long at 4,096 ranks: parsing and checking them on every rank costs
    ranks x group size); a line seen clean before is not parsed again. None when the file is
    not clean (or empty, or torn at its end): the ordinary reader decides and reports."""
    seen = shared.setdefault(("lines", stream), {})
    try:
        data = safeio.read_limited(path, what="stream")
    except OSError:
        return None
    lines = data.split(b"\n")
    del data
    if lines[-1]:
        return None
    body = [x for x in lines if x]
    if not body:
        return None
    new = [x for x in body if x not in seen]
    fresh: list[dict] = []
    if new:  # the checks hold record by record: the new lines alone are checked
        fresh = _parse(b"\n".join(new) + b"\n")
        if fresh is None or len(fresh) != len(new) or not _valid(stream, *_columns(fresh)):
            return None
        _share(fresh, fields, shared)
        for x, rec in zip(new, fresh):
            if len(x) >= SAME_LINE_MIN and x not in seen \
                    and all(type(v) in _PLAIN or k in fields for k, v in rec.items()):
                seen[x] = dict(rec)
    it, was_new = iter(fresh), set(new)
    return [next(it) if x in was_new else dict(seen[x]) for x in body]


# --------------------------------------------------------------------------- frames


_DTYPE_CACHE: dict[frozenset, object] = {}
_REPS = {int: 1, float: 1.5, type(None): None, str: "a", bool: True}


def _final_dtype(types: frozenset):
    """The dtype pandas gives a column of records holding values of ``types`` (MISSING: rows
    without the field), asked of pandas itself on one representative per type."""
    if types not in _DTYPE_CACHE:
        import pandas as pd

        rows = [{} if t is _MISS_T else {"x": _REPS.get(t, [1])} for t in types]
        _DTYPE_CACHE[types] = pd.DataFrame(rows)["x"].dtype
    return _DTYPE_CACHE[types]


class _Chunk:
    """One column's values for a chunk of rows: a compact array when the values are all of one
    plain type, else the values themselves (object array, strings shared)."""

    __slots__ = ("kind", "arr", "n", "missing")

    def __init__(self, vals, types: set, n: int, strings: dict):
        self.n, self.missing = n, _MISS_T in types
        if vals is None:
            self.kind, self.arr = "missing", None
        elif isinstance(vals, np.ndarray):
            self.kind, self.arr = "int", vals
        elif types == {int}:
            try:
                self.kind, self.arr = "int", np.array(vals, dtype=np.int64)
            except OverflowError:
                self.kind, self.arr = "obj", _objects(vals, n)
        elif types == {float}:
            self.kind, self.arr = "float", np.array(vals, dtype=np.float64)
        elif types == {bool}:
            self.kind, self.arr = "bool", np.array(vals, dtype=bool)
        else:
            if types == {str}:  # one object per distinct string
                vals = list(map(strings.setdefault, vals, vals))
            elif str in types:
                vals = [strings.setdefault(v, v) if type(v) is str else v for v in vals]
            self.kind, self.arr = "obj", _objects(vals, n)

    def as_float(self) -> np.ndarray:
        if self.kind == "missing":
            return np.full(self.n, np.nan)
        if self.kind == "obj":  # numbers and nulls (numpy reads None as NaN)
            vals = self.arr.tolist()
            if self.missing:
                vals = [None if v is MISSING else v for v in vals]
            return np.array(vals, dtype=np.float64)
        return self.arr.astype(np.float64)

    def as_object(self) -> np.ndarray:
        if self.kind == "missing":
            return np.full(self.n, np.nan, dtype=object)
        if self.kind == "obj":
            if not self.missing:
                return self.arr
            a = self.arr.copy()
            a[np.fromiter((v is MISSING for v in a), dtype=bool, count=len(a))] = np.nan
            return a
        return self.arr.astype(object)


def _objects(vals: list, n: int) -> np.ndarray:
    a = np.empty(n, dtype=object)
    a[:] = vals
    return a


class FrameBuilder:
    """Rows appended a rank at a time; columns converted a chunk of rows at a time."""

    def __init__(self):
        self.keys: dict[str, None] = {"rank": None}
        self.types: dict[str, set] = {}
        self.chunks: list[tuple[int, dict[str, _Chunk]]] = []
        self._pending: list[tuple[int, list[dict]]] = []
        self._pending_rows = 0
        self._strings: dict[str, str] = {}

    def add(self, rank: int, n: int, cols: tuple) -> None:
        """A rank's ``n`` records as _columns(records) gives them."""
        keys, values, types = cols
        if n:
            self._pending.append((rank, n, keys, values, types))
            self._pending_rows += n
            if self._pending_rows >= CHUNK_ROWS:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        n = sum(p[1] for p in pending)
        ranks = np.repeat(np.array([p[0] for p in pending], dtype=np.int64), [p[1] for p in pending])
        for p in pending:
            for k in p[2]:
                self.keys.setdefault(k, None)
        chunk = {}
        for k in self.keys:
            vals, t = [], set()
            for _, m, keys, values, types in pending:
                if k in values:
                    vals += values.pop(k)
                    t |= types[k]
                else:
                    vals += [MISSING] * m
                    t.add(_MISS_T)
            if k == "rank":
                if t == {_MISS_T}:
                    vals, t = ranks, {int}
                else:  # a record's own "rank" wins over the folder's, as {"rank": r, **rec}
                    vals = [v if v is not MISSING else r for v, r in zip(vals, ranks.tolist())]
                    t = set(map(type, vals))
            elif t == {_MISS_T}:
                vals = None  # not in this chunk at all
            self.types.setdefault(k, set()).update(t)
            chunk[k] = _Chunk(vals, t, n, self._strings)
        self.chunks.append((n, chunk))
        if len(self.chunks) % TRIM_EVERY == 0:
            release_memory()

    def frame(self):
        import pandas as pd

        self._flush()
        if not self.chunks:
            return pd.DataFrame()
        data = {}
        for k in self.keys:
            t = set(self.types.get(k, set()))
            parts = []
            for n, c in self.chunks:
                ch = c.get(k)
                if ch is None:  # a chunk made before the key first appeared
                    ch = _Chunk(None, {_MISS_T}, n, self._strings)
                    t.add(_MISS_T)
                parts.append(ch)
            dtype = _final_dtype(frozenset(t))
            if dtype == np.int64 and all(p.kind == "int" for p in parts):
                data[k] = np.concatenate([p.arr for p in parts])
            elif dtype == np.float64:
                data[k] = np.concatenate([p.as_float() for p in parts])
            elif dtype == np.bool_ and all(p.kind == "bool" for p in parts):
                data[k] = np.concatenate([p.arr for p in parts])
            else:
                obj = np.concatenate([p.as_object() for p in parts])
                data[k] = obj if dtype == object else pd.array(obj, dtype=dtype)
            for _, c in self.chunks:  # free each column's chunks once it is built
                c.pop(k, None)
        return pd.DataFrame(data, copy=False)


def release_memory() -> None:
    """Give the memory freed since the last call back to the system (glibc keeps freed heap
    pages of the many small objects a parse leaves behind; elsewhere a no-op)."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            _TRIM = libc.malloc_trim
            # arrays of 128 KB and more in their own mappings, returned when freed (glibc
            # otherwise raises that threshold as large blocks are freed, and the heap grows)
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None
TRIM_EVERY = 10  # chunks


class Tails:
    """Each rank's last record, kept as text in one buffer: a dict per rank left alive among the
    records read and dropped would pin the allocator's memory (hundreds of MB at 4,000 ranks)."""

    def __init__(self):
        self._buf = bytearray()
        self._at: dict[int, tuple[int, int]] = {}

    def put(self, rank: int, rec: dict | None) -> None:
        if rec is None:
            self._at.pop(rank, None)
            return
        b = json.dumps(rec, allow_nan=True).encode()  # json.loads gives the same record back
        self._at[rank] = (len(self._buf), len(b))
        self._buf += b

    def get(self, rank: int, default=None):
        at = self._at.get(rank)
        return default if at is None else json.loads(self._buf[at[0]:at[0] + at[1]])


class NoRecords:
    """The frame of a stream no rank can hold (a "run" of bare profiler traces or allocator
    snapshots has no rank folders), standing in for an empty DataFrame so that such a run never
    imports pandas: ``.empty``, ``len()``, ``.columns`` (none), iteration and ``in`` answer
    here; any other attribute or a lookup is answered by a real empty DataFrame (pandas is
    imported then)."""

    __slots__ = ()
    empty = True
    columns = ()

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())

    def __contains__(self, name) -> bool:
        return False

    def __getitem__(self, key):
        return self._frame()[key]

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and the like ask for these: not a frame's
            raise AttributeError(name)
        return getattr(self._frame(), name)

    @staticmethod
    def _frame():
        import pandas as pd

        return pd.DataFrame()

    def __repr__(self) -> str:
        return "NoRecords()"


NO_RECORDS = NoRecords()


def _read_ring(run, r: int, name: str):
    """(records, columns) of a rank's stream: ``<name>.prev.jsonl`` (the older half of a
    bounded capture's ring, when there is one) then ``<name>.jsonl``."""
    p = run.stream_path(r, name)
    prev = p.with_name(f"{name}.prev.jsonl")
    if name == "collectives":  # bounded capture: the ring's newest bytes, the detail windows
        # lazy: breaks a cycle rundir.streams<->rundir.series
        from trainprof.rundir import series as rundir_series

        if rundir_series.has_compact(run, r):
            from trainprof.rundir import detail as rundir_detail  # lazy: breaks a cycle rundir.streams<->rundir.detail

            recs, cols = rundir_detail.detail_with_columns(run, r, read_records)
            return recs, (cols if cols is not None or not recs else _columns(recs))
    got = _read(p, run.problems, name) if run.stream_file_ok(r, p) else ([], None)
    if not (os.path.lexists(prev) and run.stream_file_ok(r, prev)):
        return got
    recs = _read(prev, run.problems, name)[0] + got[0]
    return recs, (_columns(recs) if recs else None)


def build_frame(run, name: str):
    """All ranks' records of stream ``name`` as one DataFrame with a ``rank`` column, as
    ``pd.DataFrame([{"rank": r, **rec} for r in run.ranks for rec in run.stream(r, name)])``
    would give, without caching every rank's records (ranks already read are reused)."""
    release_memory()  # (the first call sets the allocator up)
    b = FrameBuilder()
    cache = run._cache
    tails = cache.setdefault("tails:" + name, Tails())  # each rank's last record (stream_tail)
    for r in run.ranks:
        recs = cache.get(f"stream:{name}:{r}")
        if recs is not None:
            cols = _columns(recs)
        else:
            recs, cols = _read_ring(run, r, name)
        tails.put(r, recs[-1] if recs else None)
        if recs:
            b.add(r, len(recs), cols)
        del recs, cols
    df = b.frame()
    del b
    release_memory()
    return df
