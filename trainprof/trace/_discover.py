"""Finding the ranks in a bare set of torch.profiler traces (not a trainprof run directory).

Inputs: a folder written by ``tensorboard_trace_handler`` (``<host>_<pid>.<ts>.pt.trace.json``),
HTA's layout (``rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz``), a single trace file, or several
files and folders given together. Every ``*.json`` / ``*.json.gz`` regular file of a folder (not
its subfolders) is a candidate, except trainprof's own outputs; a candidate that is JSON without
``traceEvents`` is not a trace (lacks_trace_events). A folder with no candidate at all: its
subfolders holding traces are found (trace_folders, a bounded search).

Every trace is parsed, then:

- Jobs (group_jobs): traces of one process, and traces whose time spans (absolute, from
  ``baseTimeNanoseconds`` + ``ts``) overlap, are one job, unless their distributedInfo disagrees
  (world size, backend). Of several jobs in one folder the latest complete one is analyzed
  (pick_job); the caller says which files were left out.
- Windows (choose_windows): traces of one process (the rank they claim, else torch's
  ``<host>_<pid>``) are windows of it; the one holding the most training is analyzed (the most
  steps with ops in them; without ProfilerStep the most events; then the latest), so that the
  cut-off window torch writes when the loop ends is never chosen over a full one. Trailing
  ProfilerSteps with nothing in them are dropped from a window's steps (prepare_window).
- Ranks (assign_ranks): ``distributedInfo.rank`` when the trace carries it, else the rank in the
  file name (``rank-N``, ``rank_N``, ``rankN``, ``rank[N]``), else one rank per file in name
  order (said in a problem line). Two files that still claim one rank: the latest is analyzed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainprof import safeio
from trainprof.rundir.files import HANG_DUMP

TRACE_SUFFIXES = (".json", ".json.gz")
# trainprof's own outputs (summary.json, FILE.summary.json) and run-directory documents
NOT_TRACES = ("summary.json", "manifest.json", "meta.json", "injected.json", HANG_DUMP)
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


def _torch_ts(p: Path) -> int:
    m = _TORCH_RE.match(p.name)
    return int(m.group("ts")) if m else 0


def _order_key(p: Path) -> tuple:
    """When a window was written: torch's millisecond timestamp in the name, else mtime."""
    try:
        mtime = os.stat(p).st_mtime_ns
    except OSError:
        mtime = 0
    return (_torch_ts(p), mtime, p.name)


def _older(who: str, latest: Path, older: list[Path], what: str = "profiler windows") -> str:
    names = ", ".join(p.name for p in older[:5]) + (", …" if len(older) > 5 else "")
    return (f"{who}: {len(older) + 1} {what}; the latest ({latest.name}) is analyzed, "
            f"{len(older)} older not: {names}")


# --------------------------------------------------------------------------- what is not a trace
def lacks_trace_events(path: Path) -> bool:
    """A file the parser refused as "not a Chrome trace" (valid JSON, no traceEvents list) that
    has no traceEvents key at all: some other JSON document (a config, a tokenizer), not a
    trace. A file with the key (of the wrong type) is a malformed trace."""
    try:
        data = safeio.read_limited(path)
        if data[:2] == b"\x1f\x8b":
            data = safeio.gunzip_limited(data, path)
    except (OSError, ValueError, EOFError):
        return False
    return b'"traceEvents"' not in data


SNIFF_BYTES = 1 << 16


def looks_like_trace(path: Path) -> bool:
    """A cheap guess, for finding folders of traces: torch's name (``*.pt.trace.json[.gz]``), or
    a Chrome trace's keys in the first 64 KiB (inflated for gzip)."""
    if not is_trace_name(path.name) or not safeio.is_regular(path):
        return False
    if _TORCH_RE.match(path.name):
        return True
    try:
        fd, _ = safeio.open_regular(path)
        with os.fdopen(fd, "rb") as f:
            head = f.read(SNIFF_BYTES)
        if head[:2] == b"\x1f\x8b":
            import zlib

            head = zlib.decompressobj(wbits=31).decompress(head, SNIFF_BYTES)
    except Exception:  # noqa: BLE001 - a guess only
        return False
    return any(k in head for k in (b'"traceEvents"', b'"schemaVersion"', b'"ph"'))


