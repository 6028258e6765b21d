"""Silent desynchronization, for the hang post-mortem (analyzers/hang.py): the ranks of a group
issued different numbers of collectives in one step.

gloo and NCCL pair collectives by their order in the group, not by the step that issued them: a
rank that issues an extra collective (a `dist.all_reduce`, or a DDP forward that makes its next
backward all-reduce, under `if rank == 0:`) has it paired with its peers' next one. When op and
size agree nothing fails; the ranks are one collective apart from then on, reduce each other's
wrong tensors, and the job fails (or hangs) much later, where one rank runs out of collectives.
The op/size check of the ledger (analyzers/_hang_ledger.py) sees nothing there.

What the logs say: each rank's collective log (collectives.jsonl: ``seq`` per group, ``step``
when issued) and its step records (steps.jsonl). For each group and rank, ``B(s)``: how many
collectives of the group the rank had issued when it closed step ``s`` (its highest sequence
number logged in steps up to ``s``, plus one). In step with its peers, every rank has the same
``B(s)`` at every step both closed. The first step where they differ is where the ranks fell
apart; the first sequence number one rank issued in it and another in a later step is the first
divergent collective.

Claimed only where the step records say each rank's step boundaries consistently:
- only steps each compared rank closed (in steps.jsonl): a rank that ran out of inputs under
  torch's Join logs its shadow collectives under a step it never closes, and is not compared there;
- every compared rank's steps come from the same source (optimizer hook or trainprof.step());
- each rank's steps never go back as its sequence numbers grow (collectives from another thread
  in the group, whose step is a race with the training thread's boundary: no claim);
- over the steps all compared ranks hold, their per-step counts agree in more than half (ranks
  whose steps are defined by different events disagree in most);
- the difference lasts past the next step boundary (a collective issued right at a boundary,
  before it on one rank and after it on another, evens out at the next one).
Groups that carry point-to-point ops are left out (a pipeline's send/recv differ by design).

Culprit: the ranks whose count in the first divergent step differs from a strict majority's;
between equally large sides (two ranks), the side whose count departs from its own usual
per-step count (its mode) in a divergent step while the other's does not; else the side that
issued more (it issued collectives the others did not).
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers._hang_exits import victim_how
from trainprof.analyzers._hang_views import _rank_s
from trainprof.rankranges import rank_list
from trainprof.wording import plural, ranks_phrase

MIN_STEPS = 3        # common steps needed to judge the ranks' step boundaries
SHOWN_STEPS = 8      # divergent steps listed in the evidence


def step_desync(run, p2p_ops) -> list[dict]:
    """One entry per group where the ranks fell out of step (see the module's doc), in the
    ledger's desync form ({source, pg, seq, variants}) with ``by: "steps"``, ``step``,
    ``deviating``, ``extra``, ``counts``, ``steps_differ``."""
    log = run.frame("collectives")
    st = run.steps()
    if log.empty or st.empty or not {"rank", "pg", "seq", "step", "op"} <= set(log.columns) \
            or not {"rank", "step"} <= set(st.columns):
        return []
    closed, sources = _closed_steps(st)
    if not closed:
        return []
    keep = log["pg"].notna() & log["seq"].notna() & log["step"].notna()
    t = log.loc[keep, [c for c in ("rank", "pg", "seq", "step", "op", "bytes", "api")
                       if c in log.columns]]
    if t.empty:
        return []
    t = t.assign(pg=t["pg"].astype(str))
    p2p = set(t.loc[t["op"].isin(list(p2p_ops)), "pg"])
    out = []
    for pg, g in t.groupby("pg", sort=True):
        if pg in p2p:
            continue
        d = _group(pg, g, closed, sources)
        if d is not None:
            out.append(d)
    return out


def _closed_steps(st) -> tuple[dict[int, int], dict[int, frozenset]]:
    """{rank: its last closed step}, {rank: the sources of its step records}."""
    s = st[st["step"].notna()]
    last = {int(r): int(v) for r, v in s.groupby("rank")["step"].max().items()}
    if "source" in s.columns:
        src = {int(r): frozenset(str(x) for x in v.dropna().unique())
               for r, v in s.groupby("rank")["source"]}
    else:
        src = {}
    return last, {r: src.get(r, frozenset()) for r in last}


def _tail(seq: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A rank's collectives of one group from its last gap in sequence numbers on (a bounded
    log keeps the recent ones, and detail windows of older ones), sorted; None when its steps go
    back as its sequence numbers grow."""
    gaps = np.flatnonzero(np.diff(seq) != 1)
    i = int(gaps[-1]) + 1 if len(gaps) else 0
    seq, step = seq[i:], step[i:]
    if len(step) > 1 and (np.diff(step) < 0).any():
        return None
    return seq, step


def _group(pg: str, g, closed: dict, sources: dict) -> dict | None:
    g = g.drop_duplicates(["rank", "seq"], keep="last").sort_values(["rank", "seq"], kind="stable")
    rk = g["rank"].to_numpy()
    seq = g["seq"].to_numpy().astype(np.int64)
    step = pd.to_numeric(g["step"], errors="coerce").to_numpy()
    cut = np.flatnonzero(np.diff(rk)) + 1
    tails: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for a, b in zip(np.r_[0, cut], np.r_[cut, len(rk)]):
        r = int(rk[a])
        if r not in closed:
            continue  # no step records: its steps cannot be compared
        tl = _tail(seq[a:b], step[a:b].astype(np.int64))
        if tl is None:
            return None  # its steps are a race with another thread: no claim for the group
        tails[r] = tl
    if len(tails) < 2 or len({sources[r] for r in tails}) != 1:
        return None
    lo = max(int(s[0]) for _, s in tails.values())
    hi = min(closed[r] for r in tails)
    if hi - lo + 1 < MIN_STEPS:
        return None
    steps = np.arange(lo, hi + 1)
    ranks = sorted(tails)
    # B[i, k]: collectives of the group rank ranks[i] had issued when it closed step steps[k]
    B = np.empty((len(ranks), len(steps)), dtype=np.int64)
    for i, r in enumerate(ranks):
        sq, sp = tails[r]
        B[i] = sq[np.searchsorted(sp, steps, side="right") - 1] + 1
    differ = B.min(axis=0) != B.max(axis=0)
    if not differ.any():
        return None
    k = int(np.argmax(differ))
    if k + 1 >= len(steps) or not differ[k + 1]:
        return None  # evened out at the next boundary (or nothing after it to tell)
    n = np.diff(B, axis=1)  # per-step counts of steps[1:]
    agree = n.min(axis=0) == n.max(axis=0)
    if 2 * int(agree.sum()) <= len(agree):
        return None  # the ranks' steps are not the same steps
    before = np.array([_before(tails[r], lo) for r in ranks])
    counts = np.concatenate([(B[:, :1] - before[:, None]) if (before >= 0).all()
                             else np.full((len(ranks), 1), -1), n], axis=1)
    known = (counts >= 0).all(axis=0)
    if not known[k]:
        return None  # a log that starts inside the first step compared: it may have begun before
    s_star = int(steps[k])
    q = int(B[:, k].min())  # issued by some ranks in step s_star, by the others later
    culprit = _culprit(ranks, counts, known, agree, k)
    rows = g[g["seq"] == q].set_index("rank")
    variants: dict = {}
    for r in ranks:
        e = rows.loc[r] if r in rows.index else None
        key = (None, None, None, None) if e is None else (
            _py(e["step"]), _py(e.get("op")), _py(e.get("bytes")), _py(e.get("api")))
        variants.setdefault(key, []).append(r)
    div_steps = [int(i) for i in np.flatnonzero(known & (counts.min(axis=0) != counts.max(axis=0)))]
    deviating, extra = culprit
    return {
        "source": "probe", "by": "steps", "pg": pg, "seq": q, "step": s_star,
        "variants": [{"step": s, "op": o, "bytes": b, "api": a, "ranks": rs,
                      "steps": [s] if s is not None else []}
                     for (s, o, b, a), rs in sorted(variants.items(), key=lambda kv: kv[1][0])],
        "deviating": deviating, "extra": extra,
        "counts": _by_count(ranks, counts[:, k]),
        "steps_differ": [{"step": int(steps[i]), "counts": _by_count(ranks, counts[:, i])}
                         for i in div_steps[:SHOWN_STEPS]],
        "n_steps_differ": len(div_steps), "steps_compared": [lo, hi],
        "steps_agree": int(agree.sum()),
        "ranks_compared": rank_list(ranks, 10_000)}


def _before(tail, lo: int) -> int:
    """Collectives of the group the rank had issued before step ``lo`` (its B(lo - 1)): 0 when
    its log starts at sequence number 0 in step ``lo``; read from its log when that holds an
    earlier step; unknown (-1) when its log starts inside step ``lo`` (a bounded log)."""
    sq, sp = tail
    if sq[0] == 0 and sp[0] >= lo:
        return 0
    if sp[0] < lo:
        return int(sq[np.searchsorted(sp, lo - 1, side="right") - 1]) + 1
    return -1


def _culprit(ranks, counts, known, agree, k) -> tuple[list[int], bool | None]:
    """(the ranks that fell out of step, whether they issued more collectives than the others
    in the first divergent step); see the module's doc."""
    col = counts[:, k]
    vals, num = np.unique(col, return_counts=True)
    if num.max() * 2 > len(ranks):
        major = vals[int(np.argmax(num))]
        odd = [r for r, c in zip(ranks, col) if c != major]
        return odd, bool(col[ranks.index(odd[0])] > major)
    usual = [_mode(counts[i, 1:]) for i in range(len(ranks))]
    for j in np.flatnonzero(known & (counts.min(axis=0) != counts.max(axis=0))):
        off = [r for i, r in enumerate(ranks) if counts[i, j] != usual[i]]
        if 0 < len(off) < len(ranks):
            rest = [i for i, r in enumerate(ranks) if r not in off]
            return off, bool(counts[ranks.index(off[0]), j] > counts[rest[0], j])
    top = col.max()
    return [r for r, c in zip(ranks, col) if c == top], True


def _mode(v: np.ndarray) -> int:
    vals, num = np.unique(v, return_counts=True)
    return int(vals[int(np.argmax(num))]) if len(v) else -1


def _by_count(ranks, col) -> list[dict]:
    out: dict[int, list[int]] = {}
    for r, c in zip(ranks, col):
        out.setdefault(int(c), []).append(r)
    return [{"count": c, "ranks": rs} for c, rs in sorted(out.items(), key=lambda kv: -kv[0])]


def _py(v):
    if v is None:
        return None
    try:
        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return int(v) if float(v).is_integer() else float(v)
    return v


def size_text(b) -> str | None:
    if not isinstance(b, (int, float)) or isinstance(b, bool):
        return None
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.1f} {unit}"
    return f"{int(b)} B"


