"""Finding the ranks in a bare set of torch.profiler traces (not a trainprof run directory).

Inputs: a folder written by ``tensorboard_trace_handler`` (``<host>_<pid>.<ts>.pt.trace.json``),
HTA's layout (``rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz``), a single trace file, or several
files and folders given together. Every ``*.json`` / ``*.json.gz`` regular file of a folder (not
its subfolders) is a candidate, except trainprof's own outputs.

Windows: files of one process (the same rank in the name, or the same ``<host>_<pid>`` of torch's
naming) are windows of that process; the latest (by the timestamp in torch's name, else the
modification time, then the name) is analyzed, the others are named in a problem line. After
parsing, the rank is ``distributedInfo.rank`` when the trace carries it, else the rank in the file
name (``rank-N``, ``rank_N``, ``rankN``, ``rank[N]``), else one rank per file in name order (said
in a problem line). Two files that still claim one rank: the latest is analyzed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainprof import safeio

TRACE_SUFFIXES = (".json", ".json.gz")
# trainprof's own outputs (summary.json, FILE.summary.json) and run-directory documents
NOT_TRACES = ("summary.json", "manifest.json", "meta.json", "injected.json", "hang-dump.json")
MAX_RANK = 1 << 20
_RANK_RE = re.compile(r"(?:^|[^a-z0-9])rank[-_\[]?(\d{1,7})(?!\d)", re.IGNORECASE)
_TORCH_RE = re.compile(r"^(?P<worker>.+)\.(?P<ts>\d{10,})\.pt\.trace\.json(?:\.gz)?$")


def is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES) and not name.endswith(NOT_TRACES) and not name.startswith(".")


def name_rank(name: str) -> int | None:
    """rank-0.Apr_03….pt.trace.json.gz, sampled_rank-1.json.gz, trace_rank_3.json, rank[2].json -> N."""
    m = _RANK_RE.search(name)
    return int(m.group(1)) if m else None


def candidates(inputs: list[Path], problems: list[str]) -> list[Path]:
    """Trace files among the inputs (files as given, folders listed one level deep), sorted,
    each a regular file; anything else is a problem line."""
    out: list[Path] = []
    for p in inputs:
        if p.is_dir():
            try:
                entries = sorted(p.iterdir())
            except OSError as e:
                problems.append(f"{p}: cannot list: {e.strerror or e}; its traces are not analyzed")
                continue
            out += [e for e in entries if is_trace_name(e.name) and safeio.is_regular(e)]
        elif safeio.is_regular(p):
            out.append(p)
        else:
            problems.append(f"{p}: not a regular file, not read")
    return sorted(dict.fromkeys(out))


def _order_key(p: Path) -> tuple:
    """When a window was written: torch's millisecond timestamp in the name, else mtime."""
    m = _TORCH_RE.match(p.name)
    try:
        mtime = os.stat(p).st_mtime_ns
    except OSError:
        mtime = 0
    return (int(m.group("ts")) if m else 0, mtime, p.name)


def _worker(p: Path) -> str:
    r = name_rank(p.name)
    if r is not None:
        return f"rank {r}"
    m = _TORCH_RE.match(p.name)
    return f"process {m.group('worker')}" if m else f"file {p}"


def latest_windows(files: list[Path], problems: list[str]) -> list[Path]:
    """One file per process: the latest window; a problem line per process with older ones."""
    groups: dict[str, list[Path]] = {}
    for p in files:
        groups.setdefault(_worker(p), []).append(p)
    keep = []
    for who, ps in groups.items():
        ps = sorted(ps, key=_order_key)
        keep.append(ps[-1])
        if len(ps) > 1:
            problems.append(_older(who, ps[-1], ps[:-1]))
    return sorted(keep)


def _older(who: str, latest: Path, older: list[Path], what: str = "profiler windows") -> str:
    names = ", ".join(p.name for p in older[:5]) + (", …" if len(older) > 5 else "")
    return (f"{who}: {len(older) + 1} {what}; the latest ({latest.name}) is analyzed, "
            f"{len(older)} older not: {names}")


