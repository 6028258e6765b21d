"""Per-step series of a run, whichever format its ranks wrote (read through RunDir).

A rank of the bounded format (probes/compact.py) has compact tables of every step
(``ranks/rank-N/compact/*.bin``), older steps possibly folded into blocks, and a ring of recent
JSONL detail (``<stream>.prev.jsonl`` + ``<stream>.jsonl``). A rank of schema version 1 has the
JSONL streams of every step. The functions here give analyzers the same frames either way:

- :func:`stream_frame`: the frame of ``steps`` / ``data`` / ``memory`` / ``steps_device`` with
  the columns of their JSONL records, one row per full-resolution step (compact rows, then the
  ring's records of steps the tables do not hold yet);
- :func:`collective_steps`: per (rank, step, pg, op) sums of the collective log;
- :func:`step_series`: per (rank, step) one row joining them (what onset detection reads);
- :func:`blocks`: the folded steps, per rank and block;
- :func:`resolution`: which steps are at which resolution (summary.json ``run.resolution``).

The per-collective detail (the ring and the detail windows) is read by trainprof/rundir/detail.py.
"""

from __future__ import annotations

import numpy as np

from trainprof.rundir import compact as fmt
from trainprof._lazy import pd
from trainprof import safeio
from trainprof.rundir.streams import Tails

COMPACT_STREAMS = ("steps", "data", "memory", "steps_device")


def has_compact(run, rank: int) -> bool:
    """Whether the rank has compact tables (looked up once per rank and analysis)."""
    seen = run._cache.setdefault("series:has_compact", {})
    if rank not in seen:
        seen[rank] = run.rank_file(rank, f"{fmt.COMPACT_DIR}/steps{fmt.TABLE_SUFFIX}") is not None
    return seen[rank]


def compact_ranks(run) -> int:
    """How many ranks have compact tables."""
    key = "series:compact_ranks"
    if key not in run._cache:
        run._cache[key] = sum(1 for r in run.ranks if has_compact(run, r))
    return run._cache[key]


def any_compact(run) -> bool:
    return compact_ranks(run) > 0


# Analysis reads at most this many (rank, step) rows at full resolution, the most recent steps
# of every rank (a window of ANALYSIS_ROWS / ranks steps, at least MIN_WINDOW): the analysis of
# a run of any length and width takes bounded time and memory; older steps are read from the
# blocks the probes folded, and full-resolution steps between those and the window stay on
# disk (resolution() says which).
ANALYSIS_ROWS = 1_000_000
MIN_WINDOW = 200


