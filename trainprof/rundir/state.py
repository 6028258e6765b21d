"""Is the run still going? What a run directory says of its job's state, read without disturbing
the probes that may still be writing it (read-only opens, the tail of each heartbeat file).

    ended    the launcher recorded the job's end (manifest.json ``end_time`` / a final
             ``status``), or every rank wrote its ``close`` heartbeat
    running  no end recorded, and the launcher process is alive on this host, or (another host,
             no launcher) a rank wrote a heartbeat less than LIVE_S seconds ago
    stopped  no end recorded and nothing alive: the launcher is gone (killed with its job, e.g.
             SIGKILL at a scheduler's wall-time limit) or no heartbeat for LIVE_S seconds
    unknown  neither a launcher record (manifest.json) nor any heartbeat

``state()`` returns {"state", "last_step", "last_progress" (ISO-8601), "heartbeat_age_s",
"why", "ranks": [{rank, step, age_s, closed}] (ranks by rank)}.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from datetime import datetime, timezone
from pathlib import Path

from trainprof import safeio
from trainprof.rundir.files import HEARTBEAT, HEARTBEAT_PREV

LIVE_S = 120.0          # a heartbeat this recent says the job is alive (heartbeats come on progress)
TAIL_BYTES = 1 << 16    # read at most this much of the end of each heartbeat file
FINAL_STATUSES = ("ok", "failed", "killed", "failed_to_start", "hung")


def tail_records(path: Path, max_bytes: int = TAIL_BYTES, limit: int | None = None) -> list[dict]:
    """The complete JSON lines in the last ``max_bytes`` of a file, oldest first (the first,
    possibly cut line and a torn last line are skipped); [] when it cannot be read. Opens the
    file read-only and reads only its end: a writer appending to it is not disturbed."""
    try:  # a regular file only, opened without blocking (a FIFO planted in a run would hang)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return []
        start = max(0, st.st_size - max_bytes)
        chunk = os.pread(fd, max_bytes, start)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = chunk.split(b"\n")
    if start > 0:
        lines = lines[1:]  # cut in the middle
    out = []
    for line in reversed(lines):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
    return out[::-1]


def last_record(path: Path) -> dict | None:
    """The last complete JSON line of a file (a torn last line is skipped), or None: the last
    4 KiB read first, TAIL_BYTES when no whole line is in them."""
    recs = tail_records(path, 4096, limit=1) or tail_records(path, limit=1)
    return recs[-1] if recs else None


def rank_progress(root: Path) -> list[dict]:
    """Per rank directory: its last heartbeat's step, time and event."""
    out = []
    ranks = Path(root) / "ranks"
    try:
        dirs = sorted(d for d in ranks.iterdir() if d.name.startswith("rank-"))
    except OSError:
        return out
    now = time.time_ns()
    for d in dirs:
        try:
            r = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        # (between a rotation and the next beat only the previous file holds the last record)
        rec = last_record(d / HEARTBEAT) or last_record(d / HEARTBEAT_PREV) or {}
        t = rec.get("t_ns") if isinstance(rec.get("t_ns"), int) else None
        out.append({"rank": r, "step": rec.get("step") if isinstance(rec.get("step"), int) else None,
                    "t_ns": t, "age_s": round((now - t) / 1e9, 1) if t else None,
                    "closed": rec.get("event") == "close", "event": rec.get("event")})
    return out


def _alive(manifest: dict) -> bool | None:
    """Whether the launcher process is alive: None when it ran on another host (unknown)."""
    pid, host = manifest.get("launcher_pid"), manifest.get("host")
    if not isinstance(pid, int) or pid <= 0 or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


def _iso(ns) -> str | None:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds") if ns else None


def state(root, manifest: dict | None = None, live_s: float = LIVE_S) -> dict:
    root = Path(root)
    if manifest is None:
        try:
            fd, _ = safeio.open_regular(root / "manifest.json")  # never a FIFO planted in the run
            with open(fd, "rb") as f:
                manifest = json.loads(f.read(64 << 20))
        except (OSError, ValueError, safeio.InputRefused):
            manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    ranks = rank_progress(root)
    steps = [r["step"] for r in ranks if r["step"] is not None]
    times = [r["t_ns"] for r in ranks if r["t_ns"]]
    newest = max(times) if times else None
    age = round((time.time_ns() - newest) / 1e9, 1) if newest else None
    out = {"last_step": max(steps) if steps else None, "last_progress": _iso(newest),
           "heartbeat_age_s": age, "ranks": ranks}
    status = manifest.get("status")
    ended = manifest.get("end_time") or status in FINAL_STATUSES
    if ended:
        return {"state": "ended", "why": f"the launcher recorded the job's end (status {status})",
                **out}
    if ranks and all(r["closed"] for r in ranks):
        return {"state": "ended", "why": "every rank wrote its closing heartbeat", **out}
    alive = _alive(manifest)
    if alive:
        return {"state": "running", "why": f"the launcher (pid {manifest['launcher_pid']}) is "
                                           f"running", **out}
    if alive is False:
        return {"state": "stopped", "why": f"the launcher (pid {manifest.get('launcher_pid')}) is "
                "gone without recording the job's end (killed with its job?)", **out}
    if age is not None and age <= live_s:
        return {"state": "running", "why": f"a rank made progress {age:.0f} s ago", **out}
    if age is None and not manifest:
        return {"state": "unknown", "why": "no launcher record and no heartbeat", **out}
    return {"state": "stopped", "why": ("no heartbeat for " + (f"{age:.0f} s" if age is not None
                                        else "any rank") + " and no end recorded"), **out}
