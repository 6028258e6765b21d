"""Every rank on one clock, for the timeline and the critical path.

Base: the probes' clock estimates (analyzers/_clock.py: NTP-style offsets to rank 0 at the start
and the end of the run, linear in between; identity on rank 0's host). Each estimate bounds the
true offset: it lies within ± its uncertainty (half the best round trip).

Refinement from matched collective ends, where the rank is on another host than rank 0 (one host,
one wall clock). Two estimates, the first where it exists:

- **bounds from causality**: in a collective where every member's result needs every member's
  input (all-reduce, all-gather, reduce-scatter, all-to-all, barrier), no member returns before
  every member has entered. The log's enqueue is taken before the call and its end after the
  return, so on true clocks end_r >= enqueue_j for every pair: the offset s of rank r's clock
  (its aligned times minus true times) lies in [max(enqueue_r - end_j), min(end_r - enqueue_j)]
  over the collectives it shares with already aligned ranks j — a round trip each, like the
  probes', and as rigorous: a slow wake-up only widens it. Host-side ends only: a CUDA op's
  wait() returns before the GPU is done (its end says nothing), so only groups of the gloo
  backend without device times count. Intersected with the probe's own bound, the rank is put at
  the middle and its residual uncertainty is the half-width;
- **the ends' median** (no usable bounds: CUDA groups, or too few): the median over the shared
  collectives of (its end − the median end of the others). It is applied when the shift exceeds
  three standard errors of that median (1.4826 × MAD / √n) and clamped to the probe's bound; the
  residual is min(probe bound, three standard errors) — the bound when the ends pulled against
  it. It is biased by the ranks' wake-up: a rank that waited in the collective returns later
  than the one that arrived last and never slept (1.7 ms on a loaded 2-core host).

Rank 0's host: uncertainty 0.
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers import _clock, collectives as coll

MIN_MATCHED = 5  # collectives shared with aligned ranks before their ends are trusted


class Alignment:
    """rank -> fn(local ns) -> aligned ns (scalars or int64 arrays), plus what each rank's
    mapping rests on (``info[rank]``: method, uncertainty_us, shift_us, matched)."""

    def __init__(self, base: dict, shift: dict, info: dict, how: str):
        self._base, self._shift, self.info, self.how = base, shift, info, how

    def __call__(self, rank: int, ns):
        fn = self._base.get(rank)
        out = fn(ns) if fn is not None else ns
        s = self._shift.get(rank, 0)
        if not s:
            return out
        return out - s if isinstance(out, (int, float)) else np.asarray(out, np.int64) - s

    def uncertainty_us(self) -> dict[int, float]:
        return {r: i.get("uncertainty_us", 0.0) for r, i in self.info.items()}


def by_rank(fn, ranks, *cols) -> None:
    """Each column replaced in place by ``fn(rank, its values)``, a rank's rows at a time (in
    their order), the rows put together once by a sort (a mask per rank costs ranks × rows:
    seconds at 1,024 ranks). ``fn`` may return None: the rows stay as they are."""
    ranks = np.asarray(ranks)
    if not len(ranks):
        return
    order = np.argsort(ranks, kind="stable")
    rs = ranks[order]
    cuts = np.flatnonzero(np.r_[True, rs[1:] != rs[:-1]])
    ends = np.r_[cuts[1:], len(rs)]
    for c in cols:
        v = c[order]
        for a, b in zip(cuts.tolist(), ends.tolist()):
            out = fn(int(rs[a]), v[a:b])
            if out is not None:
                v[a:b] = out
        c[order] = v


def align_cols(al, ranks, *cols) -> None:
    """Each column aligned in place (al: :func:`align`'s mapping), a rank's rows at a time."""
    by_rank(al, ranks, *cols)


# every member's result needs every member's input: no member returns before all have entered
CAUSAL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")


def _ends_table(run, base) -> dict:
    """Every completed collective of a ≥2-rank group: rank, instance code, aligned enqueue and
    end ns, and ``causal``: a host-side op (gloo group, no device time) of CAUSAL_OPS."""
    df = coll._frame(run)
    empty = {"rank": np.zeros(0, int), "inst": np.zeros(0, int), "enq": np.zeros(0, np.int64),
             "end": np.zeros(0, np.int64), "causal": np.zeros(0, bool)}
    if df.empty:
        return empty
    df = df[~df["p2p"].to_numpy(bool) & (df["gsize"].to_numpy() > 1) & df["end_ns"].notna().to_numpy()]
    if df.empty:
        return empty
    ranks = df["rank"].to_numpy(int)
    ordinal = df["ordinal"].to_numpy().astype(np.int64)
    gcode = df["group"].cat.codes.to_numpy().astype(np.int64)
    inst = gcode * (int(ordinal.max()) + 1) + ordinal
    end = df["end_ns"].astype(np.int64).to_numpy().copy()
    enq = df["enqueue_ns"].astype(np.int64).to_numpy().copy()
    by_rank(lambda r, x: np.asarray(base[r](x), np.int64) if base.get(r) is not None else None,
            ranks, end, enq)
    backend = {k: str(g.get("backend") or "") for k, g in coll._groups(run).items()}
    pg = df["pg"].astype(str).to_numpy()
    host_side = np.array([backend.get((int(r), p), "") == "gloo" for r, p in zip(ranks, pg)], bool)
    if "device_ms" in df.columns:
        host_side &= df["device_ms"].isna().to_numpy()
    causal = host_side & df["op"].isin(CAUSAL_OPS).to_numpy()
    return {"rank": ranks, "inst": inst, "enq": enq, "end": end, "causal": causal}


def causal_bounds(t: dict, r: int, aligned: np.ndarray) -> tuple[float, float, int]:
    """(lo, hi, n): rank r's clock offset (its aligned times minus true ones) lies in [lo, hi]
    by causality over the ``n`` causal collectives it shares with the ``aligned`` rows' ranks."""
    return _bounds(t, np.flatnonzero(t["rank"] == r), _reference(t, aligned))


def _reference(t: dict, aligned: np.ndarray):
    """Per causal instance of the ``aligned`` rows: (instances, last enqueue, first end), or
    None without any."""
    ref = aligned & t["causal"]
    if not ref.any():
        return None
    inst = t["inst"][ref]
    u, inv = np.unique(inst, return_inverse=True)
    last_enq = np.full(len(u), np.iinfo(np.int64).min)
    np.maximum.at(last_enq, inv, t["enq"][ref])
    first_end = np.full(len(u), np.iinfo(np.int64).max)
    np.minimum.at(first_end, inv, t["end"][ref])
    return u, last_enq, first_end


def _bounds(t: dict, rows: np.ndarray, reference) -> tuple[float, float, int]:
    """causal_bounds of the rank whose rows of ``t`` are ``rows``."""
    if reference is None:
        return -np.inf, np.inf, 0
    u, last_enq, first_end = reference
    mine = rows[t["causal"][rows]]
    j = np.searchsorted(u, t["inst"][mine])
    ok = (j < len(u)) & (u[np.minimum(j, len(u) - 1)] == t["inst"][mine])
    if not ok.any():
        return -np.inf, np.inf, 0
    j = j[ok]
    hi = float(np.min(t["end"][mine][ok] - last_enq[j]))
    lo = float(np.max(t["enq"][mine][ok] - first_end[j]))
    return lo, hi, int(ok.sum())


def align(run) -> Alignment:
    """The run's alignment (cached per run)."""
    cache = getattr(run, "_cache", None)
    key = "analyzers._align"
    if cache is not None and key in cache:
        return cache[key]

    base = _clock.offsets(run)
    unc = _clock.uncertainty_ns(run)
    est = _clock.estimates(run)
    ref_host = run.rank_meta(0).get("host") if 0 in run.ranks else None
    info: dict[int, dict] = {}
    shift: dict[int, int] = {}
    for r in run.ranks:
        same = r == 0 or (ref_host is not None and run.rank_meta(r).get("host") == ref_host)
        method = ("reference" if r == 0 else "same host as rank 0" if same
                  else "clock probe" if r in est else "none: no clock estimate")
        info[r] = {"method": method, "uncertainty_us": 0.0 if same else round(unc.get(r, 0.0) / 1e3, 1)}
    off_host = [r for r in run.ranks if info[r]["uncertainty_us"] > 0 or info[r]["method"].startswith("none")]
    if off_host:
        _refine(run, base, unc, info, shift, off_host)
    how = ("clock probes (NTP-style round trips to rank 0 at the start and end of the run), "
           "refined from matched collective ends within their uncertainty")
    result = Alignment(base, shift, info, how)
    if cache is not None:
        cache[key] = result
    return result


def _refine(run, base, unc, info, shift, off_host) -> None:
    t = _ends_table(run, base)
    ranks, inst, end = t["rank"], t["inst"], t["end"]
    if not len(ranks):
        return
    aligned = np.isin(ranks, [r for r in run.ranks if r not in off_host])
    # per instance, the median end over the aligned ranks (as floats, np.median's arithmetic)
    med = pd.Series(end[aligned].astype(np.float64)).groupby(inst[aligned]).median()
    keys, meds = med.index.to_numpy(np.int64), med.to_numpy(np.float64)
    order = np.argsort(ranks, kind="stable")
    cuts = np.searchsorted(ranks[order], off_host), np.searchsorted(ranks[order], off_host, "right")
    reference = _reference(t, aligned)
    for r, a, b in zip(off_host, *cuts):
        u = unc.get(r, 0.0)
        if info[r]["method"].startswith("none"):
            u = float("inf")  # no bound: the ends alone
        lo, hi, n = _bounds(t, order[a:b], reference)
        lo, hi = max(lo, -u), min(hi, u)
        if n >= MIN_MATCHED and np.isfinite(lo) and np.isfinite(hi) and lo <= hi and hi - lo < 2 * u:
            s = (lo + hi) / 2
            shift[r] = int(round(s))
            info[r].update(method=info[r]["method"] + " + collective bounds", matched=n,
                           shift_us=round(s / 1e3, 1), uncertainty_us=round((hi - lo) / 2e3, 1))
            continue
        rows = order[a:b]  # the rank's records, in their order
        j = np.clip(np.searchsorted(keys, inst[rows]), 0, max(0, len(keys) - 1))
        hit = (keys[j] == inst[rows]) if len(keys) else np.zeros(len(rows), bool)
        d = end[rows][hit] - meds[j[hit]]
        if len(d) < MIN_MATCHED:
            continue
        s = float(np.median(d))
        # the median's standard error (the ends' own jitter, MAD-scaled, over √n matches)
        se = 1.4826 * float(np.median(np.abs(d - s))) / np.sqrt(len(d))
        s_clamped = float(np.clip(s, -u, u))
        if abs(s_clamped) < max(3 * se, 1_000.0):  # within the ends' own noise: no help
            info[r]["matched"] = int(len(d))
            continue
        shift[r] = int(round(s_clamped))
        res = u if s_clamped != s else min(u, 3 * se)
        info[r].update(method=info[r]["method"] + " + collective ends", matched=int(len(d)),
                       shift_us=round(s_clamped / 1e3, 1), uncertainty_us=round(res / 1e3, 1))


def align_traces(traces: dict) -> tuple[dict, dict, str]:
    """Bare profiler traces (no always-on log): each trace's timestamps are its host's wall
    clock (Kineto's absolute epoch times). Ranks are shifted so that matched collectives (same
    process group and sequence number in the traces' collective records) end together, by the
    median difference to the lowest rank; ranks without matches keep their host clock.
    Returns ({rank: shift ns to subtract}, {rank: info}, how)."""
    ends: dict[int, dict] = {}
    for r, t in traces.items():
        ends[r] = _trace_comm_ends(t)
    ranks = sorted(traces)
    shift: dict[int, int] = {}
    info: dict[int, dict] = {}
    if not ranks:
        return shift, info, ""
    ref = ranks[0]
    for r in ranks:
        if r == ref:
            info[r] = {"method": "reference", "uncertainty_us": 0.0}
            continue
        common = set(ends[r]) & set(ends[ref])
        if len(common) < MIN_MATCHED:
            info[r] = {"method": "host wall clock (trace timestamps); no matched collectives",
                       "uncertainty_us": None, "matched": len(common)}
            continue
        d = np.array([ends[r][k] - ends[ref][k] for k in common], float)
        s = float(np.median(d))
        shift[r] = int(round(s))
        info[r] = {"method": "host wall clock + collective ends", "matched": len(common),
                   "shift_us": round(s / 1e3, 1),
                   "uncertainty_us": round(float(np.median(np.abs(d - s))) / 1e3, 1)}
    how = ("the traces' absolute timestamps (each host's wall clock), shifted so that the same "
           "collective (process group, sequence number) ends together on every rank")
    return shift, info, how


def _trace_comm_ends(t) -> dict:
    """(pg, seq) -> end ns of the trace's collective records (the GPU kernel when it carries them,
    else the CPU op)."""
    comm = t.tables.comm
    ev = t.tables.events
    if comm.empty or "seq" not in comm or "pg_name" not in comm:
        return {}
    rows = comm["row"]
    seq = comm["seq"]
    pg = comm["pg_name"]
    is_gpu = ev["is_gpu"]
    end = ev["end_ns"]
    out: dict = {}
    for i in range(len(rows)):
        s = seq[i]
        if s is None or int(s) < 0:
            continue
        k = (str(pg[i]), int(s))
        row = int(rows[i])
        if k not in out or is_gpu[row]:
            out[k] = int(end[row])
    return out
