"""What overlapping a rank's blocking collectives would also remove, on CPU traces: the parts of
the time the rank spends in them that comm_compute's peer-arrival rule keeps out of exposed
communication (a wait for another rank to arrive; the host's delay past the op's own time) but
that are caused by the communication itself. The overlap bound (estimates.exposed_comm_hidden)
credits them back; docs/estimates.md has the model and the runs it was checked against.

- **Chained waits.** Between back-to-back blocking collectives a rank that finished the previous
  one first waits in the next for its peer, which is still finishing the previous one (its
  transfer, or its host's delay in it). That wait is communication: overlap removes it. Only
  the time the last other member to arrive spent *after the arrival of all* in one of its own
  collectives counts; a peer that arrives late from its own work (a straggler, a slow input)
  is not communication and gets no credit.
- **Host delay under idle time.** A collective's time past the last arrival beyond its kind's
  own time (the same low quantile comm_compute uses) is the host's delay — on CPU, the ranks
  and the backend's threads contending for cores. Overlapped with busy compute it stays (the
  cores are no freer); overlapped with time the host sleeps or waits (the schedstat probes'
  off-CPU time outside communication and input), it goes. The bound credits it only up to that
  idle time.
- **Idle host time**: per profiled step, the main thread's time neither on a CPU nor waiting
  for one (steps.jsonl ``cpu_ms``/``cpu_wait_ms``) less the step's exposed communication and
  input wait, at most the trace's time that is neither compute, communication nor input.

Credits of the step's last collective (from its enqueue on) are never given: nothing is left to
hide it under. Pure functions on arrays, and :func:`credits` that applies them to a run.
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers import _intervals as iv
from trainprof.analyzers import _lateness, _transfer_time

KEYS = ("chained_transfer_fraction", "chained_delay_fraction", "host_delay_fraction",
        "idle_host_fraction")


def covered(lo, hi, sets: dict, keys) -> np.ndarray:
    """Per query interval [lo[i], hi[i]): the length of its intersection with ``sets[keys[i]]``
    (a sorted, disjoint (starts, ends) pair, as _intervals builds them); 0 where the key has no
    set. Vectorized per key by the set's cumulative length up to a time."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    out = np.zeros(len(lo), np.int64)
    for k, m in _by_key(keys):
        s, e = sets.get(k, (np.zeros(0, np.int64),) * 2)
        m = m[hi[m] > lo[m]]
        if not len(m) or not len(s):
            continue
        cum = np.concatenate(([0], np.cumsum(e - s)))

        def upto(t, s=s, e=e, cum=cum):  # time in the set before t
            i = np.searchsorted(s, t, side="right")  # pieces starting at or before t
            j = np.maximum(i - 1, 0)
            part = np.where(i > 0, np.clip(np.minimum(t, e[j]) - s[j], 0, None), 0)
            return cum[j] + part

        out[m] = upto(hi[m]) - upto(lo[m])
    return out


def _by_key(keys):
    """(key, indices) per distinct key, from one stable sort (a mask per key costs keys ×
    records: ranks × collectives at scale)."""
    keys = np.asarray(keys)
    if not len(keys):
        return []
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    cut = np.flatnonzero(ks[1:] != ks[:-1]) + 1
    return [(k.item() if hasattr(k, "item") else k, idx)
            for k, idx in zip(ks[np.concatenate(([0], cut))], np.split(order, cut))]


def split_waits(total_ms, t_enq, t_last, group, op, nbytes):
    """The split of a blocking collective's time (per record, ms) that comm_compute judges
    exposed communication by: ``wait`` before the last other member arrived (min(total,
    t_last − t_enq)); ``late``, the host's delay: the time past that beyond the op's own time
    (_transfer_time.own_time: a low quantile over the group's instances of the op of about the
    same size, none without enough of them)."""
    total = np.nan_to_num(np.asarray(total_ms, float))
    wait = np.minimum(total, np.clip(np.asarray(t_last, float) - np.asarray(t_enq, float), 0.0, None))
    after = total - wait
    own = _transfer_time.own_time(np.asarray(group), np.asarray(op), np.asarray(nbytes, dtype=object), after)
    return wait, np.clip(after - own, 0.0, None)


