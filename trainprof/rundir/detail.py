"""The per-collective detail of a rank of the bounded format (read through RunDir).

The collective log keeps every record of the recent steps only (a ring: ``collectives.prev.jsonl``
+ ``collectives.jsonl``) and of the steps around anomalies the rank saw (detail windows:
``compact/collectives.window-<first step>.jsonl``, listed in ``compact/state.json``;
probes/detail_windows.py). Here:

- :func:`ring_tail`: the ring's newest bytes (the analysis reads at most DETAIL_BYTES of rings);
- :func:`detail_with_columns` / :func:`detail_records`: a rank's detail, windows then ring, and
  the whole-step ranges it holds;
- :func:`common_detail`: the steps every rank holds whole (collectives are matched by counting);
- :func:`detail_steps`, :func:`windows_summary`: what ``run.resolution`` says of them.
"""

from __future__ import annotations

import os

import numpy as np

from trainprof.rundir import compact as fmt
from trainprof import safeio
from trainprof.rundir import streams as rs
from trainprof.rundir.files import iter_jsonl, read_json_or_problem
from trainprof.rundir.series import any_compact, compact_ranks, has_compact
from trainprof._lazy import pd


def common_detail(run, df):
    """The collective detail of the steps every rank holds whole: a ring rotated (its
    ``.prev`` file exists) starts wherever its rank's budget ran out, maybe mid-step, the
    ranks' rings start at different steps, and each rank keeps its own detail windows
    (:func:`detail_records`); analyzers match the members of a collective by counting the
    group's collectives from the first record, so every rank must hold the same steps. Records
    outside the steps every rank with detail holds whole are dropped (not for a run without
    compact tables: every record of every step is there)."""
    if df.empty or "step" not in df.columns or not any_compact(run):
        return df
    step = pd.to_numeric(df["step"], errors="coerce")
    ok = step.notna()
    # each rank's first step with records (one groupby, not a mask per rank: ranks x records)
    first = step[ok].groupby(df["rank"][ok]).min().to_dict() if "rank" in df.columns else None
    per = []
    for r in run.ranks:
        if first is not None and r not in first:
            continue
        if first is None and not ok.any():
            continue
        ranges = run._cache.get(f"series:detail_ranges:{r}")
        if ranges is None:  # a rank of the JSONL format: its records from its first whole step
            rotated = run.rank_file(r, "collectives.prev.jsonl") is not None
            lo = first[r] if first is not None else step[ok].min()
            ranges = [(int(lo) + (1 if rotated else 0), INF)]
        per.append(ranges)
    if not per:
        return df
    common = per[0]
    for ranges in per[1:]:
        common = _intersect(common, ranges)
    keep = np.zeros(len(df), bool)
    x = step.to_numpy(float)
    for a, b in common:
        keep |= (x >= a) & (x <= b)
    if keep.all():
        return df
    return df[keep].reset_index(drop=True)


INF = float("inf")


def _intersect(xs, ys) -> list[tuple]:
    out = []
    for a, b in xs:
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if lo <= hi:
                out.append((lo, hi))
    return sorted(out)


# Per-collective detail the analysis reads, over all ranks: each rank's newest
# DETAIL_BYTES / ranks bytes of its ring (at least MIN_DETAIL_BYTES).
DETAIL_BYTES = 64 << 20
MIN_DETAIL_BYTES = 256 << 10


def ring_tail(run, rank: int, name: str):
    """(records, columns) of the newest bytes of a rank's ring (``<name>.prev.jsonl`` then
    ``<name>.jsonl``), whole lines only; a malformed line is skipped and reported."""
    n = compact_ranks(run) or 1
    budget = max(MIN_DETAIL_BYTES, DETAIL_BYTES // n)
    chunks = []
    cut = False  # the budget left part of the ring unread
    for p in (run.stream_path(rank, name),
              run.rank_path(rank) / f"{name}.prev.jsonl"):
        if not p.exists():
            continue
        if budget <= 0:
            cut = True
            continue
        try:
            fd, size = safeio.open_regular(p)
        except (OSError, safeio.InputRefused) as e:
            run.problems.append(str(e) if str(p) in str(e) else f"{p}: {e}")
            continue
        with open(fd, "rb") as f:
            start = max(0, size - budget)
            f.seek(start)
            data = f.read(size - start)
        if start > 0:
            cut = True
            data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
        budget -= len(data)
        chunks.insert(0, data)
    if not cut:  # the whole ring fits: read as every stream is, each record type-checked
        recs = []
        for p in (run.rank_path(rank) / f"{name}.prev.jsonl", run.stream_path(rank, name)):
            if p.exists():
                recs += rs.read_records(p, run.problems, name, run._cache.setdefault("shared_lists", {}))
        return recs, (rs._columns(recs) if recs else None)
    data = b"".join(chunks)
    recs = rs._parse(data) if data else []
    if recs is None:  # a bad line somewhere: the line-by-line reader skips and says why
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=f"-{name}.jsonl") as tmp:
            tmp.write(data)
            tmp.flush()
            recs = list(iter_jsonl(tmp.name, None, name))
        run.problems.append(f"{run.stream_path(rank, name)}: malformed records skipped")
    return recs, (rs._columns(recs) if recs else None)


