"""A rank killed by a fatal signal, seen through its ``fatal-stacks.txt`` (probes/fatal_dump.py,
faulthandler's text): its main thread's Python stack and, when that stack is inside a
torch.distributed collective call, the collective it waited in — its heartbeat's in-flight one
when the beat saw it waiting there, else the one after the last it issued in that group (or,
where its log lost the step it died in, the call's place in its per-step order) — with the
job's call site. gloo and NCCL abort (SIGABRT) a rank whose peers issued another
collective: without this the collective it died in is in no record, or only in a beat that
cannot say whether the rank was still in it.

Also the tie-breaker for a desynchronization between equally many ranks (two ranks, one
collective each): the side that broke its own per-step order of collectives (``deviating``)
is the culprit; the other side kept its order.
"""

from __future__ import annotations

import re

from trainprof._lazy import pd

# torch.distributed functions that are (or wait for) a collective / p2p op; the op is the name
OPS = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
       "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
       "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
       "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
       "broadcast_object_list", "gather_object", "scatter_object_list", "all_reduce_coalesced",
       "all_gather_coalesced"}
WAITS = {"wait", "wait_tensor"}
_HEADER = re.compile(r"# trainprof fatal-stacks v1 pid=(\d+) main_thread=0x([0-9a-fA-F]+)")
_THREAD = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse(text: str | None) -> dict | None:
    """{signal_text, main_thread: frames outermost first ([{file, line, function, lib}])} of the
    file's last dump, or None when it holds none."""
    if not text:
        return None
    m = _HEADER.match(text)
    main_ident = int(m.group(2), 16) if m else None
    start = text.rfind("Fatal Python error:")
    if start < 0:
        return None
    block = text[start:].splitlines()
    threads: list[tuple[int, list[dict]]] = []
    for line in block[1:]:
        t = _THREAD.match(line)
        if t:
            threads.append((int(t.group(2), 16), []))
            continue
        f = _FRAME.match(line)
        if f and threads:
            path = f.group(1)
            threads[-1][1].append({"file": path, "line": int(f.group(2)), "function": f.group(3),
                                   "lib": _is_lib(path)})
    if not threads:
        return None
    main = [fr for ident, fr in threads if ident == main_ident]
    frames = main[0] if main else threads[-1][1]  # faulthandler lists the main thread last
    return {"signal_text": block[0].split(":", 1)[1].strip(), "main_thread": frames[::-1],
            "main_known": bool(main)}


def _is_lib(path: str) -> bool:
    return ("/torch/" in path or "/trainprof/" in path or "/probes/" in path
            or path.startswith("<frozen") or ("/lib/python3" in path and "-packages/" not in path))


def collective_call(stack: list[dict]) -> dict | None:
    """{op, api, frame (innermost torch.distributed frame), call_site (the job's innermost
    frame)} when the stack (outermost first) is inside a torch.distributed collective call."""
    for i in range(len(stack) - 1, -1, -1):
        f = stack[i]
        if "torch/distributed" not in f["file"].replace("\\", "/"):
            continue
        name = f["function"]
        if name in OPS or name in WAITS:
            user = [x for x in stack[:i] if not x["lib"]]
            op = name.lstrip("_").replace("_base", "") if name in OPS else None
            return {"op": op, "api": f"c10d.{name}" if name in OPS else None, "frame": f,
                    "call_site": user[-1] if user else None}
    return None


def confirmed_inflight(inflight: list[dict], call: dict) -> dict | None:
    """Of a rank's in-flight collectives as its last heartbeat saw them, the one its fatal
    stacks show it still waited in: the newest of its group, of the op the stack is in (a
    ``wait``: any). None when none fits (it completed it after the beat and went on)."""
    cands = [c for c in inflight if c.get("pg") is not None and isinstance(c.get("seq"), int)]
    if not cands:
        return None
    c = max(cands, key=lambda c: (c.get("enqueue_ns") or 0, c["seq"]))
    api = c.get("api") if isinstance(c.get("api"), str) else None
    if call["op"] is None:
        return c
    if api is not None:  # a c10d function's record names it; others (ddp.bucket) are not it
        return c if api == call["api"] else None
    return c if c.get("op") == call["op"] else None