def last_arrivals(group, ordinal, rank, t_enq) -> pd.DataFrame:
    """Per instance (group, ordinal): the three latest arrivals, ``r1, t1`` (latest), ``r2, t2``,
    ``r3, t3`` (rank −1 and t −inf where the instance has fewer members)."""
    d = pd.DataFrame({"group": np.asarray(group), "ordinal": ordinal,
                      "rank": rank, "t": t_enq})
    d = d.sort_values(["group", "ordinal", "t"], ascending=[True, True, False], kind="mergesort")
    d["k"] = d.groupby(["group", "ordinal"], sort=False).cumcount()
    out = d[["group", "ordinal"]].drop_duplicates().set_index(["group", "ordinal"])
    for k in (0, 1, 2):
        top = d[d["k"] == k].set_index(["group", "ordinal"])
        out[f"r{k + 1}"] = top["rank"].reindex(out.index).fillna(-1).astype(np.int64)
        out[f"t{k + 1}"] = top["t"].reindex(out.index).fillna(-np.inf)
    return out


def waited_for(rank, r1, t1, r2, t2, r3, t3):
    """Per record of ``rank`` in an instance with latest arrivals (r1, t1) ≥ (r2, t2) ≥ (r3, t3):
    the last *other* member to arrive (rank, t) and the arrival of the other members but that
    one (−inf when none): the record's wait is for the first alone only after the second."""
    rank, r1, r2, r3 = (np.asarray(x) for x in (rank, r1, r2, r3))
    t1, t2, t3 = (np.asarray(x, float) for x in (t1, t2, t3))
    me1, me2 = r1 == rank, r2 == rank
    last_r = np.where(me1, r2, r1)
    last_t = np.where(me1, t2, t1)
    second = np.where(me1 | me2, t3, t2)
    return last_r, last_t, second


def chained(t_enq, wait, last_r, second, transfer: dict, delay: dict):
    """Per record: the part of its wait for the last other member (from ``second``, the time the
    other members but that one had arrived, until t_enq + wait) during which that member was in
    one of its own collectives after everyone had arrived: in its transfer (``transfer``: rank ->
    set of ns) or in its host's delay (``delay``). (chained transfer ns, chained delay ns)."""
    lo = np.round(np.maximum(np.asarray(t_enq, float), np.asarray(second, float)) * 1e6)
    hi = np.round((np.asarray(t_enq, float) + np.asarray(wait, float)) * 1e6)
    lo = np.where(np.isfinite(lo), lo, hi).astype(np.int64)
    hi = hi.astype(np.int64)
    return covered(lo, hi, transfer, last_r), covered(lo, hi, delay, last_r)


def idle_host_ms(off_cpu_ms: float, exposed_ms: float, data_ms: float, other_ms: float) -> float:
    """A step's idle host time: off-CPU time (neither on a CPU nor runnable) less the exposed
    communication and input wait (the thread sleeps in those too), at most ``other_ms`` (the
    trace's time that is neither compute, communication nor input)."""
    return float(max(0.0, min(off_cpu_ms - exposed_ms - data_ms, other_ms)))


def off_cpu_ms(lo: int, hi: int, recs) -> float | None:
    """Off-CPU time in [lo, hi) ns from step records (start_ns, end_ns, dur_ms, cpu_ms,
    cpu_wait_ms), each weighted by its overlap with the window; None without a record that
    overlaps and has the CPU fields."""
    got, any_ = 0.0, False
    for s, e, dur, cpu, wait in recs:
        ov = min(e, hi) - max(s, lo)
        if ov <= 0 or e <= s or not (np.isfinite(cpu) and np.isfinite(wait)):
            continue
        any_ = True
        got += max(dur - cpu - wait, 0.0) * ov / (e - s)
    return got if any_ else None


