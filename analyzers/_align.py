"""Every rank on one clock, for the timeline and the critical path.

Base: the probes' clock estimates (analyzers/_clock.py: NTP-style offsets to rank 0 at the start
and the end of the run, linear in between; identity on rank 0's host). Each estimate bounds the
true offset: it lies within ± its uncertainty (half the best round trip).

Refinement from matched collective ends: a collective completes on all its members at nearly the
same moment (everyone leaves once the last one arrived and the transfer is done). For every rank
on another host than rank 0, the median over the collectives it shares with already aligned ranks
of (its end − the median end of the others) is an offset estimate whose spread is the ends' own
spread. It is applied only where it helps: when the rank is on another host (one host, one wall
clock), when the shift exceeds three standard errors of that median (1.4826 × MAD / √n), and
clamped to the base estimate's uncertainty interval (the round trips bound the offset; the ends
only choose within that bound). The residual uncertainty of a rank is then min(base
uncertainty, three standard errors) — the base uncertainty when the ends pulled against the
bound — and 0 on rank 0's host.
"""

from __future__ import annotations

import numpy as np

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


def _ends_table(run, base) -> tuple:
    """(rank, instance code, aligned end ns) of every completed collective of a ≥2-rank group."""
    df = coll._frame(run)
    if df.empty:
        return np.zeros(0, int), np.zeros(0, int), np.zeros(0, np.int64)
    df = df[~df["p2p"].to_numpy(bool) & (df["gsize"].to_numpy() > 1) & df["end_ns"].notna().to_numpy()]
    if df.empty:
        return np.zeros(0, int), np.zeros(0, int), np.zeros(0, np.int64)
    ranks = df["rank"].to_numpy(int)
    ordinal = df["ordinal"].to_numpy().astype(np.int64)
    gcode = df["group"].cat.codes.to_numpy().astype(np.int64)
    inst = gcode * (int(ordinal.max()) + 1) + ordinal
    end = df["end_ns"].astype(np.int64).to_numpy()
    out = end.copy()
    for r in np.unique(ranks):
        m = ranks == r
        fn = base.get(int(r))
        if fn is not None:
            out[m] = np.asarray(fn(end[m]), np.int64)
    return ranks, inst, out


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
    ranks, inst, end = _ends_table(run, base)
    if not len(ranks):
        return
    aligned = np.isin(ranks, [r for r in run.ranks if r not in off_host])
    ref_end: dict[int, list] = {}
    for i, e in zip(inst[aligned], end[aligned]):
        ref_end.setdefault(int(i), []).append(int(e))
    med = {i: float(np.median(v)) for i, v in ref_end.items()}
    for r in off_host:
        m = ranks == r
        d = np.array([e - med[int(i)] for i, e in zip(inst[m], end[m]) if int(i) in med])
        if len(d) < MIN_MATCHED:
            continue
        s = float(np.median(d))
        # the median's standard error (the ends' own jitter, MAD-scaled, over √n matches)
        se = 1.4826 * float(np.median(np.abs(d - s))) / np.sqrt(len(d))
        u = unc.get(r, 0.0)
        if info[r]["method"].startswith("none"):
            u = float("inf")  # no bound: the ends alone
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