def window_steps(run) -> int:
    return max(MIN_WINDOW, ANALYSIS_ROWS // (compact_ranks(run) or 1))


def table(run, rank: int, name: str) -> tuple:
    """(full-resolution rows of the analysis window, block rows) of a rank's compact table
    (empty arrays when absent); full rows that blocks already cover (a fold killed before it
    replaced the file) are dropped; a torn last record is dropped silently, a bad file is a
    problem."""
    key = f"series:table:{name}:{rank}"
    if key in run._cache:
        return run._cache[key]
    f = fmt.TABLES[name]
    win = window_steps(run)
    first = _window_first(run, rank, win) if name != "steps" else None
    out = []
    for blocks in (False, True):
        arr = _read(run, rank, f, name, blocks, None if blocks else win, first)
        out.append(arr)
    rows, blk = out
    if len(blk) and len(rows):
        rows = rows[rows["step"] > blk["step_last"].max()]
    if name == "steps" and len(rows):
        run._cache[f"series:first:{rank}"] = int(rows["step"].min())
    run._cache[key] = (rows, blk)
    return rows, blk


def _window_first(run, rank: int, win: int):
    k = f"series:first:{rank}"
    if k not in run._cache:
        table(run, rank, "steps")
    return run._cache.get(k)


def _read(run, rank, f, name, blocks, win, first):
    p = fmt.table_path(run.rank_path(rank), name, blocks)
    empty = np.zeros(0, fmt._dtype(f.block_fields if blocks else f.fields))
    if run.rank_file(rank, f"{fmt.COMPACT_DIR}/{p.name}") is None:
        return empty
    last = None if win is None else (win if name == "steps" else win * 4)
    while True:
        try:
            fd, _size = safeio.open_regular(p)  # refuses links to devices, fifos
            arr, _torn = fmt.read_table(p, expect=name, last=last, fileobj=open(fd, "rb"))
        except (OSError, ValueError) as e:
            run.problems.append(str(e) if str(p) in str(e) else f"{p}: {e}")
            return empty
        if last is None or first is None or not len(arr) or arr["step"].min() < first \
                or len(arr) < last:
            break
        last *= 4  # several rows a step (one per group and kind): read further back
    if first is not None and len(arr) and not blocks:
        arr = arr[arr["step"] >= first]
    return arr


def keys(run, rank: int) -> dict[int, tuple[str, str]]:
    return fmt.read_keys(run.rank_path(rank) / fmt.COMPACT_DIR / fmt.KEYS)


# --------------------------------------------------------------------------- stream frames


def _steps_columns(rows) -> dict:
    flags = rows["flags"]
    src = np.where(flags & fmt.F_MARKER, "marker", np.where(flags & fmt.F_OPTIMIZER, "optimizer", None))
    cols = {"step": rows["step"].astype(np.int64), "start_ns": rows["start_ns"].astype(np.int64),
            "end_ns": rows["end_ns"].astype(np.int64),
            "dur_ms": (rows["end_ns"] - rows["start_ns"]) / 1e6, "source": src.astype(object)}
    prof = (flags & fmt.F_PROFILED).astype(bool)
    if prof.any():
        cols["profiled"] = np.where(prof, True, np.nan).astype(object)
    for c in ("probe_overhead_ms", "cpu_ms", "cpu_wait_ms"):
        x = _f32(rows[c])
        if np.isfinite(x).any():
            cols[c] = x
    for c in ("nvcsw", "nivcsw"):
        x = rows[c]
        if (x >= 0).any():
            cols[c] = np.where(x >= 0, x, np.nan) if (x < 0).any() else x.astype(np.int64)
    return cols


def _f32(x):
    """float32 ms values as float64 without float32's tail digits (0.0208589993 -> 0.020859)."""
    x = x.astype(np.float64)
    return np.round(x, 6) if x.dtype.kind == "f" else x


def _plain_columns(rows, name: str) -> dict:
    cols = {}
    for n, _ in fmt.TABLES[name].fields:
        x = rows[n]
        if x.dtype.kind == "f":
            cols[n] = _f32(x)
        elif n != "step" and (x < 0).any():
            cols[n] = np.where(x < 0, np.nan, x.astype(np.float64))
        else:
            cols[n] = x.astype(np.int64)
    return cols


def stream_frame(run, name: str):
    """The frame of a compact-backed stream over every rank: compact rows where a rank has
    them (plus its ring's records of later steps), the JSONL records elsewhere."""
    parts = []
    tails = run._cache.setdefault("tails:" + name, Tails())  # each rank's last record (stream_tail)
    for r in run.ranks:
        rows, _ = table(run, r, name) if has_compact(run, r) else (None, None)
        if rows is None:
            recs = run.stream_once(r, name)
            tails.put(r, recs[-1] if recs else None)
            if recs:
                parts.append(pd.DataFrame(recs).assign(rank=r))
            continue
        cols = _steps_columns(rows) if name == "steps" else _plain_columns(rows, name)
        df = pd.DataFrame(cols)
        last = int(rows["step"].max()) if len(rows) else -1
        tail = [x for x in run.stream_once(r, name)
                if isinstance(x.get("step"), int) and x["step"] > last]
        if tail:  # steps closed after the tables' last flush (a kill -9 right after a step)
            df = pd.concat([df, pd.DataFrame(tail)], ignore_index=True)
        if name == "steps" and len(rows) == 0 and not tail:
            tails.put(r, None)
            continue
        tails.put(r, _last_record(df))
        parts.append(df.assign(rank=r))
    if not parts:
        return pd.DataFrame()
    df = pd.concat(parts, ignore_index=True, sort=False)
    return df[["rank"] + [c for c in df.columns if c != "rank"]]


def _last_record(df) -> dict | None:
    if not len(df):
        return None
    row = df.iloc[-1].to_dict()
    out = {}
    for k, v in row.items():
        if v is None or (isinstance(v, float) and v != v):
            continue
        out[k] = v.item() if hasattr(v, "item") else v
    return out


# --------------------------------------------------------------------------- collectives per step


COLL_COLUMNS = ["rank", "step", "pg", "op", "count", "bytes", "blocked_ms", "blocked_max_ms",
                "wall_ms", "wall_max_ms", "device_ms", "seq_first", "enqueue_first_ns",
                "enqueue_mean_ms"]


def collective_steps(run):
    """Per (rank, step, pg, op): count, bytes, blocked (sum, max), wall = end − enqueue (sum,
    max), device ms (sum), first sequence number, first enqueue ns, mean enqueue offset (ms
    after the first) — from the compact table, or summed from the collective log (schema 1).
    The job's collectives only (NaN-replay ones left out). Cached (release_collective_steps
    drops it). Of the compact tables, ``pg`` and ``op`` are categorical (millions of rows)."""
    key = "series:collective_steps"
    if key in run._cache:
        return run._cache[key]
    old = [r for r in run.ranks if not has_compact(run, r)]
    fast: list | None = []
    pgs: dict = {}
    ops: dict = {}
    for r in run.ranks:
        if old:  # (schema-1 ranks: every rank the general way)
            break
        rows, _ = table(run, r, "collectives")
        run._cache.pop(f"series:table:collectives:{r}", None)  # kept once: in the frame below
        if not len(rows):
            continue
        names = keys(run, r)
        k = rows["key"].astype(np.int64)
        ids = sorted(set(names) | set(np.unique(k).tolist()))
        code = np.searchsorted(ids, k)
        # one (step, pg, op) may have come in two flushes (ops finished after the boundary):
        # merged by _merge_rows; ranks without any are taken as they are (no groupby per rank)
        pg = np.array([pgs.setdefault(names.get(i, ("?", "?"))[0], len(pgs)) for i in ids],
                      np.int64)[code]
        op = np.array([ops.setdefault(names.get(i, ("?", "?"))[1], len(ops)) for i in ids],
                      np.int64)[code]
        width = (len(pgs) + 1) * (len(ops) + 1)
        if len(np.unique(rows["step"].astype(np.int64) * width + pg * (len(ops) + 1) + op)) \
                != len(rows):
            fast = None
            break
        fast.append((r, rows, pg, op))
    if fast is not None and not old:
        out = _columns_frame(fast, list(pgs), list(ops))
    else:
        out = _collective_steps_frames(run, old)
    for c in ("blocked_ms", "blocked_max_ms", "wall_ms", "wall_max_ms", "device_ms",
              "enqueue_mean_ms"):
        out[c] = out[c].astype(np.float64)
    run._cache[key] = out
    return out


_COMPACT_COLUMNS = ("step", "count", "bytes", "blocked_ms", "blocked_max_ms", "wall_ms",
                    "wall_max_ms", "device_ms", "seq_first", "enqueue_first_ns", "enqueue_mean_ms")


def _columns_frame(fast: list, pg_names: list, op_names: list):
    """The frame of ranks whose compact rows need no merging: each column concatenated once,
    ``pg`` and ``op`` as categoricals."""
    if not fast:
        return pd.DataFrame(columns=COLL_COLUMNS)
    cols = {"rank": np.concatenate([np.full(len(rows), r, np.int64) for r, rows, _, _ in fast]),
            "step": np.concatenate([rows["step"] for _, rows, _, _ in fast]),
            "pg": pd.Categorical.from_codes(np.concatenate([p for _, _, p, _ in fast]), pg_names),
            "op": pd.Categorical.from_codes(np.concatenate([o for _, _, _, o in fast]), op_names)}
    for c in _COMPACT_COLUMNS[1:]:
        cols[c] = np.concatenate([rows[c] for _, rows, _, _ in fast])
    return pd.DataFrame(cols)[COLL_COLUMNS]


def _collective_steps_frames(run, old):
    parts = []
    for r in run.ranks:
        if r in old:
            continue
        rows, _ = table(run, r, "collectives")
        run._cache.pop(f"series:table:collectives:{r}", None)
        if not len(rows):
            continue
        names = keys(run, r)
        k = rows["key"].astype(np.int64)
        df = pd.DataFrame({c: rows[c] for c in _COMPACT_COLUMNS})
        df.insert(0, "rank", r)
        ids = sorted(set(names) | set(np.unique(k).tolist()))
        code = np.searchsorted(ids, k)
        df.insert(2, "pg", np.array([names.get(i, ("?", "?"))[0] for i in ids], dtype=object)[code])
        df.insert(3, "op", np.array([names.get(i, ("?", "?"))[1] for i in ids], dtype=object)[code])
        # one (step, pg, op) may have come in two flushes (ops finished after the boundary)
        parts.append(_merge_rows(df))
    if old:
        parts.append(_from_detail(run, set(old)))
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=COLL_COLUMNS)