def call_text(v: dict) -> str:
    """'all_reduce (ddp.bucket, 4.2 MB)'."""
    bits = [x for x in (v.get("api"), size_text(v.get("bytes"))) if x]
    return f"{v.get('op') or '?'}" + (f" ({', '.join(bits)})" if bits else "")


def describe(d: dict) -> str:
    """What the culprit did, for the finding's message: 'issued 2 more collectives of group 0
    in step 0 than rank 1 (5 against 3), and again in steps 10 (4 against 2) and 20 (4 against
    2): from collective #3 on the ranks were in different steps at the same collective ...'."""
    odd = set(d["deviating"])
    others = sorted({r for c in d["counts"] for r in c["ranks"]} - odd)
    more = "more" if d["extra"] else "fewer"

    def nums(counts):
        mine = [c["count"] for c in counts if set(c["ranks"]) & odd]
        theirs = [c["count"] for c in counts if not set(c["ranks"]) & odd]
        return f"{'/'.join(map(str, mine))} against {'/'.join(map(str, theirs))}"

    count = {r: c["count"] for c in d["counts"] for r in c["ranks"]}
    diff = abs(count[min(odd)] - count[others[0]])
    text = (f"issued {plural(diff, more + ' collective')} of group {d['pg']} in step "
            f"{d['step']} than {ranks_phrase(others)} ({nums(d['counts'])})")
    later = [x for x in d["steps_differ"] if x["step"] != d["step"]]
    if later:
        shown = [f"{x['step']} ({nums(x['counts'])})" for x in later[:4]]
        rest = d["n_steps_differ"] - 1 - len(shown)
        if rest > 0:
            shown.append(plural(rest, "more step"))
        listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
        text += f", and again in step{'s' * (len(later) > 1)} {listed}"
    pos = "; ".join(f"{ranks_phrase(v['ranks'])}: {call_text(v)} of step {v['step']}"
                    for v in d["variants"])
    same = len({(v["op"], v["bytes"]) for v in d["variants"]}) == 1
    text += (f": from collective #{d['seq']} of group {d['pg']} on, the ranks were in different "
             f"steps at the same collective number ({pos}), which the backend paired without an "
             f"error{' (same op and size)' if same else ''}, each rank's collective with another "
             "step's of its peers")
    return text