SEARCH_DEPTH = 3        # subfolders searched for traces below a folder that holds none
SEARCH_ENTRIES = 20000  # at most this many directory entries looked at
SEARCH_SNIFFS = 200     # at most this many files opened to guess whether they are traces


def trace_folders(root: Path, depth: int = SEARCH_DEPTH) -> tuple[list[Path], bool]:
    """Subfolders of ``root`` (down to ``depth`` levels, symlinks not followed) that hold
    trace files, in name order, and whether the search stopped at its bounds."""
    found: list[Path] = []
    level, seen, sniffs, cut = [root], 0, 0, False
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                continue
            seen += len(entries)
            if seen > SEARCH_ENTRIES:
                return found, True
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False) and not e.name.startswith("."):
                        nxt.append(Path(e.path))
                except OSError:
                    continue
            if d is root:
                continue
            for e in entries:
                if not is_trace_name(e.name):
                    continue
                if sniffs >= SEARCH_SNIFFS:
                    cut = True
                    break
                sniffs += 1
                if looks_like_trace(Path(e.path)):
                    found.append(Path(d))
                    break
        level = nxt
    return sorted(found), cut


# --------------------------------------------------------------------------- windows
def prepare_window(tr) -> tuple[dict, list[str]]:
    """What a window holds, for choosing among the windows of a process, with the trailing stub
    steps dropped from the trace: ProfilerSteps at the end of a window without any other event
    in them (torch writes one when the profiler stops at the end of the loop, ~0.01 ms long)
    would dilute per-step figures. Returns ({"steps": [N of each step kept], "work_steps":
    steps holding an event besides their ProfilerStep, "events": such events, "pid": the host
    process id (the most common one of host events), "stub_steps": [dropped]}, problems)."""
    import numpy as np

    ev, steps = tr.tables.events, tr.tables.steps
    n = len(ev)
    marker = ev["name"].startswith("ProfilerStep#") if n else np.zeros(0, bool)
    work = ~marker
    host_pid = ev["pid"][~ev["is_gpu"] & (ev["pid"] >= 0)] if n else np.zeros(0, np.int64)
    pid = None
    if len(host_pid):
        vals, counts = np.unique(host_pid, return_counts=True)
        pid = int(vals[np.argmax(counts)])
    in_step = ev["step"][work] if n else np.zeros(0, np.int64)
    nums = steps["step"].tolist() if len(steps) else []
    # counts asked for: np.unique without them imports numpy.ma (tests/unit/trainprof/test_startup.py)
    busy = (set(np.unique(in_step[in_step >= 0], return_counts=True)[0].tolist())
            if len(in_step) else set())
    stubs: list[int] = []
    whole = bool(tr.meta.get("whole_trace_window"))
    if not whole and busy:
        for s in reversed(nums):  # trailing steps only: a step with nothing in it at the end
            if s in busy:
                break
            stubs.append(s)
    problems = []
    if stubs:
        keep = ~np.isin(steps["step"], stubs)
        starts = dict(zip(nums, steps["start_ns"].tolist()))
        ends = dict(zip(nums, steps["end_ns"].tolist()))
        tr.tables.steps = steps[keep]
        ev["step"][np.isin(ev["step"], stubs)] = -1
        tr._views.clear()
        shown = ", ".join(f"ProfilerStep#{s} ({(ends[s] - starts[s]) / 1e6:.3f} ms)"
                          for s in sorted(stubs))
        problems.append(f"{tr.path}: {shown} holds no op (written when the profiler stopped at "
                        f"the end of the loop): left out of the steps")
        nums = [s for s in nums if s not in stubs]
    facts = {"steps": nums, "work_steps": len(busy & set(nums)) if not whole else int(bool(busy)),
             "events": int(work.sum()) if n else 0, "pid": pid, "stub_steps": sorted(stubs)}
    return facts, problems


def _window(head) -> dict:
    w = head.doc.get("facts", {}).get("window")
    return w if isinstance(w, dict) else {}


