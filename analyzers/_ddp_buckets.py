"""DDP's gradient buckets in the collective log (records with ``api`` ``ddp.bucket``): how many a
step issues and how large, what one bucket's all-reduce costs, and the backward pass replayed
with the buckets merged to a larger ``bucket_cap_mb``.

Measured per rank and analysed step, from the bucket records' launch (``enqueue_ns``) and
completion (``end_ns``) times and sizes:

* ``span``: first bucket launch → last bucket completion (the backward pass from its first
  ready bucket, and the wait for the last bucket's all-reduce); the rest of the step is not
  touched by the bucket size;
* ``gap``: the median time between consecutive launches, the backward compute per bucket (its
  longest gaps are stalls, not compute: the median leaves them out);
* each bucket's *service time*: buckets sorted by completion, ``end − max(previous end,
  launch)`` (a process group runs its collectives one after the other); fitted as
  ``alpha + beta × bytes`` over every bucket of the analysed steps: ``beta`` from the median
  service time per distinct size (least squares, ≥ 0), ``alpha`` the median of
  ``service − beta × bytes``.

Replay with cap C: buckets merged in launch order (the first at most FIRST_BUCKET_BYTES, as
DDP's first bucket; then at most C); a merged bucket is launched when its last member was
(``gap`` × its index after the first launch), then runs after the previous one:
``end_j = max(end_{j−1}, launch_j) + alpha + beta × bytes_j``. The span after is the last end.
"""

from __future__ import annotations

import numpy as np

API = "ddp.bucket"
FIRST_BUCKET_BYTES = 1 << 20    # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_CAP_BYTES = 25 << 20    # DDP's default bucket_cap_mb (25 MiB)
MIN_SAMPLES_PER_SIZE = 3        # a size's median service time takes part in beta's fit


def measure(coll, kept_steps, cap_bytes: int | None = None, steps=None) -> dict | None:
    """The buckets of each (rank, step) of ``kept_steps`` and their replay with the buckets
    merged to ``target`` (DDP's default cap, or the job's own cap when larger). ``coll``: the
    run's collective records (run.collectives()); ``steps``: its step records (run.steps()),
    whose ``dur_ms`` each row then carries as ``step_ms``. None without DDP bucket records."""
    if coll is None or coll.empty or "api" not in coll or "bucket" not in coll:
        return None
    b = coll.loc[coll["api"].eq(API) & coll["end_ns"].notna() & coll["enqueue_ns"].notna()]
    if "replay" in b:
        b = b.loc[~b["replay"].eq(True)]
    if kept_steps is not None:
        b = b.loc[b["step"].isin(list(kept_steps))]
    if b.empty:
        return None
    b = b.loc[b["rank"].notna() & b["step"].notna()]  # (groupby's keys: NaN is no group)
    if b.empty:
        return None
    g = _groups(b)
    alpha, beta = _fit(g["service_sizes"], g["service_ns"])
    gap = float(np.median(g["gaps_ns"])) if len(g["gaps_ns"]) else 0.0
    target = max(DEFAULT_CAP_BYTES, int(cap_bytes or 0))
    dur = {}
    if steps is not None and not steps.empty and {"rank", "step", "dur_ms"} <= set(steps):
        dur = {(int(a), int(b)): float(c) for a, b, c in
               steps[["rank", "step", "dur_ms"]].itertuples(index=False)}
    out = []
    memo: dict = {}  # replay of a step's bucket sizes (steps repeat them)
    sizes = g["sizes"]
    for rank, step, lo, hi, nb, tot, span in zip(g["rank"], g["step"], g["lo"], g["hi"],
                                                 g["buckets"], g["bytes"], g["span_ns"]):
        key = sizes[lo:hi].tobytes()
        if key not in memo:
            merged = plan(sizes[lo:hi], target)
            memo[key] = (len(merged), replay(merged, gap, alpha, beta))
        n_after, after = memo[key]
        out.append({"rank": rank, "step": step, "buckets": nb,
                    "bytes": tot, "span_ms": span / 1e6,
                    "buckets_after": n_after, "span_ms_after": after / 1e6,
                    "step_ms": dur.get((rank, step))})
    n = np.array([x["buckets"] for x in out])
    return {"per_rank_step": out, "buckets_per_step": float(np.median(n)),
            "median_bucket_bytes": float(np.median(sizes)),
            "gradient_bytes": float(np.median([x["bytes"] for x in out])),
            "cap_bytes": int(cap_bytes) if cap_bytes else None, "target_cap_bytes": target,
            "buckets_after": int(np.median([x["buckets_after"] for x in out])),
            "alpha_ms": alpha / 1e6, "beta_ms_per_mb": beta * (1 << 20) / 1e6,
            "gap_ms": gap / 1e6}


