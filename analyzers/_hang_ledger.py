"""The collectives probe's ledger for the hang post-mortem: every (group, rank, seq) a rank is
known to have issued — its collective log (NaN replays included), then the last collective and
the in-flight ones of its heartbeat / hang dump — and from it the first desynchronized sequence
number of each group and the ranks that never arrived where others wait.

Built as one table (a row per entry; a later entry of the same (pg, rank, seq) replaces an
earlier one, in-flight sticks), so that it costs the same per record at 1,000 ranks as at 2:
only the group and sequence number reported are turned back into Python objects.
"""

from __future__ import annotations

import math

import numpy as np

from trainprof._lazy import pd

COLS = ("pg", "rank", "seq", "op", "bytes", "step", "inflight")


def _py(v):
    """A table value as the JSON value it came from (NaN -> None, integral floats -> int)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return int(v) if float(v).is_integer() else float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


class Ledger:
    def __init__(self, run, views):
        parts = []
        log = run.frame("collectives")
        if not log.empty and {"pg", "seq"} <= set(log.columns):
            keep = (log["pg"].notna() & log["seq"].notna()).to_numpy()
            src = log if keep.all() else log[keep]  # (a filter copies every column)
            # the group's name once per distinct group (millions of records, few groups)
            codes, uniq = pd.factorize(src["pg"])
            parts.append(pd.DataFrame({
                "pg": np.array([str(u) for u in uniq] + [None], dtype=object)[codes],
                "rank": src["rank"].to_numpy(), "seq": src["seq"].to_numpy().astype(np.int64),
                "op": src["op"] if "op" in src else None,
                "bytes": src["bytes"] if "bytes" in src else None,
                "step": src["step"] if "step" in src else None,
                "inflight": np.zeros(len(src), dtype=bool)}, index=src.index))
            del src, codes
        extra = []
        for v in views.values():
            recs = ([(v.last_collective, False)] if v.last_collective else []) \
                + [(c, True) for c in v.inflight]
            for c, infl in recs:
                if c.get("pg") is None or c.get("seq") is None:
                    continue
                extra.append({"pg": str(c["pg"]), "rank": v.rank, "seq": int(c["seq"]),
                              "op": c.get("op"), "bytes": c.get("bytes"), "step": c.get("step"),
                              "inflight": infl})
        if extra:  # numbers as float (NaN for null), as the log's columns become alongside them
            e = pd.DataFrame(extra, columns=list(COLS))
            for c in ("bytes", "step"):
                e[c] = pd.to_numeric(e[c], errors="coerce")
            parts.append(e)
        if not parts:
            self.t = pd.DataFrame(columns=list(COLS))
        else:
            t = pd.concat(parts, ignore_index=True)
            del parts
            # a later entry of the same (pg, rank, seq) wins; in flight once, in flight. Keyed
            # on integers (the group's code), and the "any" taken over the repeated keys only
            key = pd.DataFrame({"p": pd.factorize(t["pg"])[0], "r": t["rank"].to_numpy(),
                                "s": t["seq"].to_numpy()})
            again = key.duplicated(keep=False).to_numpy()
            if again.any():
                infl = t["inflight"].to_numpy(dtype=bool).copy()
                k = key[again]
                infl[again] = pd.Series(infl[again]).groupby(
                    [k["p"].to_numpy(), k["r"].to_numpy(), k["s"].to_numpy()],
                    sort=False).transform("any").to_numpy(dtype=bool)
                t["inflight"] = infl
                t = t[~key.duplicated(keep="last").to_numpy()]
            del key
            self.t = t.reset_index(drop=True)
        self.pgs = sorted(self.t["pg"].unique().tolist()) if len(self.t) else []

    def entries(self, pg: str, seq: int | None = None) -> dict[int, dict]:
        """{rank: {op, bytes, step, inflight}} of a group (at one seq), ranks in order."""
        t = self.t[self.t["pg"] == pg]
        if seq is not None:
            t = t[t["seq"] == seq]
        return {int(r["rank"]): {k: _py(r[k]) for k in ("op", "bytes", "step")}
                | {"inflight": bool(r["inflight"])}
                for _, r in t.sort_values("rank", kind="stable").iterrows()}

    def ranks_of(self, pg: str) -> list[int]:
        return sorted(int(r) for r in self.t.loc[self.t["pg"] == pg, "rank"].unique())

    def max_seq(self, pg: str) -> dict[int, int]:
        t = self.t[self.t["pg"] == pg]
        return {int(r): int(s) for r, s in t.groupby("rank")["seq"].max().items()}


def _all_str(s: pd.Series) -> bool:
    return set(map(type, s.tolist())) == {str}


def desync(led: Ledger, p2p_ops, strict_ops) -> list[dict]:
    """Per group without point-to-point ops: the first seq at which the ranks that logged it
    disagree on the op (or, for ops of one size on every rank, the size)."""
    out = []
    t = led.t
    if t.empty:
        return out
    # one signature per entry: op, and the size where the op must agree on it (null: -1)
    ops = t["op"]
    strict = ops.isin(list(strict_ops)).to_numpy()
    b = pd.to_numeric(t["bytes"], errors="coerce")
    if _all_str(ops.dropna()) and b.notna().sum() == t["bytes"].notna().sum() \
            and (b.dropna() % 1 == 0).all():
        sig = pd.DataFrame({"pg": t["pg"], "seq": t["seq"],
                            "op": pd.factorize(ops.fillna("\0null"))[0],
                            "size": np.where(strict, b.fillna(-1).to_numpy(), -1.0)})
    else:  # odd values: compare them as text
        op = ops.map(lambda x: "s:" + x if isinstance(x, str) else "r:" + repr(_py(x)))
        size = t["bytes"].map(lambda x: repr(_py(x)))
        sig = pd.DataFrame({"pg": t["pg"], "seq": t["seq"], "op": op,
                            "size": size.where(pd.Series(strict, index=t.index), "None")})
    count = t.groupby(["pg", "seq"])["rank"].size()
    many = sig.drop_duplicates().groupby(["pg", "seq"]).size()
    bad = many[(many > 1) & (count.reindex(many.index) >= 2)]
    p2p = set(t.loc[t["op"].isin(list(p2p_ops)), "pg"])
    first: dict[str, int] = {}
    for (pg, seq) in bad.index:
        if pg not in p2p and pg not in first:
            first[pg] = int(seq)  # the index is sorted: the smallest seq of each group
    for pg in sorted(first):
        seq = first[pg]
        here = led.entries(pg, seq)
        sigs: dict = {}
        for r, e in sorted(here.items()):
            key = (e["op"], e["bytes"] if e["op"] in strict_ops else None)
            sigs.setdefault(key, []).append(r)
        out.append({"source": "probe", "pg": pg, "seq": seq,
                    "variants": [{"op": o, "bytes": b, "ranks": rs,
                                  "steps": sorted({here[r]["step"] for r in rs
                                                   if here[r]["step"] is not None})}
                                 for (o, b), rs in sigs.items()]})
    return out


def missing(led: Ledger, members: dict, views) -> list[dict]:
    """Per group where blocked ranks wait in flight at seq ``top``: the members whose last
    logged seq is below it."""
    out = []
    t = led.t
    infl = t[t["inflight"].astype(bool)] if not t.empty else t
    for pg in sorted(set(infl["pg"])) if not infl.empty else []:
        w = infl[infl["pg"] == pg].groupby("rank")["seq"].max()
        waiting = {int(r): int(s) for r, s in w.items() if views[int(r)].blocked}
        if not waiting:
            continue
        top = max(waiting.values())
        last = led.max_seq(pg)
        group = members.get(pg) or set(last)
        behind = sorted(r for r in group if last.get(r, -1) < top)
        if behind:
            at_top = led.entries(pg, top)
            op = next((at_top[r]["op"] for r in sorted(waiting) if waiting[r] == top and r in at_top),
                      None)
            out.append({"source": "probe", "pg": pg, "seq": top, "op": op,
                        "waiting_ranks": sorted(r for r, s in waiting.items() if s == top),
                        "missing_ranks": behind,
                        "missing_last_seq": {str(r): last.get(r, -1) for r in behind}})
    return out