def _claimed_rank(head) -> int | None:
    r = trace_rank(head)
    if r is None:
        r = name_rank(head.path.name)
    return r if r is not None and r < MAX_RANK else None


def _span(head) -> tuple[int, int] | None:
    s = head.meta.get("span_ns")
    return (int(s[0]), int(s[1])) if isinstance(s, list) and len(s) == 2 else None


def _window_key(head) -> tuple:
    """Which window of a process holds the most training: the most steps with work in them;
    without ProfilerStep, the most events; then the latest."""
    w = _window(head)
    whole = bool(head.meta.get("whole_trace_window"))
    span = _span(head)
    return (w.get("work_steps", 0), w.get("events", 0) if whole else 0,
            span[0] if span else 0, *_order_key(head.path))


def _process(head) -> str:
    r = _claimed_rank(head)
    if r is not None:
        return f"rank {r}"
    m = _TORCH_RE.match(head.path.name)
    return f"process {m.group('worker')}" if m else f"file {head.path}"


def _held(head) -> str:
    w = _window(head)
    if head.meta.get("whole_trace_window"):
        return f"no ProfilerStep, {w.get('events', 0)} event(s)"
    n = w.get("work_steps", 0)
    return f"{n} step(s) with ops" if n else "no step with an op in it"


def choose_windows(heads: list, problems: list[str]) -> tuple[list, dict]:
    """One trace per process (the rank it claims, else torch's <host>_<pid>, else the file): the
    window that holds the most training (choose_window). Returns (the chosen heads, {"older": n,
    "later": n} windows left out before / after the chosen one)."""
    groups: dict[str, list] = {}
    for h in heads:
        groups.setdefault(_process(h), []).append(h)
    counts = {"older": 0, "later": 0}
    keep = [choose_window(who, hs, problems, counts) for who, hs in groups.items()]
    return sorted(keep, key=lambda h: h.path), counts


def choose_window(who: str, hs: list, problems: list[str], counts: dict | None = None):
    """Of the windows ``hs`` of one process (``who``: "rank 3"), the one that holds the most
    training (_window_key), so that a window torch cut off when the loop ended (one step, or a
    stub step alone) never wins over a full one. With several, a problem line names those left
    out and why; ``counts`` ({"older": n, "later": n}) counts them. Returns the chosen head."""
    best = max(hs, key=_window_key)
    if len(hs) == 1:
        return best
    counts = counts if counts is not None else {"older": 0, "later": 0}
    bspan = _span(best)
    rest = sorted((h for h in hs if h is not best), key=lambda h: _span(h) or (0, 0))
    parts = []
    for h in rest:
        span = _span(h)
        later = span[0] > bspan[0] if span and bspan else \
            _order_key(h.path) > _order_key(best.path)
        counts["later" if later else "older"] += 1
        parts.append(f"{h.path.name} ({_held(h)}, {'later' if later else 'earlier'})")
    why = ("the one holding the most training is analyzed" if
           any(_window_key(h)[:2] < _window_key(best)[:2] for h in rest)
           else "they hold as much training; the latest is analyzed")
    shown = "; ".join(parts[:5]) + ("; …" if len(parts) > 5 else "")
    problems.append(f"{who}: {len(hs)} profiler windows; {why}: {best.path.name} "
                    f"({_held(best)}); left out: {shown}")
    return best


# --------------------------------------------------------------------------- jobs
JOB_GAP_NS = 5 * 10**9  # traces of one job's ranks overlap in time (give or take clock skew)


def _signature(head) -> tuple | None:
    dist = head.meta.get("distributedInfo")
    if not isinstance(dist, dict):
        return None
    ws, be = dist.get("world_size"), dist.get("backend")
    ws = ws if type(ws) is int else None
    be = be if isinstance(be, str) else None
    return (ws, be) if ws is not None or be is not None else None