def _groups(b) -> dict:
    """Per (rank, step) of the bucket records ``b``, sorted by rank then step, all at once:
    rank, step, buckets, bytes, span_ns and the group's slice [lo, hi) of ``sizes`` (in launch
    order); over every group: gaps_ns (between consecutive launches) and service_ns with its
    service_sizes (buckets sorted by completion)."""
    rank = b["rank"].to_numpy(np.float64).astype(np.int64)
    step = b["step"].to_numpy(np.float64).astype(np.int64)
    enq = b["enqueue_ns"].to_numpy(np.float64)
    end = b["end_ns"].to_numpy(np.float64)
    size = b["bytes"].fillna(0).to_numpy(np.float64)
    o = np.lexsort((enq, step, rank))  # by group, then launch (stable: ties keep their order)
    rank, step, enq, end, size = rank[o], step[o], enq[o], end[o], size[o]
    first = np.r_[True, (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])]
    starts = np.flatnonzero(first)
    grp = np.cumsum(first) - 1
    by_end = np.lexsort((end, grp))  # within each group by completion (stable)
    e_end, e_enq = end[by_end], enq[by_end]
    prev = np.r_[-np.inf, e_end[:-1]]
    prev[first] = -np.inf  # (by_end keeps the groups in place: group starts are the same rows)
    service = e_end - np.maximum(prev, e_enq)
    hi = np.r_[starts[1:], len(rank)]
    return {"rank": rank[starts].tolist(), "step": step[starts].tolist(),
            "lo": starts.tolist(), "hi": hi.tolist(), "buckets": (hi - starts).tolist(),
            "bytes": np.add.reduceat(size, starts).tolist(),
            "span_ns": (np.maximum.reduceat(end, starts) - enq[starts]).tolist(),
            "sizes": size, "gaps_ns": np.diff(enq)[~first[1:]],
            "service_ns": service, "service_sizes": size[by_end]}


def plan(sizes: np.ndarray, cap: int) -> list[tuple[int, float]]:
    """Buckets in launch order merged under ``cap`` bytes (the first under FIRST_BUCKET_BYTES):
    [(index of its last member, bytes)]. A bucket larger than the cap stays one bucket."""
    out: list[tuple[int, float]] = []
    acc, limit = 0.0, min(FIRST_BUCKET_BYTES, cap)
    for i, s in enumerate(sizes.tolist()):
        if acc and acc + s > limit:
            out.append((i - 1, acc))
            acc, limit = 0.0, cap
        acc += s
    out.append((len(sizes) - 1, acc))
    return out


def replay(merged: list[tuple[int, float]], gap: float, alpha: float, beta: float) -> float:
    """First launch → last completion (ns) of the merged buckets: each launched ``gap`` × its
    last member's index after the first launch, run one after the other."""
    t = 0.0
    for last, size in merged:
        t = max(t, gap * last) + alpha + beta * size
    return t


def _fit(sizes: np.ndarray, service: np.ndarray) -> tuple[float, float]:
    """(alpha ns, beta ns per byte): beta by least squares over the median service time of each
    size seen ≥ MIN_SAMPLES_PER_SIZE times (0 with fewer than two such sizes or a negative
    slope), alpha the median of service − beta × size (≥ 0)."""
    if not len(service):
        return 0.0, 0.0
    uniq, inv, counts = np.unique(sizes, return_inverse=True, return_counts=True)
    pts = [(float(u), float(np.median(service[inv == k])))
           for k, u in enumerate(uniq.tolist()) if counts[k] >= MIN_SAMPLES_PER_SIZE]
    beta = 0.0
    if len(pts) >= 2:
        x = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        if np.ptp(x) > 0:
            beta = max(0.0, float(np.polyfit(x, y, 1)[0]))
    alpha = max(0.0, float(np.median(service - beta * sizes)))
    return alpha, beta