def release_collective_steps(run) -> None:
    """Drop the cached collective_steps frame (millions of rows on a long or wide run) once its
    readers have what they derive from it; a later call reads it again."""
    cache = getattr(run, "_cache", None)
    if cache is not None:
        cache.pop("series:collective_steps", None)


def _merge_rows(df):
    g = df.groupby(["rank", "step", "pg", "op"], sort=False)
    if g.ngroups == len(df):
        return df
    mean_abs = df["enqueue_first_ns"].astype(np.float64) + df["enqueue_mean_ms"] * 1e6
    df = df.assign(_w=mean_abs * df["count"])
    agg = g.agg(count=("count", "sum"), bytes=("bytes", "sum"), blocked_ms=("blocked_ms", "sum"),
                blocked_max_ms=("blocked_max_ms", "max"), wall_ms=("wall_ms", "sum"),
                wall_max_ms=("wall_max_ms", "max"), device_ms=("device_ms", "sum"),
                seq_first=("seq_first", "min"), enqueue_first_ns=("enqueue_first_ns", "min"))
    w = df.groupby(["rank", "step", "pg", "op"], sort=False)["_w"].sum().to_numpy()
    agg["enqueue_mean_ms"] = (w / agg["count"].to_numpy() - agg["enqueue_first_ns"].to_numpy()) / 1e6
    return agg.reset_index()[COLL_COLUMNS]