def trace_rank(trace) -> int | None:
    """distributedInfo.rank when it is a plain non-negative int (read as a JSON field)."""
    dist = trace.meta.get("distributedInfo")
    r = dist.get("rank") if isinstance(dist, dict) else None
    return r if type(r) is int and 0 <= r < MAX_RANK else None


def assign_ranks(parsed: list[tuple[Path, object]], problems: list[str]) -> dict[int, object]:
    """rank -> Trace for the parsed files (path, Trace): distributedInfo.rank, else the name's
    rank, else the lowest free rank in name order. Each file without a rank, and each rank
    claimed twice (the latest kept), is said in ``problems``."""
    claimed: dict[int, list[tuple[Path, object]]] = {}
    unranked = []
    for path, tr in sorted(parsed, key=lambda x: x[0]):
        r = trace_rank(tr)
        if r is None:
            r = name_rank(path.name)
        if r is None or r >= MAX_RANK:
            unranked.append((path, tr))
        else:
            claimed.setdefault(r, []).append((path, tr))
    out = {}
    for r, items in claimed.items():
        items = sorted(items, key=lambda x: _order_key(x[0]))
        out[r] = items[-1][1]
        if len(items) > 1:
            problems.append(_older(f"rank {r}", items[-1][0], [p for p, _ in items[:-1]],
                                   "traces claim this rank"))
    if unranked:
        free = (r for r in range(MAX_RANK) if r not in out)
        given = []
        for path, tr in unranked:
            r = next(free)
            out[r] = tr
            given.append(f"{path.name} -> rank {r}")
        problems.append(f"{len(unranked)} trace file(s) carry no rank (no distributedInfo.rank, no "
                        f"rank in the file name): one rank per file in name order: "
                        + ", ".join(given[:8]) + (", …" if len(given) > 8 else ""))
    for r, tr in out.items():
        tr.rank = r
    return dict(sorted(out.items()))


def worker_host_pid(name: str) -> tuple[str | None, int | None]:
    """torch's <host>_<pid>.<ts>.pt.trace.json -> (host, pid); (None, None) for other names."""
    m = _TORCH_RE.match(name)
    if not m:
        return None, None
    host, _, pid = m.group("worker").rpartition("_")
    return (host, int(pid)) if host and pid.isdigit() and len(pid) < 10 else (None, None)


def rank_facts(trace, rank: int) -> dict:
    """meta.json-like facts of a rank from its trace: world size and backend (distributedInfo),
    device (deviceProperties), host and pid (torch's file name). Unchecked: the caller cleans
    them against the meta.json schema."""
    dist = trace.meta.get("distributedInfo")
    dist = dist if isinstance(dist, dict) else {}
    devs = trace.meta.get("deviceProperties")
    devs = [d for d in devs if isinstance(d, dict)] if isinstance(devs, list) else []
    host, pid = worker_host_pid(trace.path.name)
    raw = {"rank": rank, "world_size": dist.get("world_size"), "backend": dist.get("backend"),
           "host": host, "pid": pid}
    if devs:
        raw.update(device_name=devs[0].get("name"), device_count=len(devs),
                   device_memory_bytes=devs[0].get("totalGlobalMem"))
    return {k: v for k, v in raw.items() if v is not None}


def run_facts(traces: list, limit: int = 64) -> dict:
    """pg_config (distributedInfo) and device_properties (deviceProperties) of the first trace
    that has each, as lists of objects (at most ``limit``)."""
    out: dict = {}
    for tr in traces:
        dist = tr.meta.get("distributedInfo")
        pg = dist.get("pg_config") if isinstance(dist, dict) else None
        if "pg_config" not in out and isinstance(pg, list):
            out["pg_config"] = [g for g in pg if isinstance(g, dict)][:limit]
        devs = tr.meta.get("deviceProperties")
        if "device_properties" not in out and isinstance(devs, list):
            out["device_properties"] = [d for d in devs if isinstance(d, dict)][:limit]
    return out