# Detail windows the analysis reads, over all ranks: each rank's newest windows within
# WINDOW_READ_BYTES / ranks bytes (at least MIN_DETAIL_BYTES).
WINDOW_READ_BYTES = 32 << 20


def window_state(run, rank: int) -> dict:
    """The ``detail_windows`` part of a rank's ``compact/state.json`` ({} when absent)."""
    p = run.rank_file(rank, f"{fmt.COMPACT_DIR}/state.json")
    if p is None:
        return {}
    doc = read_json_or_problem(p, run.problems)
    w = doc.get("detail_windows") if isinstance(doc, dict) else None
    return w if isinstance(w, dict) else {}


def _windows(run, rank: int) -> list[dict]:
    """A rank's detail windows: those state.json lists (first, last, closed, truncated,
    anomalies) and any window file it does not list yet (a kill between the two writes)."""
    st = window_state(run, rank)
    out, named = [], set()
    for w in st.get("windows") or []:
        if not isinstance(w, dict) or not isinstance(w.get("file"), str):
            continue
        m = fmt.WINDOW_RE.fullmatch(w["file"])
        if m is None or m.group(1) != "collectives":
            continue
        a, b = w.get("first"), w.get("last")
        if not (isinstance(a, int) and isinstance(b, int)):
            continue
        named.add(w["file"])
        out.append({"file": w["file"], "first": a, "last": b, "closed": w.get("closed") is True,
                    "truncated": w.get("truncated") is True,
                    "anomalies": [x for x in w.get("anomalies") or [] if isinstance(x, dict)]})
    d = run.rank_path(rank) / fmt.COMPACT_DIR
    try:
        names = sorted(os.listdir(d)) if d.is_dir() else []
    except OSError:
        names = []
    for n in names:
        m = fmt.WINDOW_RE.fullmatch(n)
        if m and m.group(1) == "collectives" and n not in named:
            out.append({"file": n, "first": int(m.group(2)), "last": None, "closed": False,
                        "truncated": False, "anomalies": []})
    return sorted(out, key=lambda w: w["first"])


def detail_records(run, rank: int, read_records) -> list[dict]:
    return detail_with_columns(run, rank, read_records)[0]


