"""The compact per-step tables of a rank (``ranks/rank-N/compact/``): format, writer, reader.

Every step of a run keeps a few fixed-width binary records (numpy structured records, little
endian, packed): the step's timings, its data wait, memory and per (process group, collective
kind) sums of the collective log. Older steps are folded into blocks (per-block min / median /
max / sum of every value) when the rank's budget would be exceeded (probes/compact.py); the
per-collective detail lives in the ring of recent steps (``collectives.jsonl`` +
``collectives.prev.jsonl``) and in windows around anomalies (``compact/collectives.window-<first
step>.jsonl``, listed in ``compact/state.json``). Format reference: docs/run-directory.md.

A table file is a 1024-byte header (``TPCT1`` then one JSON object naming the table and its
fields, padded with spaces, ending in a newline) followed by records of the size the header
names. A process killed mid-write leaves at most a partial last record, which the reader drops.

The writer side (``TableFormat.pack``) is standard library only (it runs inside the job); the
reader imports numpy.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from trainprof import safeio

COMPACT_DIR = "compact"
HEADER_SIZE = 1024
MAGIC = b"TPCT1\n"
KEYS = "keys.jsonl"          # key id -> {"pg", "op"} of the collectives table (append-only)
BLOCK_SUFFIX = ".blocks.bin"
TABLE_SUFFIX = ".bin"
STATS = ("min", "med", "max", "sum")
# detail windows (probes/detail_windows.py): the collective log's records around an anomaly
WINDOW_RE = re.compile(r"([a-z_]+)\.window-(\d+)\.jsonl")


def window_name(stream: str, first: int) -> str:
    return f"{stream}.window-{int(first)}.jsonl"


# flags of a steps record
F_PROFILED, F_MARKER, F_OPTIMIZER = 1, 2, 4
NAN = float("nan")


class TableFormat:
    """One table: its fields (name, struct code), the group fields of its blocks (the
    collectives table is folded per key) and the value fields its blocks summarize."""

    def __init__(self, name: str, fields: tuple, group: tuple = (), values: tuple = ()):
        self.name, self.fields, self.group, self.values = name, fields, group, values
        self.struct = struct.Struct("<" + "".join(code for _, code in fields))
        self.size = self.struct.size
        bfields = [("step_first", "q"), ("step_last", "q"), ("n", "I")]
        bfields += [(g, dict(fields)[g]) for g in group]
        bfields += [(f"{v}_{s}", "d") for v in values for s in STATS]
        self.block_fields = tuple(bfields)
        self.block_struct = struct.Struct("<" + "".join(c for _, c in bfields))

    def header(self, blocks: bool = False) -> bytes:
        fields = self.block_fields if blocks else self.fields
        doc = {"table": self.name, "blocks": blocks, "version": 1,
               "record_size": (self.block_struct if blocks else self.struct).size,
               "fields": [list(f) for f in fields]}
        body = json.dumps(doc, separators=(",", ":")).encode()
        if len(MAGIC) + len(body) + 1 > HEADER_SIZE:
            raise ValueError(f"compact header of {self.name} too long")
        return MAGIC + body + b" " * (HEADER_SIZE - len(MAGIC) - len(body) - 1) + b"\n"

    def pack(self, rows) -> bytes:
        p = self.struct.pack
        return b"".join(p(*r) for r in rows)


STEPS = TableFormat("steps", (("step", "q"), ("start_ns", "q"), ("end_ns", "q"),
                              ("probe_overhead_ms", "f"), ("cpu_ms", "f"), ("cpu_wait_ms", "f"),
                              ("nvcsw", "i"), ("nivcsw", "i"), ("flags", "B")),
                    values=("dur_ms", "cpu_ms", "cpu_wait_ms", "probe_overhead_ms"))
COLLECTIVES = TableFormat("collectives", (
    ("step", "q"), ("key", "H"), ("count", "I"), ("seq_first", "q"), ("bytes", "q"),
    ("blocked_ms", "f"), ("blocked_max_ms", "f"), ("wall_ms", "f"), ("wall_max_ms", "f"),
    ("device_ms", "f"), ("enqueue_first_ns", "q"), ("enqueue_mean_ms", "f")),
    group=("key",), values=("count", "bytes", "blocked_ms", "blocked_max_ms", "wall_ms",
                            "wall_max_ms", "device_ms"))
DATA = TableFormat("data", (("step", "q"), ("wait_ms", "f"), ("batches", "I")),
                   values=("wait_ms", "batches"))
MEMORY = TableFormat("memory", (("step", "q"), ("rss_bytes", "q"), ("peak_rss_bytes", "q"),
                                ("allocated_bytes", "q"), ("reserved_bytes", "q"),
                                ("peak_allocated_bytes", "q")),
                     values=("rss_bytes", "allocated_bytes", "reserved_bytes",
                             "peak_allocated_bytes"))
STEPS_DEVICE = TableFormat("steps_device", (("step", "q"), ("device_ms", "f")),
                           values=("device_ms",))
TABLES = {t.name: t for t in (STEPS, COLLECTIVES, DATA, MEMORY, STEPS_DEVICE)}


def table_path(rank_dir: Path, name: str, blocks: bool = False) -> Path:
    return Path(rank_dir) / COMPACT_DIR / (name + (BLOCK_SUFFIX if blocks else TABLE_SUFFIX))


# --------------------------------------------------------------------------- rows (writer side)


def _f(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else NAN


def _i(x, default=-1) -> int:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else default


def step_row(rec: dict) -> tuple | None:
    step = rec.get("step")
    if not isinstance(step, int):
        return None
    flags = (F_PROFILED if rec.get("profiled") else 0) | \
        {"marker": F_MARKER, "optimizer": F_OPTIMIZER}.get(rec.get("source"), 0)
    return (step, _i(rec.get("start_ns"), 0), _i(rec.get("end_ns"), 0),
            _f(rec.get("probe_overhead_ms")), _f(rec.get("cpu_ms")), _f(rec.get("cpu_wait_ms")),
            _i(rec.get("nvcsw")), _i(rec.get("nivcsw")), flags)


def data_row(rec: dict) -> tuple | None:
    step = rec.get("step")
    if not isinstance(step, int):
        return None
    return (step, _f(rec.get("wait_ms")), max(0, _i(rec.get("batches"), 0)))


def memory_row(rec: dict) -> tuple | None:
    step = rec.get("step")
    if not isinstance(step, int) or rec.get("event") is not None:
        return None
    return (step, _i(rec.get("rss_bytes")), _i(rec.get("peak_rss_bytes")),
            _i(rec.get("allocated_bytes")), _i(rec.get("reserved_bytes")),
            _i(rec.get("peak_allocated_bytes")))


def device_row(rec: dict) -> tuple | None:
    step = rec.get("step")
    return (step, _f(rec.get("device_ms"))) if isinstance(step, int) else None


def collective_rows(recs: list, key_of) -> list[tuple]:
    """Per (step, pg, op) sums of finished collective-log records (NaN-replay ones left out);
    ``key_of(pg, op)`` gives the key id. Runs on the flushing thread for every record: flat."""
    acc: dict = {}
    get = acc.get
    for r in recs:
        try:
            step, enq = r["step"], r["enqueue_ns"]
            if type(step) is not int or type(enq) is not int or r.get("replay"):
                continue
            k = (step, r["pg"], r["op"])
            end = r.get("end_ns")
            wall = (end - enq) / 1e6 if type(end) is int else None
            b = r.get("blocked_ms") or 0.0
            dev = r.get("device_ms")
            nb = r.get("bytes") or 0
        except (KeyError, TypeError):
            continue
        a = get(k)
        if a is None:
            acc[k] = [1, r.get("seq") or 0, nb, b, b, wall or 0.0, wall or 0.0, wall is not None,
                      dev, enq, 0]
            continue
        a[0] += 1
        a[2] += nb
        a[3] += b
        if b > a[4]:
            a[4] = b
        if wall is not None:
            a[5] += wall
            if wall > a[6]:
                a[6] = wall
            a[7] = True
        if dev is not None:
            a[8] = dev if a[8] is None else a[8] + dev
        a[10] += enq - a[9]
    rows = []
    for (step, pg, op), a in acc.items():
        try:
            rows.append((step, key_of(str(pg), str(op)), a[0], int(a[1]), int(a[2]), float(a[3]),
                         float(a[4]), float(a[5]) if a[7] else NAN, float(a[6]) if a[7] else NAN,
                         float(a[8]) if a[8] is not None else NAN, a[9], a[10] / a[0] / 1e6))
        except (TypeError, ValueError):
            continue
    return rows


ROW_OF = {"steps": step_row, "data": data_row, "memory": memory_row, "steps_device": device_row}


def new_table_file(path: Path, fmt: TableFormat, blocks: bool = False, body: bytes = b"") -> None:
    """Create (or replace) a table file atomically: header + body."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = fmt.header(blocks) + body
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------- reading