FIX = ("every rank of a group must issue the same collectives in every step: a collective, or a "
       "call that issues one, run on some ranks only (under `if rank == 0:`, "
       "`is_main_process`, a rank-dependent condition) is paired with the others' next one. Run "
       "it on every rank, or keep the rank-only work free of collectives")
DDP_FIX = (" (a forward of the DDP-wrapped model with gradients enabled, outside `no_sync()`, makes "
           "the next backward all-reduce its gradients: for rank-only evaluation or printing call "
           "the unwrapped module, `model.module` / `accelerator.unwrap_model(model)`, under "
           "`torch.no_grad()`)")


def fix(d: dict) -> str:
    apis = {v.get("api") for v in d["variants"]}
    return FIX + (DDP_FIX if "ddp.bucket" in apis else "")


def lead_with(desync: list[dict], silent: list[dict]) -> list[dict]:
    """The ledger's desyncs with the groups whose ranks fell out of step first: a group's silent
    desync (step_desync) leads when it comes before the group's first op/size
    mismatch (which is then its consequence); one at or after that mismatch adds nothing."""
    first = {}
    for d in desync:
        if d["source"] == "probe":
            first[d["pg"]] = min(first.get(d["pg"], d["seq"]), d["seq"])
    lead = [d for d in silent if d["seq"] < first.get(d["pg"], d["seq"] + 1)]
    return lead + desync