def detail_with_columns(run, rank: int, read_records) -> tuple:
    """A rank's per-collective detail: its detail windows' records of steps the ring does not
    hold whole, then the ring's (newest bytes, :func:`ring_tail`). Records the ring holds of a
    step before its first whole one are dropped where a window holds that step whole. The
    whole-step ranges (first, last) it holds are kept for :func:`common_detail` and
    :func:`resolution`."""
    ring, cols = ring_tail(run, rank, "collectives")
    steps = [x.get("step") for x in ring]
    steps = [x for x in steps if isinstance(x, int)]
    rotated = run.rank_file(rank, "collectives.prev.jsonl") is not None
    first = (min(steps) + (1 if rotated else 0)) if steps else None
    n = compact_ranks(run) or 1
    budget = max(MIN_DETAIL_BYTES, WINDOW_READ_BYTES // n)
    got, ranges, info = [], [], []
    for w in reversed(_windows(run, rank)):  # the newest first, within the read budget
        p = run.rank_path(rank) / fmt.COMPACT_DIR / w["file"]
        if not run.stream_file_ok(rank, p):
            continue
        size = p.stat().st_size
        if size > budget:
            continue
        budget -= size
        recs = read_records(p, run.problems, "collectives", run._cache.setdefault("shared_lists", {}))
        ws = [x.get("step") for x in recs]
        ws = [x for x in ws if isinstance(x, int)]
        if not ws:
            continue
        top = max(ws)
        whole = w["closed"] and not w["truncated"]
        b = min(w["last"] if w["last"] is not None else top, top if whole else top - 1)
        if first is not None:
            b = min(b, first - 1)  # the ring holds these whole
        a = w["first"]
        if b < a:
            continue
        got.insert(0, [x for x in recs if isinstance(x.get("step"), int) and a <= x["step"] <= b])
        ranges.insert(0, (a, b))
        info.insert(0, {"steps": [a, b], "anomalies": w["anomalies"], "truncated": w["truncated"]})
    if ranges:
        def covered(st):
            return any(a <= st <= b for a, b in ranges)
        ring = [x for x in ring if not (isinstance(x.get("step"), int) and first is not None
                                         and x["step"] < first and covered(x["step"]))]
    run._cache[f"series:detail_ranges:{rank}"] = ranges + ([(first, INF)] if first is not None else [])
    run._cache[f"series:ring_steps:{rank}"] = (min(steps), max(steps)) if steps else None
    run._cache[f"series:windows:{rank}"] = info
    if not got:
        return ring, cols
    return [x for part in got for x in part] + ring, None


def detail_steps(run, rank: int, stream: str = "collectives") -> tuple | None:
    """(first, last) step of a rank's per-record detail of ``stream`` (the ring; for the
    collective log of the bounded format without its detail windows), or None."""
    key = f"series:ring_steps:{rank}"
    if stream == "collectives" and has_compact(run, rank):
        _note(run, rank)
        if key in run._cache:
            return run._cache[key]
    steps = [x.get("step") for x in run.stream_once(rank, stream)]
    steps = [s for s in steps if isinstance(s, int)]
    return (min(steps), max(steps)) if steps else None


def _note(run, rank: int) -> None:
    """A rank's ring and detail windows read once, noting their steps (detail_with_columns),
    unless noted already (the collective frame reads them): the records are not kept (at
    1,024 ranks every rank's ring held at once costs GBs)."""
    if f"series:ring_steps:{rank}" not in run._cache:
        run.stream_once(rank, "collectives")


def windows_summary(run) -> dict | None:
    """The detail windows of the run's ranks: {"steps": [[a, b], ...] (held by every rank that
    holds detail: what the cross-rank analyses read), "by_rank": {rank: [[a, b], ...]} (the
    first MAX_LISTED ranks; ``ranks_with_windows`` counts them past that), "anomalies": [{"kind",
    "step", "ranks"}], "dropped", "truncated"} or None without any."""
    by_rank, kinds, dropped, truncated = {}, {}, 0, 0
    for r in run.ranks:
        if not has_compact(run, r):
            continue
        _note(run, r)
        info = run._cache.get(f"series:windows:{r}") or []
        dropped += int(window_state(run, r).get("dropped") or 0)
        if info:
            by_rank[r] = [w["steps"] for w in info]
        for w in info:
            truncated += bool(w["truncated"])
            for a in w["anomalies"]:
                if isinstance(a.get("kind"), str) and isinstance(a.get("step"), int):
                    kinds.setdefault((a["kind"], a["step"]), set()).add(r)
    if not by_rank and not dropped:
        return None
    per = [run._cache.get(f"series:detail_ranges:{r}") or [] for r in run.ranks
           if has_compact(run, r) and run._cache.get(f"series:detail_ranges:{r}")]
    common = per[0] if per else []
    for x in per[1:]:
        common = _intersect(common, x)
    common = [[int(a), int(b)] for a, b in common if b != INF]
    anomalies = [{"kind": k, "step": s, "ranks": len(rs)} for (k, s), rs in sorted(
        kinds.items(), key=lambda kv: kv[0][1])]
    out = {"steps": common, "by_rank": {str(r): v for r, v in list(by_rank.items())[:MAX_LISTED]},
           "anomalies": anomalies[:MAX_LISTED], "dropped": dropped, "truncated": truncated}
    if len(by_rank) > MAX_LISTED:  # (summary.json stays small at 1,000+ ranks)
        out["ranks_with_windows"] = len(by_rank)
    return out


MAX_LISTED = 32