def _from_detail(run, ranks: set):
    c = run.collectives()
    if c.empty or not {"step", "pg", "op", "enqueue_ns"} <= set(c.columns):
        return pd.DataFrame(columns=COLL_COLUMNS)
    c = c[c["rank"].isin(ranks)]
    step = pd.to_numeric(c["step"], errors="coerce")
    enq = pd.to_numeric(c["enqueue_ns"], errors="coerce")
    end = pd.to_numeric(c["end_ns"], errors="coerce") if "end_ns" in c.columns else enq * np.nan
    d = pd.DataFrame({"rank": c["rank"].to_numpy(), "step": step.to_numpy(),
                      "pg": c["pg"].astype(str).to_numpy(), "op": c["op"].astype(str).to_numpy(),
                      "bytes": pd.to_numeric(c.get("bytes"), errors="coerce").fillna(0).to_numpy(),
                      "blocked_ms": pd.to_numeric(c.get("blocked_ms"), errors="coerce").fillna(0.0).to_numpy(),
                      "wall_ms": ((end - enq) / 1e6).to_numpy(),
                      "device_ms": pd.to_numeric(c.get("device_ms"), errors="coerce").to_numpy()
                      if "device_ms" in c.columns else np.nan,
                      "seq": pd.to_numeric(c.get("seq"), errors="coerce").to_numpy()
                      if "seq" in c.columns else np.nan,
                      "enq": enq.to_numpy()}).dropna(subset=["step", "enq"])
    d["step"] = d["step"].astype(np.int64)
    g = d.groupby(["rank", "step", "pg", "op"], sort=False)
    agg = g.agg(count=("enq", "size"), bytes=("bytes", "sum"), blocked_ms=("blocked_ms", "sum"),
                blocked_max_ms=("blocked_ms", "max"), wall_ms=("wall_ms", "sum"),
                wall_max_ms=("wall_ms", "max"), device_ms=("device_ms", lambda x: x.sum(min_count=1)),
                seq_first=("seq", "min"), enqueue_first_ns=("enq", "min"), _mean=("enq", "mean"))
    agg["enqueue_mean_ms"] = (agg.pop("_mean") - agg["enqueue_first_ns"]) / 1e6
    agg["enqueue_first_ns"] = agg["enqueue_first_ns"].astype(np.int64)
    agg["bytes"] = agg["bytes"].astype(np.int64)
    return agg.reset_index()[COLL_COLUMNS]