def explains(desync, died, hung) -> dict | None:
    """The first desync when it is a silent one (ranks out of step) that explains how the job
    ended: it ended normally, hung, or its first failure came in a collective at or after the
    desynchronized step (a collective failing on a peer that had run out of collectives, or the
    backend's abort); None when a rank failed first on its own (it stays the culprit)."""
    d = desync[0] if desync else None
    if d is None or d.get("by") != "steps" or not d.get("deviating"):
        return None
    if hung or not died:
        return d
    f = died[0]
    if f.get("step") is not None and f["step"] < d["step"]:
        return None
    if f.get("waiting_in") or f.get("signal_name") == "SIGABRT":
        return d
    t = (f.get("failure") or {}).get("t_ns")
    end = (f.get("last_collective") or {}).get("end_ns")
    if isinstance(t, int) and isinstance(end, int) and abs(t - end) <= 1e9:
        return d  # its last collective ended when it failed: it failed in that collective
    return None


def consequences(died, early) -> list[str]:
    """How the job ended after a silent desync, each said as what followed from it."""
    out = []
    if early:
        out.append(f"{_rank_s(early['ranks'])} then {early['how']}")
        out += [f"rank {v['rank']} then {v['how']}" for v in early["victims"]]
        done = {v["rank"] for v in early["victims"]}
        died = [d for d in died if d["rank"] not in done]
    out += [f"rank {d['rank']} then failed: {victim_how(d)}" for d in died]
    return out
