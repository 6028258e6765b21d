"""Render a timeline model (analyzers/_timeline.py) as one Chrome trace JSON file, which the
Perfetto UI (ui.perfetto.dev) and chrome://tracing open.

One process per rank (pid = rank, named and ordered by mesh coordinate), one thread per track;
slices of one track that overlap without nesting (async collectives, two streams' worth of ops)
are spread over lanes ("pg 3 (pp) #2"), because a Chrome trace thread must nest. Times are µs
since the earliest event (``otherData.base_epoch_ns`` gives that moment on rank 0's clock).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

TRACK_ORDER = ("critical path", "critical path (ops)", "steps", "data", "pipeline")


def _track_sort(name: str) -> tuple:
    if name in TRACK_ORDER:
        return (TRACK_ORDER.index(name), name)
    if name.startswith("pg "):
        return (10, name)
    if name.startswith("cpu "):
        return (20, name)
    return (30, name)


def _lanes(slices: list) -> tuple[dict, list[int]]:
    """(rank, track) -> lanes used, and the lane of each slice (nesting kept within a lane)."""
    lane_of = [0] * len(slices)
    by_track: dict = {}
    for i, s in enumerate(slices):
        by_track.setdefault((s[0], s[1]), []).append(i)
    used: dict = {}
    for key, idx in by_track.items():
        idx.sort(key=lambda i: (slices[i][4], -slices[i][5]))
        stacks: list[list[int]] = []  # per lane: stack of open slice ends
        for i in idx:
            a, b = slices[i][4], slices[i][4] + slices[i][5]
            for ln, stack in enumerate(stacks):
                while stack and stack[-1] <= a:
                    stack.pop()
                if not stack or b <= stack[-1]:
                    stack.append(b)
                    lane_of[i] = ln
                    break
            else:
                stacks.append([b])
                lane_of[i] = len(stacks) - 1
        used[key] = max(1, len(stacks))
    return used, lane_of


def render(model: dict) -> dict:
    slices = model["slices"]
    times = [s[4] for s in slices] + [c[2] for c in model["counters"]] + [x[3] for x in model["instants"]]
    base = min(times) if times else 0
    used, lane_of = _lanes(slices)
    tids: dict = {}
    events: list[dict] = []
    for p in model["processes"]:
        r = p["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "ts": 0,
                       "args": {"name": p["name"]}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "ts": 0,
                       "args": {"sort_index": p["sort"]}})
        events.append({"ph": "M", "name": "process_labels", "pid": r, "tid": 0, "ts": 0,
                       "args": {"labels": p["label"]}})
    tracks = sorted({(s[0], s[1]) for s in slices} | {(x[0], x[1]) for x in model["instants"] if x[0] is not None},
                    key=lambda k: (k[0], _track_sort(k[1])))
    for r, name in tracks:
        for ln in range(used.get((r, name), 1)):
            tid = len(tids) + 1
            tids[(r, name, ln)] = tid
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "ts": 0,
                           "args": {"name": name if ln == 0 else f"{name} #{ln + 1}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "ts": 0,
                           "args": {"sort_index": tid}})

    def us(ns):
        return round((ns - base) / 1e3, 3)

    for i, s in enumerate(slices):
        r, track, name, cat, ts, dur, args = s
        e = {"ph": "X", "name": name, "cat": cat, "pid": r, "tid": tids[(r, track, lane_of[i])],
             "ts": us(ts), "dur": round(dur / 1e3, 3)}
        if cat == "critical_path":
            e["cname"] = "terrible"  # chrome://tracing's red; Perfetto colours by name
        if args:
            e["args"] = args
        events.append(e)
    for fid, (a, b) in enumerate(model["flows"], 1):
        sa, sb = slices[a], slices[b]
        events.append({"ph": "s", "id": fid, "name": "collective", "cat": "collective_flow",
                       "pid": sa[0], "tid": tids[(sa[0], sa[1], lane_of[a])], "ts": us(sa[4])})
        events.append({"ph": "f", "bp": "e", "id": fid, "name": "collective", "cat": "collective_flow",
                       "pid": sb[0], "tid": tids[(sb[0], sb[1], lane_of[b])], "ts": us(sb[4])})
    for r, name, ts, values in model["counters"]:
        events.append({"ph": "C", "name": name, "pid": r, "tid": 0, "ts": us(ts), "args": values})
    for r, track, name, ts, args in model["instants"]:
        e = {"ph": "i", "name": name, "cat": "finding", "ts": us(ts), "args": args}
        if r is None:
            e.update(s="g", pid=0, tid=0)
        else:
            e.update(s="t", pid=r, tid=tids[(r, track, 0)])
        events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "trainprof timeline", "base_epoch_ns": int(base),
                          **model.get("meta", {})}}


def _bytes(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), default=str).encode()


def size(doc: dict) -> int:
    """The document's size as written (uncompressed JSON bytes)."""
    return len(_bytes(doc))


def write(model: dict, out: str | os.PathLike, gz: bool = False) -> dict:
    """Render and write (atomically: a temporary file renamed); returns {path, bytes, events}."""
    return write_doc(render(model), out, gz)


def write_doc(doc: dict, out: str | os.PathLike, gz: bool = False) -> dict:
    data = _bytes(doc)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(gzip.compress(data, 6) if gz else data)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"path": str(out), "bytes": out.stat().st_size, "json_bytes": len(data),
            "events": len(doc["traceEvents"])}


def problems(doc: dict) -> list[str]:
    """What is wrong with a Chrome trace document (empty when nothing): every event's ph, ts,
    pid, tid (and dur for slices) of the right types, flow starts and finishes paired and bound
    to a slice of their thread, slices of one thread nested."""
    out: list[str] = []
    ev = doc.get("traceEvents")
    if not isinstance(ev, list):
        return ["traceEvents is not a list"]
    flows: dict = {}
    by_thread: dict = {}
    for i, e in enumerate(ev):
        bad = [k for k, t in (("ph", str), ("name", str), ("pid", int), ("tid", int), ("ts", (int, float)))
               if not isinstance(e.get(k), t)]
        if e.get("ph") == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            bad.append("dur")
        if e.get("ph") not in ("X", "M", "C", "i", "s", "f"):
            bad.append("ph")
        if bad:
            out.append(f"event {i}: bad {', '.join(bad)}: {str(e)[:200]}")
            continue
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] in ("s", "f"):
            flows.setdefault(e.get("id"), []).append(e)
    for fid, pair in flows.items():
        if sorted(x["ph"] for x in pair) != ["f", "s"]:
            out.append(f"flow {fid}: {len(pair)} ends")
            continue
        for x in pair:
            if not any(a <= x["ts"] <= b for a, b in by_thread.get((x["pid"], x["tid"]), ())):
                out.append(f"flow {fid}: its {x['ph']} end is on no slice of pid {x['pid']} tid {x['tid']}")
    for (pid, tid), sl in by_thread.items():
        sl.sort(key=lambda ab: (ab[0], -ab[1]))
        stack: list = []
        for a, b in sl:
            while stack and stack[-1] <= a + 1e-3:
                stack.pop()
            if stack and b > stack[-1] + 1e-3:
                out.append(f"pid {pid} tid {tid}: slice at {a} µs overlaps its parent without nesting")
                break
            stack.append(b)
    return out