# --------------------------------------------------------------------------- the joined series


P2P_OPS = ("send", "recv")


def step_series(run):
    """One row per (rank, step) at full resolution: step, start_ns, end_ns, dur_ms, cpu_ms,
    cpu_wait_ms, data_ms (input wait), blocked_ms (time blocked in collectives), p2p_ms (of
    which point-to-point), coll_count, coll_bytes, rss_bytes, allocated_bytes,
    reserved_bytes — whichever format the ranks wrote. Cached."""
    key = "series:step_series"
    if key in run._cache:
        return run._cache[key]
    st = run.steps()
    if st.empty or "step" not in st.columns:
        run._cache[key] = pd.DataFrame()
        return run._cache[key]
    cols = [c for c in ("rank", "step", "start_ns", "end_ns", "dur_ms", "cpu_ms", "cpu_wait_ms")
            if c in st.columns]
    t = st[cols].drop_duplicates(["rank", "step"], keep="last").copy()
    t["step"] = t["step"].astype(np.int64)
    cs = collective_steps(run)
    if len(cs):
        p2p = cs["op"].isin(P2P_OPS)
        g = cs.groupby(["rank", "step"])
        agg = pd.DataFrame({"blocked_ms": g["blocked_ms"].sum(), "coll_count": g["count"].sum(),
                            "coll_bytes": g["bytes"].sum()})
        agg["p2p_ms"] = cs[p2p].groupby(["rank", "step"])["blocked_ms"].sum()
        t = t.merge(agg.reset_index(), on=["rank", "step"], how="left")
    for c in ("blocked_ms", "p2p_ms", "coll_count", "coll_bytes"):
        t[c] = t[c].fillna(0) if c in t.columns else 0.0
    data = run.frame("data")
    if not data.empty and {"step", "wait_ms"} <= set(data.columns):
        d = data[["rank", "step", "wait_ms"]].dropna(subset=["step"]).astype({"step": np.int64})
        t = t.merge(d.groupby(["rank", "step"], as_index=False)["wait_ms"].sum()
                    .rename(columns={"wait_ms": "data_ms"}), on=["rank", "step"], how="left")
    t["data_ms"] = t["data_ms"].fillna(0.0) if "data_ms" in t.columns else 0.0
    mem = run.frame("memory")
    mcols = [c for c in ("rss_bytes", "allocated_bytes", "reserved_bytes") if c in mem.columns]
    if not mem.empty and "step" in mem.columns and mcols:
        m = mem[["rank", "step"] + mcols].dropna(subset=["step"]).astype({"step": np.int64})
        t = t.merge(m.drop_duplicates(["rank", "step"], keep="last"), on=["rank", "step"],
                    how="left")
    t = t.sort_values(["rank", "step"], kind="stable").reset_index(drop=True)
    run._cache[key] = t
    return t


