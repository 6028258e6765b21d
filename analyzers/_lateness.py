"""Who waits for whom at collectives, from the always-on collective log.

Built on the collectives analyzer's frame (one row per record, enqueue/end in ms on rank 0's
clock, an *instance* = the same (group, ordinal) on every member; analyzers/collectives.py):

- ``wait_ms`` per record: the time the rank waited in the op. Host-blocked time
  (``blocked_ms``); on device-timed records of a complete instance also the device-side wait,
  ``device_ms`` − the shortest ``device_ms`` among the members (the last member to arrive runs
  the shortest kernel: the others' kernels spin until it joins), whichever is larger — with
  NCCL the host seldom blocks in a collective, the GPU does.
- :func:`lateness` per record of a complete instance: the rank's enqueue − the median enqueue
  of the *other* members doing the same work (leave-one-out: on 2 ranks the plain difference of
  the two arrivals; a pipeline's stages legitimately arrive at different times).
- :func:`waits_caused`: the part of every other member's wait that a given rank's late arrival
  explains, min(wait, its arrival − theirs), per step; the arrival gap is the larger of the
  host one (enqueue times) and the device one (their ``device_ms`` − its ``device_ms``).

Steps the per-collective detail no longer holds (bounded capture keeps it for the recent steps
and around anomalies) are judged from the compact per-step records (:func:`compact_frame`):
per (rank, step, group, kind) each rank kept its first enqueue and the mean enqueue offset of
that kind's collectives in the step, on its own clock. Put on one clock (analyzers/_align.py),
the mean enqueue of a (step, group, kind) every member logged with the same count is that
kind's instances averaged: a rank's lateness there (:func:`compact_lateness`) is its mean
enqueue − the median mean enqueue of its other peers — on 2 ranks exactly the mean of the
per-instance lateness — and the waits it explains (:func:`compact_waits`) are
min(the waiter's blocked sum, count × the gap of the mean enqueues).
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers import collectives as coll
from trainprof.analyzers import _align
from trainprof.analyzers._memo import once


def frame(run) -> pd.DataFrame:
    """The collectives analyzer's aligned frame plus ``complete`` (the row's instance was logged
    by every member of a ≥2-rank group) and ``wait_ms`` (cached)."""
    cache = getattr(run, "_cache", None)
    key = "analyzers._lateness.frame"
    if cache is not None and key in cache:
        return cache[key]

    df = coll._frame(run)
    if not df.empty:
        df = df.copy(deep=False)  # columns added below; the collectives frame stays as it is
        df["blocked_ms"] = pd.to_numeric(df["blocked_ms"], errors="coerce").fillna(0.0)
        df["step"] = pd.to_numeric(df["step"], errors="coerce")
        if df["step"].isna().any():  # (a filter copies every column)
            df = df.dropna(subset=["step"])
        df["step"] = df["step"].astype(int)
        complete = _complete(df)
        df["complete"] = complete
        df["wait_ms"] = np.maximum(df["blocked_ms"].to_numpy(float), _device_wait(df, complete))
    if cache is not None:
        cache[key] = df
    return df


def _complete(df) -> np.ndarray:
    """Rows that belong to an instance every member of a ≥2-rank group logged."""
    coll = ~df["p2p"].to_numpy(bool) & (df["gsize"].to_numpy() > 1)
    members = df.groupby(["group", "ordinal"])["rank"].transform("nunique").to_numpy()
    return coll & (members >= df["gsize"].to_numpy())


def _device_wait(df, complete) -> np.ndarray:
    out = np.zeros(len(df))
    dev = pd.to_numeric(df["device_ms"], errors="coerce")
    m = complete & dev.notna().to_numpy()
    if not m.any():
        return out
    d = df.loc[m, ["group", "ordinal"]].assign(dev=dev[m])
    g = d.groupby(["group", "ordinal"])["dev"]
    full = g.transform("size").to_numpy() == df.loc[m, "gsize"].to_numpy()
    wait = (d["dev"] - g.transform("min")).to_numpy()
    out[np.flatnonzero(m)] = np.where(full, wait, 0.0)
    return out


def lateness(df, peers: dict | None = None) -> pd.Series:
    """Per record of a complete instance: enqueue − median enqueue of the other members of the
    instance that are the rank's peers (``peers``: rank -> label of the ranks doing identical
    work; every member when None); NaN elsewhere and where the rank has no peer there.
    Vectorized: within an (instance, label) sorted by enqueue, the median of the others of the
    element at position k picks from the sorted values skipping k (numpy on the columns used:
    a frame sorted by four keys held GBs at 1,024 ranks)."""
    out = np.full(len(df), np.nan)
    idx = np.flatnonzero(df["complete"].to_numpy(bool)) if not df.empty else np.array([], int)
    if idx.size == 0:
        return pd.Series(out, index=df.index)
    g = df["group"]
    gcode = (g.cat.codes.to_numpy() if hasattr(g, "cat") else pd.factorize(g, sort=True)[0])[idx]
    ordinal = df["ordinal"].to_numpy()[idx]
    v = df["t_enq"].to_numpy(float)[idx]
    if peers:  # the peer label as a code in label order (sorting strings per record is slow)
        ranks = df["rank"].to_numpy()[idx]
        ur, inv = np.unique(ranks, return_inverse=True)
        names = [str(peers.get(int(r), "all")) if peers.get(int(r)) is not None else "all"
                 for r in ur.tolist()]
        order_names = sorted(set(names))
        label = np.array([order_names.index(x) for x in names], np.int64)[inv]
    else:
        label = np.zeros(idx.size, np.int64)
    o = np.lexsort((v, label, ordinal, gcode))  # stable: ties keep the records' order
    gcode, ordinal, label, v = gcode[o], ordinal[o], label[o], v[o]
    new = np.ones(o.size, bool)
    new[1:] = (gcode[1:] != gcode[:-1]) | (ordinal[1:] != ordinal[:-1]) | (label[1:] != label[:-1])
    start = np.maximum.accumulate(np.where(new, np.arange(o.size), 0))
    gid = np.cumsum(new) - 1
    n = np.bincount(gid)[gid]
    k = np.arange(o.size) - start
    del gid, new, gcode, ordinal, label

    def other(j):  # the j-th smallest of the other members (clipped: a lone member has none,
        return v[np.minimum(start + j + (j >= k), len(v) - 1)]  # and its value is dropped)

    m = n - 1  # how many others
    ok = m >= 1
    odd = m % 2 == 1
    lo = np.where(odd, (m - 1) // 2, np.maximum(m // 2 - 1, 0))
    hi = np.where(odd, lo, m // 2)
    lo, hi = np.where(ok, lo, 0), np.where(ok, hi, 0)
    med = (other(lo) + other(hi)) / 2.0
    rows = idx[o]
    out[rows[ok]] = (v - med)[ok]
    return pd.Series(out, index=df.index)


def per_step(df, column: str, how: str) -> pd.DataFrame:
    """(rank, step, column) aggregated per rank and step (``how``: sum | median), NaN rows out."""
    d = df[["rank", "step", column]].dropna(subset=[column])
    if d.empty:
        return pd.DataFrame(columns=["rank", "step", column])
    return d.groupby(["rank", "step"], as_index=False)[column].agg(how)


def waits_caused(df, late_rank: int, steps, compact=None, compact_steps=()) -> dict:
    """The waits that ``late_rank``'s arrivals explain on every rank sharing a collective with
    it: per waiter, min(its wait, late_rank's arrival − its arrival) summed per step; medians
    over ``steps`` (a step without such waits counts as 0). ``compact_steps`` (steps the detail
    does not hold whole) are taken from the compact records ``compact`` (:func:`compact_frame`,
    :func:`compact_waits`) instead. Returns ``{"by_rank": {rank: ms per step}, "ops": {op: ms
    per step, summed over the waiters}}``."""
    steps = list(steps)
    cset = set(compact_steps) & set(steps) if compact is not None else set()
    parts = []
    if not df.empty and "complete" in df:
        c = df.loc[df["complete"] & df["step"].isin([s for s in steps if s not in cset]),
                   ["rank", "step", "group", "ordinal", "t_enq", "device_ms", "wait_ms", "op"]]
        mine = c.loc[c["rank"] == late_rank, ["group", "ordinal", "t_enq", "device_ms"]].rename(
            columns={"t_enq": "t_late", "device_ms": "dev_late"})
        w = c[c["rank"] != late_rank].merge(mine, on=["group", "ordinal"]) if len(mine) else c.iloc[:0]
        if not w.empty:
            host_gap = (w["t_late"] - w["t_enq"]).clip(lower=0.0)
            # on the device the late rank runs the shortest kernel: the others' longer ones spun
            dev_gap = (pd.to_numeric(w["device_ms"], errors="coerce")
                       - pd.to_numeric(w["dev_late"], errors="coerce")).clip(lower=0.0).fillna(0.0)
            parts.append(w.assign(caused=np.minimum(w["wait_ms"], np.maximum(host_gap, dev_gap)))
                         [["rank", "step", "op", "caused"]])
    if cset:
        parts.append(compact_waits(compact, late_rank, sorted(cset)))
    parts = [p for p in parts if len(p)]
    if not parts:
        return {"by_rank": {}, "ops": {}}
    w = pd.concat(parts, ignore_index=True)
    per = w.groupby(["rank", "step"])["caused"].sum().unstack("step").reindex(columns=steps).fillna(0.0)
    by_rank = {int(r): float(np.median(row)) for r, row in zip(per.index, per.to_numpy(float))}
    n = max(1, len(by_rank))
    ops = (w.groupby("op")["caused"].sum() / max(1, len(steps)) / n).sort_values(ascending=False)
    return {"by_rank": by_rank, "ops": {str(o): float(v) for o, v in ops.items() if v > 0}}


P2P_OPS = ("send", "recv", "isend", "irecv")
COMPACT_COLUMNS = ["rank", "step", "group", "op", "gsize", "count", "blocked_ms", "device_ms",
                   "t_mean", "complete"]


def compact_frame(run) -> pd.DataFrame:
    """Per (rank, step, group, op) of the compact per-step records (RunDir.collective_steps),
    collectives only: ``group`` (the collectives analyzer's key: pg and members), ``gsize``,
    ``count``, ``blocked_ms`` and ``device_ms`` sums, ``t_mean`` (the rank's mean enqueue of
    that kind in the step, ms on rank 0's clock: analyzers/_align.py) and ``complete`` (every
    member of a ≥2-rank group logged it with the same count). Cached."""
    return once(run, "analyzers._lateness.compact_frame", _compact_frame)


def release_compact_frame(run) -> None:
    """Drop the cached compact frame (its readers are done: a later call builds it again)."""
    cache = getattr(run, "_cache", None)
    if cache is not None:
        cache.pop("analyzers._lateness.compact_frame", None)


def _compact_frame(run) -> pd.DataFrame:
    cs = run.collective_steps()
    if cs.empty:
        return pd.DataFrame(columns=COMPACT_COLUMNS)
    keep = (~cs["op"].isin(P2P_OPS) & cs["enqueue_first_ns"].notna()).to_numpy()
    if not keep.any():
        return pd.DataFrame(columns=COMPACT_COLUMNS)

    def col(c, dtype=None):  # the rows kept of one column (never a copy of every column)
        x = cs[c].to_numpy() if dtype is None else cs[c].to_numpy(dtype)
        return x if keep.all() else x[keep]

    ranks = col("rank").astype(np.int64)
    groups = coll._groups(run)
    # the group key names every member ("pg:0,1,...,1023"): one string per group, a code per
    # row (a string column would copy it into every row: 15 GB at 1,024 ranks x 3M rows);
    # the (rank, pg) pairs in their order of appearance, as integers (no tuple per row)
    pgc, pg_names = pd.factorize(col("pg"))
    width = len(pg_names) + 1
    rpf, rp_uniq = pd.factorize(ranks * width + pgc)
    keys, sizes = [], []
    for x in rp_uniq.tolist():
        r, pg = x // width, pg_names[x % width]
        g = groups.get((int(r), str(pg)))
        members = tuple(g.get("ranks") or ()) if g else ()
        keys.append(f"{pg}:{','.join(map(str, members))}" if members else f"{pg}:?")
        sizes.append(int(g.get("size") or len(members)) if g else 0)
    cats = list(dict.fromkeys(keys))
    pos = {k: i for i, k in enumerate(cats)}
    gcode = np.array([pos[k] for k in keys], np.int64)[rpf]
    gsz = np.array(sizes, np.int64)[rpf]
    del rpf, pgc
    first = col("enqueue_first_ns", np.int64).copy()
    al = _align.align(run)
    _align.align_cols(lambda r, x: np.asarray(al(r, x), np.int64), ranks, first)
    base = int(first.min())
    step = col("step").astype(np.int64)
    op = col("op")
    count = col("count").astype(np.int64)
    # complete: every member of a ≥2-rank group logged that (step, group, kind), with one count
    opc, op_names = pd.factorize(op)
    kid = pd.factorize((step - step.min()) * (len(cats) * (len(op_names) + 1))
                       + gcode * (len(op_names) + 1) + opc)[0]
    del opc
    nk = int(kid.max()) + 1
    pairs = np.unique(kid * (int(ranks.max()) + 1) + ranks)
    members = np.bincount(pairs // (int(ranks.max()) + 1), minlength=nk)
    del pairs
    o = np.argsort(kid, kind="stable")
    cuts = np.flatnonzero(np.r_[True, kid[o][1:] != kid[o][:-1]])
    cmin = np.minimum.reduceat(count[o], cuts)
    cmax = np.maximum.reduceat(count[o], cuts)
    ids = kid[o][cuts]
    same = np.zeros(nk, bool)
    same[ids] = cmin == cmax
    del o, cuts, cmin, cmax, ids
    complete = (gsz > 1) & (members[kid] >= gsz) & same[kid]
    del kid
    df = pd.DataFrame({
        "rank": ranks, "step": step,
        "group": pd.Categorical.from_codes(gcode, cats), "op": op,
        "gsize": gsz, "count": count, "blocked_ms": col("blocked_ms", float),
        "device_ms": col("device_ms", float),
        "t_mean": (first - base) / 1e6 + np.nan_to_num(col("enqueue_mean_ms", float)),
        "complete": complete})
    return df


def compact_lateness(cf, peers: dict | None = None) -> pd.Series:
    """Per row of :func:`compact_frame`: the rank's mean enqueue − the median mean enqueue of
    its other peers in that (step, group, kind) (``peers`` as in :func:`lateness`); NaN where
    the row is not complete or the rank has no peer there."""
    if cf.empty:
        return pd.Series(np.zeros(0), index=cf.index)
    inst = pd.factorize(pd.MultiIndex.from_arrays([cf["step"], cf["op"]]))[0]
    d = pd.DataFrame({"group": cf["group"].array, "ordinal": inst,
                      "t_enq": cf["t_mean"].to_numpy(float), "rank": cf["rank"].to_numpy(),
                      "complete": cf["complete"].to_numpy(bool)}, index=cf.index)
    return lateness(d, peers)


def compact_waits(cf, late_rank: int, steps) -> pd.DataFrame:
    """(rank, step, op, caused): per waiter and (step, group, kind), the part of its wait that
    ``late_rank``'s later arrival explains: min(its wait, count × (late_rank's mean enqueue −
    its own)), the gap being the larger of that and the device one (its device_ms − late_rank's)
    and the wait the larger of its blocked sum and its device_ms − the members' least."""
    cols = ["rank", "step", "op", "caused"]
    if cf.empty:
        return pd.DataFrame(columns=cols)
    # only the columns used, each taken for the rows used (3M rows at 1,024 ranks: a frame
    # copy of them ~250 MB)
    sel = cf["complete"].to_numpy(bool) & cf["step"].isin(list(steps)).to_numpy()
    if not sel.any():
        return pd.DataFrame(columns=cols)
    rank = cf["rank"].to_numpy()[sel]
    step = cf["step"].to_numpy()[sel]
    t_mean = cf["t_mean"].to_numpy(float)[sel]
    dev = cf["device_ms"].to_numpy(float)[sel]
    g = cf["group"]
    gcode = (g.cat.codes.to_numpy(np.int64) if hasattr(g, "cat") else pd.factorize(g)[0])[sel]
    ocode, ops = pd.factorize(cf["op"].to_numpy()[sel])
    wait = cf["blocked_ms"].to_numpy(float)[sel]
    if np.isfinite(dev).any():  # device-timed: the wait is also its device_ms − the members' least
        dev_min = pd.Series(dev).groupby([step, gcode, ocode], sort=False).transform("min")
        wait = np.maximum(wait, np.nan_to_num(dev - dev_min.to_numpy(float)))
        del dev_min
    else:
        wait = np.maximum(wait, 0.0)
    # each row's (step, group, kind) as one integer, late_rank's rows looked up by it (a
    # pandas merge on the three columns held GBs of intermediates at 1,024 ranks)
    key = (step.astype(np.int64) * (int(gcode.max()) + 1) + gcode) * (len(ops) + 1) + ocode
    late = rank == late_rank
    lk = key[late]
    o = np.argsort(lk, kind="stable")
    lk = lk[o]
    t_late = t_mean[late][o]
    dev_late = dev[late][o]
    rows = np.flatnonzero(~late)
    if not len(lk) or not len(rows):
        return pd.DataFrame(columns=cols)
    pos = np.clip(np.searchsorted(lk, key[rows]), 0, len(lk) - 1)
    hit = lk[pos] == key[rows]
    rows, pos = rows[hit], pos[hit]
    if not len(rows):
        return pd.DataFrame(columns=cols)
    count = cf["count"].to_numpy(float)[sel][rows]
    host_gap = np.clip((t_late[pos] - t_mean[rows]) * count, 0.0, None)
    dev_gap = np.nan_to_num(np.clip(dev[rows] - dev_late[pos], 0.0, None))
    caused = np.minimum(wait[rows], np.maximum(host_gap, dev_gap))
    return pd.DataFrame({"rank": rank[rows], "step": step[rows],
                         "op": np.asarray(ops, dtype=object)[ocode[rows]], "caused": caused})


TRANSFER_QUANTILE = 0.1    # a hand-over's own time: this quantile of its kind's latencies
TRANSFER_MIN_RECORDS = 5   # ... over at least this many records (else nothing beyond the send)


def p2p_upstream_waits(df) -> pd.DataFrame:
    """(rank, start_ns, end_ns) on each rank's own clock: the parts of every point-to-point
    wait that are not the transfer.

    * A receive's wait before its sender had issued the matching send: a pipeline stage waiting
      for the upstream stage to finish its work (the schedule's dependency, part of the bubble);
      likewise a send's wait before the receiver had posted the matching receive (gloo hands
      the data over once it is posted): the downstream stage still busy.
    * Past the transfer's own time after both sides had posted: the hand-over's latency (its
      end − max(send issued, receive posted)) varies by tens of ms on a loaded host (both
      stages' transport threads wait for a core) while the fastest hand-overs of the same size
      take a fraction of a ms; the transfer's own time is the TRANSFER_QUANTILE of that latency
      over the hand-overs of the same size on the same edge (src → dst; measured at either end,
      ≥ TRANSFER_MIN_RECORDS of them), what it takes when neither host delays it. Only ops
      whose rank was already waiting when the later side posted measure it: an isend or irecv
      waited for later (a pipeline schedule waits for its sends at the step's end) completes
      unobserved, and its end − issue is the rank's own work since (on 2 shared cores such
      sends "took" 7–119 ms and put the 10th percentile at 7.5 ms of a 0.1 ms hand-over). A
      slow link makes every hand-over slow: its quantile is as long, and the wait stays
      communication.

    The k-th receive on b from a pairs with the k-th send a→b in the group (p2p order per pair);
    the wait is [max(end − blocked, enqueue), end] for an asynchronous op (Work.wait() returned
    at its end), [enqueue, enqueue + blocked] for a blocking one; the other side's issue is put on
    the rank's clock through the aligned times (t_enq, ms)."""
    cols = ["rank", "start_ns", "end_ns"]
    if df.empty or "p2p" not in df or "peer" not in df:
        return pd.DataFrame(columns=cols)
    p = df.loc[df["p2p"].to_numpy(bool) & df["peer"].notna().to_numpy()
               & df["op"].isin(["send", "recv"]).to_numpy(),
               ["rank", "group", "op", "peer", "bytes", "async", "enqueue_ns", "end_ns", "t_enq",
                "t_end", "blocked_ms"]].copy()
    if p.empty:
        return pd.DataFrame(columns=cols)
    p["peer"] = p["peer"].astype(int)
    send = (p["op"] == "send").to_numpy()
    p["src"] = np.where(send, p["rank"], p["peer"])
    p["dst"] = np.where(send, p["peer"], p["rank"])
    p["k"] = p.groupby(["group", "op", "src", "dst"], observed=True).cumcount()
    ends = ["group", "src", "dst", "k"]
    # each side against the other's issue: a receive waits for the send to be issued, a send
    # (gloo hands the data over once the receive is posted) for the receive to be posted
    s = p.loc[send, [*ends, "t_enq"]].rename(columns={"t_enq": "t_other"})
    rv = p.loc[~send, [*ends, "t_enq"]].rename(columns={"t_enq": "t_other"})
    r = pd.concat([p.loc[~send].merge(s, on=ends), p.loc[send].merge(rv, on=ends)], ignore_index=True)
    r = r.loc[r["t_end"].notna().to_numpy()]
    if r.empty:
        return pd.DataFrame(columns=cols)
    blocked = np.nan_to_num(pd.to_numeric(r["blocked_ms"], errors="coerce").to_numpy(float))
    asy = r["async"].eq(True).to_numpy(bool)
    t_enq, t_end, t_other = (r[c].to_numpy(float) for c in ("t_enq", "t_end", "t_other"))
    t0 = np.where(asy, np.maximum(t_end - blocked, t_enq), t_enq)
    t1 = t0 + blocked
    # the transfer's own time per (edge, size): a low quantile of the hand-overs' latency, from
    # the ops whose rank was waiting when the later side posted (else end − issue holds the
    # rank's own work before it waited)
    ready = np.maximum(t_other, t_enq)
    lat = pd.Series(np.where((blocked > 0) & (t0 <= ready), t_end - ready, np.nan), index=r.index)
    key = [r["group"].astype(str), r["src"], r["dst"], r["bytes"]]
    q = lat.groupby(key).transform(lambda x: x.quantile(TRANSFER_QUANTILE)
                                   if x.count() >= TRANSFER_MIN_RECORDS else np.inf).to_numpy(float)
    dep = np.clip(np.minimum(t1, t_other) - t0, 0.0, blocked)              # [t0, t0 + dep)
    late_from = np.maximum(np.maximum(t_other, t_enq) + q, t0 + dep)       # [late_from, t1)
    late = np.clip(t1 - late_from, 0.0, None)
    enq = r["enqueue_ns"].astype(np.int64).to_numpy()
    end = pd.to_numeric(r["end_ns"], errors="coerce").fillna(0).astype(np.int64).to_numpy()
    start = np.where(asy, np.maximum(end - np.round(blocked * 1e6).astype(np.int64), enq), enq)
    stop = start + np.round(blocked * 1e6).astype(np.int64)
    rank = r["rank"].to_numpy()
    a, b = dep > 0, late > 0
    return pd.DataFrame({
        "rank": np.concatenate([rank[a], rank[b]]),
        "start_ns": np.concatenate([start[a], stop[b] - np.round(late[b] * 1e6).astype(np.int64)]),
        "end_ns": np.concatenate([start[a] + np.round(dep[a] * 1e6).astype(np.int64), stop[b]])})