class CompactError(ValueError):
    pass


def _dtype(fields):
    import numpy as np

    return np.dtype([(n, "<" + {"q": "i8", "i": "i4", "I": "u4", "H": "u2", "B": "u1",
                                "f": "f4", "d": "f8"}[c]) for n, c in fields])


def read_table(path: Path, expect: str | None = None, last: int | None = None, fileobj=None):
    """(numpy records, torn: bool) of a table file — only its ``last`` records when given;
    CompactError naming the file when its header is not a compact table's. A partial last
    record (a writer killed mid-write) is dropped and ``torn`` says so."""
    import numpy as np

    with (fileobj if fileobj is not None else open(path, "rb")) as f:
        head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE or not head.startswith(MAGIC):
            raise CompactError(f"{path}: not a trainprof compact table (bad header)")
        try:
            doc = json.loads(head[len(MAGIC):].decode())
            fields = [(str(n), str(c)) for n, c in doc["fields"]]
            dt = _dtype(fields)
            size = int(doc["record_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise CompactError(f"{path}: malformed compact header ({e})") from None
        if dt.itemsize != size or size <= 0:
            raise CompactError(f"{path}: header record size {size} != its fields' {dt.itemsize}")
        if expect is not None and doc.get("table") != expect:
            raise CompactError(f"{path}: table {doc.get('table')!r}, expected {expect!r}")
        if last is not None:
            total = os.fstat(f.fileno()).st_size - HEADER_SIZE
            skip = max(0, total // size - last)
            f.seek(HEADER_SIZE + skip * size)
        data = f.read()
    n = len(data) // size
    return np.frombuffer(data, dtype=dt, count=n), len(data) != n * size


def read_keys(path: Path) -> dict[int, tuple[str, str]]:
    out: dict[int, tuple[str, str]] = {}
    try:
        fd, _ = safeio.open_regular(path)  # a regular file only: never blocks on a FIFO
        with open(fd, "rb") as f:
            for line in f:
                try:
                    d = json.loads(line)
                    out[int(d["key"])] = (str(d["pg"]), str(d["op"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line
    except (OSError, safeio.InputRefused):
        pass
    return out


def fold(fmt: TableFormat, rows, steps_per_block: int):
    """Block records (numpy) of full-resolution ``rows``: consecutive blocks of
    ``steps_per_block`` steps (per group key), each value's min / median / max / sum."""
    import numpy as np

    bdt = _dtype(fmt.block_fields)
    if len(rows) == 0:
        return np.zeros(0, bdt)
    vals = {v: _values(fmt, rows, v) for v in fmt.values}
    block = rows["step"] // steps_per_block
    gkeys = [block] + [rows[g] for g in fmt.group]
    order = np.lexsort(tuple(reversed(gkeys)))
    sk = np.stack([k[order] for k in gkeys], axis=1)
    cuts = np.flatnonzero(np.any(sk[1:] != sk[:-1], axis=1)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(order)]])
    out = np.zeros(len(starts), bdt)
    st = rows["step"][order]
    out["step_first"] = np.minimum.reduceat(st, starts)
    out["step_last"] = np.maximum.reduceat(st, starts)
    out["n"] = ends - starts
    for g in fmt.group:
        out[g] = rows[g][order][starts]
    for v, x in vals.items():
        xs = x[order]
        out[f"{v}_sum"] = np.add.reduceat(np.nan_to_num(xs), starts)
        out[f"{v}_min"] = np.fmin.reduceat(xs, starts)
        out[f"{v}_max"] = np.fmax.reduceat(xs, starts)
        out[f"{v}_med"] = seg_median(xs, starts, ends)
    return out


def seg_median(xs, starts, ends):
    """Median of each segment xs[starts[i]:ends[i]] ignoring NaN (NaN for an all-NaN one),
    vectorized: one sort by (segment, value)."""
    import numpy as np

    seg = np.repeat(np.arange(len(starts)), ends - starts)
    nan = np.isnan(xs)
    order = np.lexsort((np.where(nan, np.inf, xs), seg))
    s = xs[order]
    cnt = np.add.reduceat(~nan, starts) if len(xs) else np.zeros(0, int)
    lo = starts + np.maximum(cnt - 1, 0) // 2
    hi = starts + cnt // 2
    hi = np.minimum(hi, np.maximum(ends - 1, 0))
    med = (s[lo] + s[hi]) / 2.0 if len(xs) else np.zeros(0)
    return np.where(cnt > 0, med, np.nan)


def merge_blocks(fmt: TableFormat, blocks, steps_per_block: int):
    """Blocks of ``steps_per_block`` steps (twice the previous size): the blocks (per group key)
    that fall into one merged; a merged block's median is the median of its blocks' medians
    (an approximation, said in docs/run-directory.md)."""
    import numpy as np

    if len(blocks) < 2:
        return blocks
    pair = blocks["step_first"] // steps_per_block
    gkeys = [pair] + [blocks[g] for g in fmt.group]
    order = np.lexsort(tuple(reversed(gkeys)))
    b = blocks[order]
    sk = np.stack([k[order] for k in gkeys], axis=1)
    cuts = np.flatnonzero(np.any(sk[1:] != sk[:-1], axis=1)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(b)]])
    out = np.zeros(len(starts), blocks.dtype)
    out["step_first"] = np.minimum.reduceat(b["step_first"], starts)
    out["step_last"] = np.maximum.reduceat(b["step_last"], starts)
    out["n"] = np.add.reduceat(b["n"], starts)
    for g in fmt.group:
        out[g] = b[g][starts]
    for v in fmt.values:
        out[f"{v}_sum"] = np.add.reduceat(b[f"{v}_sum"], starts)
        out[f"{v}_min"] = np.fmin.reduceat(b[f"{v}_min"], starts)
        out[f"{v}_max"] = np.fmax.reduceat(b[f"{v}_max"], starts)
        out[f"{v}_med"] = seg_median(b[f"{v}_med"].astype(float), starts, ends)
    return out[np.argsort(out["step_first"], kind="stable")]


def _values(fmt: TableFormat, rows, v: str):
    import numpy as np

    if v == "dur_ms":
        return (rows["end_ns"] - rows["start_ns"]) / 1e6
    x = rows[v].astype(float)
    if rows.dtype[v].kind in "iu":
        x = np.where(rows[v] < 0, np.nan, x)
    return x