class Job:
    """Traces of one job: ``heads``, ``start``/``end`` (absolute ns, None without events),
    ``world_size``/``backend`` (distributedInfo), ``ranks`` (claimed)."""

    def __init__(self, heads: list):
        self.heads = sorted(heads, key=lambda h: h.path)
        spans = [s for s in map(_span, heads) if s]
        self.start = min(s[0] for s in spans) if spans else None
        self.end = max(s[1] for s in spans) if spans else None
        sig = next((s for s in map(_signature, heads) if s), None) or (None, None)
        self.world_size, self.backend = sig
        self.ranks = sorted({r for r in map(_claimed_rank, heads) if r is not None})

    @property
    def complete(self) -> bool:
        return self.world_size is None or set(range(self.world_size)) <= set(self.ranks)

    def describe(self, ref: "Job | None" = None, ref_name: str = "the analyzed one",
                 paths: bool = False) -> str:
        bits = []
        if ref is not None and self.start is not None and ref.start is not None:
            d = (self.start - ref.start) / 1e9
            bits.append(f"recorded {abs(d):.1f} s {'after' if d > 0 else 'before'} {ref_name}")
        if self.world_size is not None:
            bits.append(f"world size {self.world_size}")
        if self.backend:
            bits.append(self.backend)
        if self.world_size is not None:
            bits.append(f"{len([r for r in self.ranks if r < self.world_size])} of "
                        f"{self.world_size} rank(s)")
        names = ", ".join(str(h.path) if paths else h.path.name for h in self.heads[:6]) + (", …" if len(self.heads) > 6 else "")
        return f"{', '.join(bits)}: {names}" if bits else names


def group_jobs(heads: list) -> list[Job]:
    """Traces grouped into jobs: traces of one process (the same host process id and rank) are
    one job; so are traces whose time spans overlap (or lie within JOB_GAP_NS of each other)
    unless their distributedInfo disagrees (world size, backend). Traces without events join
    the job they are alone beside, else the first. Jobs in time order."""
    n = len(heads)
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i, j):
        parent[find(i)] = find(j)

    by_proc: dict[tuple, int] = {}
    for i, h in enumerate(heads):
        pid = _window(h).get("pid")
        host, _ = worker_host_pid(h.path.name)
        if pid is not None:
            key = (host, pid, _claimed_rank(h))
            if key in by_proc:
                union(i, by_proc[key])
            else:
                by_proc[key] = i
    by_sig: dict = {}
    for i, h in enumerate(heads):
        if _span(h):
            by_sig.setdefault(_signature(h), []).append(i)
    for idx in by_sig.values():  # per distributedInfo: a sweep over the time spans
        idx.sort(key=lambda i: _span(heads[i]))
        cur, end = None, None
        for i in idx:
            s, e = _span(heads[i])
            if cur is not None and s <= end + JOB_GAP_NS:
                union(i, cur)
                end = max(end, e)
            else:
                cur, end = i, e
    comps: dict[int, list[int]] = {}
    for i in range(n):
        comps.setdefault(find(i), []).append(i)
    # traces without distributedInfo: into the job with it whose time they overlap, if one
    signed = [c for c in comps.values() if any(_signature(heads[i]) for i in c)]
    for root, c in list(comps.items()):
        if any(_signature(heads[i]) for i in c) or not signed:
            continue
        spans = [_span(heads[i]) for i in c if _span(heads[i])]
        if not spans:
            continue
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        near = []
        for other in signed:
            os_ = [_span(heads[i]) for i in other if _span(heads[i])]
            if os_ and lo <= max(s[1] for s in os_) + JOB_GAP_NS \
                    and min(s[0] for s in os_) <= hi + JOB_GAP_NS:
                near.append(other)
        if len(near) == 1:
            near[0].extend(c)
            del comps[root]
    groups = list(comps.values())
    empty = [g for g in groups if not any(_span(heads[i]) for i in g)]
    timed = [g for g in groups if g not in empty]
    if timed:
        for g in empty:  # traces without events: in the job they would be analyzed with
            timed[0].extend(g)
        groups = timed
    jobs = [Job([heads[i] for i in g]) for g in groups]
    return sorted(jobs, key=lambda j: (j.start is None, j.start or 0))


def pick_job(jobs: list[Job]) -> Job:
    """The job analyzed of several found in one folder: the latest complete one (every rank of
    its world size present), else the latest."""
    return max(jobs, key=lambda j: (j.complete, j.end or 0))


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