# --------------------------------------------------------------------------- a run
def credits(run, per_rank: list[dict], per_step: list[dict]) -> dict[int, dict]:
    """rank -> {KEYS: fractions of its analysed profiled steps' window} for CPU ranks of a run
    with a collective log; {} when there is nothing to credit."""
    rows: dict[int, list[dict]] = {}
    for r in per_rank:
        if r.get("kind") != "cpu" or r.get("whole_trace_window"):
            continue
        use = set(r["steps"])
        got = [x for x in per_step if x["rank"] == r["rank"] and x["step"] in use
               and x.get("start_ns") is not None]
        if got:
            rows[r["rank"]] = got
    if not rows:
        return {}
    df = _lateness.frame(run)
    if df.empty:
        return {}
    comp = df.loc[df["complete"].to_numpy(bool)]
    sync = ~comp["async"].eq(True).to_numpy(bool)
    c = comp.loc[sync, ["rank", "group", "ordinal", "op", "bytes", "enqueue_ns", "t_enq", "wait_ms"]]
    if c.empty:
        return {}
    # groups by code: at 1,024 ranks a group's name is ~5 KB, and 700k of them as strings took
    # 24 s and GBs
    g = comp["group"]
    gcode = g.cat.codes.to_numpy(np.int64) if isinstance(g.dtype, pd.CategoricalDtype) \
        else pd.factorize(g)[0]
    top = last_arrivals(gcode, comp["ordinal"].to_numpy(), comp["rank"].to_numpy(),
                        comp["t_enq"].to_numpy(float))
    c = c.assign(group=gcode[sync]).join(top, on=["group", "ordinal"])
    rank = c["rank"].to_numpy(np.int64)
    t_enq = c["t_enq"].to_numpy(float)
    last_r, last_t, second = waited_for(rank, c["r1"], c["t1"], c["r2"], c["t2"], c["r3"], c["t3"])
    total = np.nan_to_num(c["wait_ms"].to_numpy(float))
    wait, late = split_waits(total, t_enq, last_t, c["group"].to_numpy(), c["op"].to_numpy(),
                             c["bytes"].to_numpy())
    # each rank's time in its collectives after every member arrived: transfer, then host delay
    ns = lambda t: np.round(t * 1e6).astype(np.int64)  # noqa: E731 - reference clock, ms → ns
    a, b, z = ns(t_enq + wait), ns(t_enq + total - late), ns(t_enq + total)
    of_rank = dict(_by_key(rank))
    transfer = {int(r): iv.union(a[m], b[m]) for r, m in of_rank.items()}
    delay = {int(r): iv.union(b[m], z[m]) for r, m in of_rank.items()}
    ch_t, ch_d = chained(t_enq, wait, last_r, second, transfer, delay)
    enq = c["enqueue_ns"].astype(np.int64).to_numpy()  # the rank's own clock, as the trace's
    late_ns = ns(late)
    steps = _step_records(run, list(rows))
    out = {}
    for r, rs in rows.items():
        mine = of_rank.get(r, np.zeros(0, np.int64))
        sums = dict.fromkeys(KEYS, 0.0)
        win = 0.0
        for x in rs:
            lo, hi = x["start_ns"], x["end_ns"]
            inside = mine[(enq[mine] >= lo) & (enq[mine] < hi)]
            if len(inside):  # the step's last collective (its enqueue on) is never credited
                inside = inside[enq[inside] < enq[inside].max()]
            room = max(x["exposed_comm_ms"] - (x.get("tail_exposed_ms") or 0.0), 0.0)
            parts = [ch_t[inside].sum() / 1e6, ch_d[inside].sum() / 1e6, late_ns[inside].sum() / 1e6]
            scale = min(1.0, room / sum(parts)) if sum(parts) > 0 else 0.0
            for k, v in zip(KEYS, parts):
                sums[k] += v * scale
            off = off_cpu_ms(lo, hi, steps.get(r, []))
            if off is not None:
                sums["idle_host_fraction"] += idle_host_ms(
                    off, x["exposed_comm_ms"], x.get("data_ms") or 0.0,
                    (x.get("other_ms") or 0.0) + (x.get("idle_ms") or 0.0))
            win += x["window_ms"]
        if win > 0 and any(sums.values()):
            out[r] = {k: round(v / win, 4) for k, v in sums.items()}
    return out


def _step_records(run, ranks: list[int]) -> dict[int, list[tuple]]:
    """rank -> its step records with CPU fields, as (start_ns, end_ns, dur_ms, cpu_ms,
    cpu_wait_ms); {} without them."""
    try:
        st = run.steps()
    except Exception:  # noqa: BLE001 - bare traces have no step records
        return {}
    need = {"rank", "start_ns", "end_ns", "dur_ms", "cpu_ms", "cpu_wait_ms"}
    if st is None or st.empty or not need <= set(st):
        return {}
    st = st.loc[st["rank"].isin(ranks)]
    out: dict[int, list[tuple]] = {}
    for r, s, e, d, cpu, w in zip(st["rank"].tolist(), st["start_ns"].tolist(), st["end_ns"].tolist(),
                                  pd.to_numeric(st["dur_ms"], errors="coerce").tolist(),
                                  pd.to_numeric(st["cpu_ms"], errors="coerce").tolist(),
                                  pd.to_numeric(st["cpu_wait_ms"], errors="coerce").tolist()):
        if s is not None and e is not None and s == s and e == e:
            out.setdefault(int(r), []).append((int(s), int(e), float(d), float(cpu), float(w)))
    return out
