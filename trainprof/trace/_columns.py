"""The columns a Chrome trace is decoded into (``Columns``: what the frame builder needs) and the
helpers that build them at C speed: ``factorize`` (codes and distinct values), ``ints`` (int64
with -1 for missing), ``launch_values`` (a kernel's launch figures as numbers)."""

from __future__ import annotations

import math
import re
from itertools import chain, count, repeat
from operator import is_not

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
        values = [v if type(v) is int else int_or_missing(v) for v in values]
    try:
        return np.fromiter(values, np.int64, n)
    except OverflowError:  # an int beyond int64
        return np.fromiter((v if -2**63 <= v < 2**63 else -1 for v in values), np.int64, n)


_DIGITS = re.compile(r"[+-]?[0-9]{1,19}")


def int_or_missing(v) -> int:
    if type(v) is float:
        return int(v) if math.isfinite(v) and abs(v) < 2**63 else -1
    if type(v) is str and _DIGITS.fullmatch(v.strip()):
        i = int(v)
        return i if -2**63 <= i < 2**63 else -1
    return -1