def infer_inflight(log: pd.DataFrame, rank: int, known: list[dict], step: int | None,
                   call: dict) -> tuple[dict | None, str | None]:
    """The collective a rank died in: seq = its last known one + 1 in its group (its log, and
    ``known``: the last collective and in-flight ones of its heartbeat), or further on where
    none of its current step is known and its per-step order places the call there (below).
    (entry, None) or (None, why not) when the group is not known (several groups, or none
    logged)."""
    seqs: dict[str, int] = {}
    last_step: dict[str, int | None] = {}
    mine = log[log["rank"] == rank] if not log.empty and {"rank", "pg", "seq"} <= set(log.columns) \
        else None
    if mine is not None:
        for pg, s in mine.groupby(mine["pg"].astype(str))["seq"].max().items():
            seqs[str(pg)] = int(s)
    for c in known:
        if isinstance(c, dict) and c.get("pg") is not None and isinstance(c.get("seq"), int):
            pg = str(c["pg"])
            if c["seq"] > seqs.get(pg, -1):
                seqs[pg] = c["seq"]
                last_step[pg] = c.get("step") if isinstance(c.get("step"), int) else None
    if len(seqs) != 1:
        return None, ("it logged collectives in several groups: which one it waited in is not "
                      "known" if seqs else "it logged no collective before")
    (pg, last), = seqs.items()
    ahead = 0
    if pg not in last_step and mine is not None and "step" in mine.columns:
        ahead = _position(mine[mine["pg"].astype(str) == pg], last, step, call)
    return {"pg": pg, "seq": last + 1 + ahead, "op": call["op"], "api": call["api"],
            "bytes": None, "step": step, "inferred": "fatal-stacks"}, None


def _position(mine: pd.DataFrame, last: int, step: int | None, call: dict) -> int:
    """How many collectives of its current step the rank issued before the one it died in,
    when its log says: the log holds none of the current step (it is written at step
    boundaries: a rank that died mid-step lost that step's records) and ends with the step
    before, whose calls in the group repeat the step before that, and the call it died in comes
    once in that order. 0 otherwise (the next after the last known, as before)."""
    key = _key(call.get("api"), call.get("op"))
    if not isinstance(step, int) or call.get("api") is None or key is None:
        return 0
    at_last = mine.loc[mine["seq"] == last, "step"]
    if len(at_last) != 1 or pd.isna(at_last.iloc[0]) or int(at_last.iloc[0]) != step - 1:
        return 0
    order = []
    for s in (step - 2, step - 1):
        rows = mine[mine["step"] == s].sort_values("seq")
        order.append([_key(a, o) for a, o in zip(rows["api"] if "api" in rows else [None] * len(rows),
                                                   rows["op"])])
    if not order[1] or order[0] != order[1] or order[1].count(key) != 1:
        return 0
    return order[1].index(key)


def deviating(log: pd.DataFrame, entries: dict[int, dict], pg: str, seq: int) -> list[int] | None:
    """Of two equally large sides of a desynchronized (pg, seq), the ranks that broke their own
    per-step order, when exactly one side did; else None. A rank's reference is its step before
    the first step of the desynchronized entries; every step of its since then must repeat it
    (the op and API of each collective, in order), the entry's own step up to the entry being a
    prefix of it: each of its calls known there (its log; the entry) at its place in the step's
    order (a rank that died mid-step lost its log of that step: those places are open).
    ``entries``: {rank: {op, api, bytes, step}} at (pg, seq)."""
    if log.empty or not {"rank", "pg", "seq", "step"} <= set(log.columns):
        return None
    if not all(isinstance(e.get("step"), int) for e in entries.values()):
        return None
    g = log[(log["pg"].astype(str) == pg) & log["step"].notna()]
    first = min(e["step"] for e in entries.values())
    verdict: dict[int, bool] = {}
    for r, e in entries.items():
        mine = g[(g["rank"] == r) & (g["seq"] < seq)].sort_values("seq")
        calls, seqs = {}, {}
        for st, grp in mine.groupby(mine["step"].astype(int)):
            calls[int(st)] = [_key(a, o) for a, o in zip(grp.get("api", [None] * len(grp)),
                                                         grp["op"])]
            seqs[int(st)] = grp["seq"].astype(int).tolist()
        ref = calls.get(first - 1)
        if not ref:
            return None
        ok = all(calls.get(t, []) == ref for t in range(first, e["step"]))
        start = max((s for t, ss in seqs.items() if t < e["step"] for s in ss), default=-1) + 1
        here = dict(zip(seqs.get(e["step"], []), calls.get(e["step"], [])))
        here[seq] = _key(e.get("api"), e.get("op"))
        verdict[r] = ok and all(0 <= s - start < len(ref) and ref[s - start] == k
                                for s, k in here.items())
    odd = sorted(r for r, ok in verdict.items() if not ok)
    if not odd or len(odd) == len(verdict):
        return None
    return odd


def _key(api, op):
    api = api if isinstance(api, str) else None
    op = op if isinstance(op, str) else None
    return api or (f"c10d.{op}" if isinstance(op, str) else None)
