"""Reader of PyTorch flight-recorder dumps (pickle or JSON) and their cross-rank comparison.

A dump is a pickle (``torch._C._distributed_c10d._dump_fr_trace``) or JSON
(``_dump_fr_trace_json``)::

    {version, pg_config{name: {name, desc, ranks}}, pg_status{pg: {last_enqueued_collective,
     last_started_collective, last_completed_collective}},
     entries[{record_id, pg_id, process_group: (name, desc), collective_seq_id, p2p_seq_id,
              profiling_name: "nccl:all_reduce", input_sizes, input_dtypes, output_sizes, state,
              retired, time_created_ns, is_p2p, timeout_ms, frames[{name, filename, line}]}]}

Someone hands you a dump from a broken job: unpickling it must not run code nor exhaust memory.
The data-only unpickler (trainprof/formats/safepickle.py) accepts only the opcodes of plain data (dict,
list, tuple, str, bytes, numbers, None, bool, set); any global (``os.system``, a class, a
reduce, ``bytearray(2_000_000_000)``), and shared references expanding beyond what a real dump
holds, are refused with an error naming the file. Only a regular file within the input limit
is read (trainprof/safeio.py).

gloo (torch >= 2.8) records entries but never updates ``state`` (stays "scheduled") and writes
``pg_config`` with an empty key; ``pg_status`` counters and ``retired`` do advance, and they are
what tells in-flight from completed here.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainprof import safeio
from trainprof.formats import safepickle

FILES = ("flight-recorder.pkl", "flight-recorder.json")
P2P_OPS = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "sendrecv"}


class FlightRecorderError(Exception):
    """A dump cannot be read; the message names the file."""


def safe_loads(data: bytes, path="<bytes>"):
    """Unpickle plain data only. Raises FlightRecorderError naming ``path`` otherwise."""
    return safepickle.loads(data, str(path), FlightRecorderError)


def load(path: str | Path) -> dict:
    """A dump file (pickle or JSON, told by content) as a normalized dict:
    {format, version, pg_config, pg_status{pg: {enqueued, started, completed}}, entries[...]}."""
    path = Path(path)
    try:
        data = safeio.read_limited(path, what="flight-recorder dump")
    except safeio.InputRefused as e:
        raise FlightRecorderError(str(e)) from None
    except OSError as e:
        raise FlightRecorderError(f"{path}: cannot read: {e.strerror or e}") from None
    if data.lstrip()[:1] == b"{":
        try:
            raw, fmt = json.loads(data), "json"
        except (ValueError, RecursionError) as e:
            raise FlightRecorderError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    else:
        raw, fmt = safe_loads(data, path), "pickle"
    try:
        return normalize(raw, path, fmt)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise FlightRecorderError(f"{path}: not a flight-recorder dump (a field has the wrong "
                                  f"type: {type(e).__name__}: {e})") from None


def normalize(raw, path, fmt: str) -> dict:
    if not isinstance(raw, dict):
        raise FlightRecorderError(f"{path}: expected a dict at the top, got {type(raw).__name__}")
    entries = raw.get("entries") or []
    if not isinstance(entries, list):
        raise FlightRecorderError(f"{path}: 'entries' is {type(entries).__name__}, not a list")
    status = {}
    for pg, s in (raw.get("pg_status") or {}).items():
        if isinstance(s, dict):
            status[str(pg)] = {"enqueued": _int(s.get("last_enqueued_collective")),
                               "started": _int(s.get("last_started_collective")),
                               "completed": _int(s.get("last_completed_collective"))}
    config = {}
    for name, c in (raw.get("pg_config") or {}).items():
        if name in ("", None) or not isinstance(c, dict):
            continue  # gloo writes one entry with an empty name: nothing to learn from it
        config[str(name)] = {"desc": c.get("desc"), "ranks": _ranks(c.get("ranks"))}
    return {"format": fmt, "version": raw.get("version"), "pg_config": config,
            "pg_status": status, "entries": [_entry(e) for e in entries if isinstance(e, dict)]}


def _int(x):
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _ranks(x):
    if isinstance(x, str):
        try:
            x = json.loads(x)
        except ValueError:
            return None
    return [int(r) for r in x] if isinstance(x, (list, tuple)) else None


def _sizes(x):
    """A list of shapes (lists of ints), as the recorder writes them; None for anything else."""
    if not isinstance(x, (list, tuple)):
        return None
    out = []
    for shape in x:
        if not isinstance(shape, (list, tuple)) or not all(type(d) is int for d in shape):
            return None
        out.append(list(shape))
    return out


def _strs(x):
    return [str(v) for v in x] if isinstance(x, (list, tuple)) else None


def _entry(e: dict) -> dict:
    pg = e.get("process_group")
    pg_name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id"))
    pg_desc = str(pg[1]) if isinstance(pg, (list, tuple)) and len(pg) > 1 else None
    name = str(e.get("profiling_name") or "")
    op = name.split(":", 1)[1] if ":" in name else name
    frames = [{"file": f.get("filename"), "line": f.get("line"), "function": f.get("name")}
              for f in (e.get("frames") or []) if isinstance(f, dict)]
    return {"pg": pg_name, "pg_desc": pg_desc, "seq": _int(e.get("collective_seq_id")),
            "p2p_seq": _int(e.get("p2p_seq_id")), "op": op, "profiling_name": name,
            "input_sizes": _sizes(e.get("input_sizes")), "input_dtypes": _strs(e.get("input_dtypes")),
            "output_sizes": _sizes(e.get("output_sizes")), "state": e.get("state"),
            "retired": e.get("retired"), "time_created_ns": e.get("time_created_ns"),
            "is_p2p": bool(e.get("is_p2p")) or op in P2P_OPS, "frames": frames}


def _sig(e: dict) -> str:
    return json.dumps([e["op"], e["input_sizes"]], default=str)


def inflight(dump: dict) -> list[dict]:
    """Collective entries of one rank not yet completed: past the group's last completed
    sequence number (pg_status), or, without it, neither completed nor retired."""
    out = []
    for e in dump["entries"]:
        if e["is_p2p"] or e["seq"] is None:
            continue
        done = (dump["pg_status"].get(e["pg"]) or {}).get("completed")
        if done is not None:
            if e["seq"] > done:
                out.append(e)
        elif e["state"] != "completed" and not e["retired"]:
            out.append(e)
    return out


def compare(dumps: dict[int, dict]) -> dict:
    """Match collective entries across ranks per group by sequence number.

    Returns {groups: {pg: {ranks, last_enqueued{rank: seq}, last_completed{rank: seq}}},
    mismatches: [{pg, seq, by_signature{sig: {op, input_sizes, ranks}}}] (first per group),
    missing: [{pg, seq, op, waiting_ranks, missing_ranks}], inflight{rank: [{pg, seq, op, ...}]}}.
    """
    groups: dict[str, dict] = {}
    by_seq: dict[str, dict[int, dict[int, dict]]] = {}
    window_start: dict[str, dict[int, int]] = {}  # oldest seq each rank still holds per group
    for rank, d in dumps.items():
        for pg, s in d["pg_status"].items():
            g = groups.setdefault(pg, {"ranks": set(), "last_enqueued": {}, "last_completed": {}})
            g["ranks"].add(rank)
            g["last_enqueued"][rank] = s["enqueued"]
            g["last_completed"][rank] = s["completed"]
        for pg, c in d["pg_config"].items():
            if c["ranks"]:
                groups.setdefault(pg, {"ranks": set(), "last_enqueued": {}, "last_completed": {}})
                groups[pg]["ranks"].update(c["ranks"])
        for e in d["entries"]:
            if e["is_p2p"] or e["seq"] is None:
                continue
            g = groups.setdefault(e["pg"], {"ranks": set(), "last_enqueued": {},
                                            "last_completed": {}})
            g["ranks"].add(rank)
            by_seq.setdefault(e["pg"], {}).setdefault(e["seq"], {})[rank] = e
            w = window_start.setdefault(e["pg"], {})
            w[rank] = min(w.get(rank, e["seq"]), e["seq"])
    mismatches, missing = [], []
    for pg, seqs in by_seq.items():
        first = max(window_start[pg].values())  # older seqs may have left some ring buffers
        for seq in sorted(s for s in seqs if s >= first):
            sigs: dict[str, dict] = {}
            for rank, e in sorted(seqs[seq].items()):
                sigs.setdefault(_sig(e), {"op": e["op"], "input_sizes": e["input_sizes"],
                                          "ranks": []})["ranks"].append(rank)
            if len(sigs) > 1:
                mismatches.append({"pg": pg, "seq": seq, "by_signature": sigs})
                break  # later sequence numbers are shifted by the first desync
    for pg, g in groups.items():
        enq = {r: s for r, s in g["last_enqueued"].items() if s is not None}
        if not enq:
            continue
        top = max(enq.values())
        waiting = sorted(r for r, s in enq.items()
                         if s == top and (g["last_completed"].get(r) or 0) < top)
        behind = sorted(r for r in g["ranks"] if enq.get(r, -1) < top)
        if waiting and behind:
            e = next(iter((by_seq.get(pg, {}).get(top) or {}).values()), None)
            missing.append({"pg": pg, "seq": top, "op": e["op"] if e else None,
                            "waiting_ranks": waiting, "missing_ranks": behind,
                            "missing_last_enqueued": {str(r): enq.get(r) for r in behind}})
    return {"groups": {pg: {"ranks": sorted(g["ranks"]),
                            "last_enqueued": _keys_str(g["last_enqueued"]),
                            "last_completed": _keys_str(g["last_completed"])}
                       for pg, g in sorted(groups.items())},
            "mismatches": mismatches, "missing": missing,
            "inflight": {str(r): [_brief(e) for e in inflight(d)]
                         for r, d in sorted(dumps.items())}}


def _keys_str(d: dict) -> dict:
    return {str(k): v for k, v in sorted(d.items())}


def _brief(e: dict) -> dict:
    user = [f for f in e["frames"] if f.get("file") and "/torch/" not in f["file"]]
    return {"pg": e["pg"], "seq": e["seq"], "op": e["op"], "input_sizes": e["input_sizes"],
            "state": e["state"],
            "frame": user[0] if user else (e["frames"][0] if e["frames"] else None)}