def blocks(run):
    """The folded (downsampled) steps: one row per rank and block, with ``step_first``,
    ``step_last``, ``n`` and each value's ``_min`` / ``_med`` / ``_max`` / ``_sum`` of the
    steps table (``dur_ms_*``, ``cpu_ms_*``, ...), plus the block's collective ``blocked_ms_sum``
    and ``count_sum`` and data ``wait_ms_sum`` where those tables have the same block."""
    key = "series:blocks"
    if key in run._cache:
        return run._cache[key]
    parts = []
    for r in run.ranks:
        if not has_compact(run, r):
            continue
        _, b = table(run, r, "steps")
        if not len(b):
            continue
        df = pd.DataFrame({n: b[n] for n in b.dtype.names})
        _, cb = table(run, r, "collectives")
        if len(cb):
            c = pd.DataFrame({n: cb[n] for n in ("step_first", "blocked_ms_sum", "count_sum")})
            c = c.groupby("step_first", as_index=False).sum()
            df = df.merge(c, on="step_first", how="left")
        _, db = table(run, r, "data")
        if len(db):
            d = pd.DataFrame({"step_first": db["step_first"], "wait_ms_sum": db["wait_ms_sum"]})
            df = df.merge(d.groupby("step_first", as_index=False).sum(), on="step_first", how="left")
        parts.append(df.assign(rank=r))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    run._cache[key] = out
    return out


def resolution(run) -> dict | None:
    """Which steps of the run are kept at which resolution, over the ranks of the bounded
    format (None for a run without compact tables): {"blocks": {"steps": [a, b], "steps_per_block":
    [..]}, "full": {"steps": [a, b]}, "detail": {"steps": [a, b], "ranks_short": n},
    "text": "..."}; the detail is the per-collective ring the post-mortems read."""
    from trainprof.rundir import detail  # lazy: breaks a cycle rundir.series<->rundir.detail

    if not any_compact(run):
        return None
    bl, full, det, spb, gap = [], [], [], set(), []
    short = 0
    for r in run.ranks:
        if not has_compact(run, r):
            continue
        rows, b = table(run, r, "steps")
        if len(b):
            bl.append((int(b["step_first"].min()), int(b["step_last"].max())))
            spb |= {int(x) for x in np.unique(b["n"])[-3:]}
        if len(rows):
            full.append((int(rows["step"].min()), int(rows["step"].max())))
            after = bl[-1][1] + 1 if len(b) else 0
            if full[-1][0] > after:  # full rows on disk before the analysis window
                gap.append((after, full[-1][0] - 1))
        d = detail.detail_steps(run, r)
        if d:
            det.append(d)
            if full and d[0] > full[-1][0] or bl:
                short += 1
    out: dict = {}
    parts = []
    if bl:
        a, z = min(x[0] for x in bl), max(x[1] for x in bl)
        out["blocks"] = {"steps": [a, z], "steps_per_block": max(spb) if spb else None}
        parts.append(f"steps {a}-{z} in blocks of up to {max(spb)} steps (min/median/max/sum)")
    if gap:
        a, z = min(x[0] for x in gap), max(x[1] for x in gap)
        out["not_analysed"] = {"steps": [a, z], "window_steps": window_steps(run)}
        parts.append(f"steps {a}-{z} kept every step on disk but outside the analysis window "
                     f"(the last {window_steps(run)} steps of each rank)")
    if full:
        a, z = min(x[0] for x in full), max(x[1] for x in full)
        out["full"] = {"steps": [a, z]}
        parts.append(f"steps {a}-{z} every step")
    if det:
        a, z = max(x[0] for x in det), max(x[1] for x in det)
        out["detail"] = {"steps": [a, z], "ranks_short": short}
        parts.append(f"per-collective detail for steps {a}-{z}")
    win = detail.windows_summary(run)
    if win:
        out["windows"] = win
        if win["steps"]:
            why = {}
            for x in win["anomalies"]:
                why.setdefault(x["kind"].replace("_", " "), []).append(x["step"])
            parts.append("and around anomalies for steps " + ", ".join(
                f"{a}-{b}" for a, b in win["steps"][:8]) + (" ..." if len(win["steps"]) > 8 else "")
                + " (" + "; ".join(f"{k} at step{'s' if len(v) > 1 else ''} "
                                   + ", ".join(map(str, v[:4])) + (" ..." if len(v) > 4 else "")
                                   for k, v in why.items()) + ")")
        if win["dropped"]:
            parts.append(f"{win['dropped']} older detail window(s) dropped (budget)")
    out["text"] = "; ".join(parts)
    return out
