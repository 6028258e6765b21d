"""What `trainprof watch` shows: a run's recent progress, computed from the ends of its files.

Not one of the analysis passes (it is not in ANALYZER_MODULES): a cheap snapshot that reads only
the end of each rank's steps.jsonl (RANK_TAIL_BYTES; STEP_TAIL_BYTES of the most advanced
rank's) and heartbeat.jsonl (its last line: trainprof/rundir/state.py),
so a refresh every few seconds costs the same at step 100 and at step 10,000,000, and opens
nothing for writing.

    steps/s      over the last ``window_s`` seconds: steps the most advanced rank finished in
                 it (of its last ~1,000) ÷ the time between the first and last of them
    step time    median and max of those steps' durations (``dur_ms``); per rank, the median
                 of its last ~30 steps in the window
    lag          per rank: the most advanced rank's last step − its last step
    heartbeat    per rank: seconds since its last heartbeat (written on progress only)
    hang         suspected when the run is running and no rank progressed for
                 max(HANG_MIN_S, HANG_STEPS × the recent median step)
    findings     of RUN/summary.json (the last analysis: `analyze`, `wrap --analyze-every`)
                 with their onsets, and how old that analysis is
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from trainprof import safeio
from trainprof.rundir import state as runstate

STEP_TAIL_BYTES = 1 << 17   # the most advanced rank: ~1,000 step records for the window
RANK_TAIL_BYTES = 4 << 10   # every rank: its last ~30 steps (last step, recent step time)
HANG_MIN_S = 60.0
HANG_STEPS = 20.0
MAX_FINDINGS = 12


def snapshot(root, window_s: float = 300.0, now_ns: int | None = None) -> dict:
    root = Path(root)
    now_ns = now_ns or time.time_ns()
    st = runstate.state(root)
    ranks = {r["rank"]: dict(r) for r in st.pop("ranks")}
    dirs = {}
    for d in sorted((root / "ranks").glob("rank-*")) if (root / "ranks").is_dir() else []:
        try:
            dirs[int(d.name.split("-", 1)[1])] = d
        except ValueError:
            continue
    # every rank: its last few steps (a small read); the most advanced rank: the window
    tails = {r: [x for x in runstate.tail_records(d / "steps.jsonl", RANK_TAIL_BYTES)
                 if isinstance(x.get("step"), int)] for r, d in dirs.items()}
    last_end = max((x[-1]["end_ns"] for x in tails.values()
                    if x and isinstance(x[-1].get("end_ns"), int)), default=now_ns)
    # the window ends now while the run goes on, else at its last step
    ref = now_ns if st["state"] == "running" else last_end
    lo = ref - window_s * 1e9
    for r, recs in tails.items():
        row = ranks.setdefault(r, {"rank": r, "step": None, "age_s": None, "closed": False})
        if recs:
            row["last_step"] = recs[-1]["step"]
            row["last_end_ns"] = recs[-1].get("end_ns")
            durs = [float(x["dur_ms"]) for x in recs if isinstance(x.get("dur_ms"), (int, float))
                    and isinstance(x.get("end_ns"), int) and x["end_ns"] >= lo and x["step"] >= 1]
            row["step_ms"] = float(np.median(durs)) if durs else None
    lead = max((v.get("last_step") for v in ranks.values() if v.get("last_step") is not None),
               default=None)
    rate, recent = None, []
    top = max((r for r in tails if tails[r]), key=lambda r: tails[r][-1]["step"], default=None)
    if top is not None:
        win = [x for x in runstate.tail_records(dirs[top] / "steps.jsonl", STEP_TAIL_BYTES)
               if isinstance(x.get("step"), int) and isinstance(x.get("end_ns"), int)
               and x["end_ns"] >= lo and x["step"] >= 1]
        recent = [float(x["dur_ms"]) for x in win if isinstance(x.get("dur_ms"), (int, float))]
        e = sorted(x["end_ns"] for x in win)
        if len(e) >= 2 and e[-1] > e[0]:
            rate = (len(e) - 1) / ((e[-1] - e[0]) / 1e9)
    med = float(np.median(recent)) if recent else None
    for v in ranks.values():
        v["lag"] = (lead - v["last_step"]) if lead is not None and v.get("last_step") is not None else None
    hb_ages = [v["age_s"] for v in ranks.values() if v.get("age_s") is not None]
    quiet = min(hb_ages) if hb_ages else None
    limit = max(HANG_MIN_S, HANG_STEPS * (med or 0) / 1e3)
    hang = None
    if st["state"] == "running" and quiet is not None and quiet >= limit:
        hang = {"no_progress_s": quiet, "limit_s": round(limit, 1),
                "text": f"no rank made progress for {quiet:.0f} s (limit {limit:.0f} s): a hang? "
                        f"`trainprof hang {root} --dump` dumps every rank's stacks"}
    rows = sorted(ranks.values(), key=lambda v: (-(v.get("lag") or 0), -(v.get("age_s") or 0),
                                                 v["rank"]))
    return {"dir": str(root), "state": st["state"], "why": st["why"],
            "last_step": lead if lead is not None else st["last_step"],
            "last_progress": st["last_progress"], "window_s": window_s,
            "steps_per_s": rate, "step_ms": med,
            "step_ms_max": float(np.max(recent)) if recent else None,
            "ranks": len(ranks), "worst": rows, "hang": hang,
            "analysis": _last_analysis(root, now_ns)}


def _last_analysis(root: Path, now_ns: int) -> dict | None:
    """The findings of RUN/summary.json with their onsets, and its age."""
    p = root / "summary.json"
    try:
        age = now_ns / 1e9 - p.stat().st_mtime
        fd, _ = safeio.open_regular(p)  # never blocks on a FIFO in the run directory
        with open(fd, "rb") as f:
            doc = json.loads(f.read(256 << 20))
    except (OSError, ValueError, safeio.InputRefused):
        return None
    fs = [f for f in doc.get("findings") or [] if isinstance(f, dict)]
    return {"age_s": round(age, 1), "generated_at": doc.get("generated_at"),
            "state": (doc.get("run") or {}).get("state"),
            "findings": [{k: f.get(k) for k in ("kind", "severity", "ranks", "onset", "end", "message")}
                         for f in fs[:MAX_FINDINGS]], "more": max(0, len(fs) - MAX_FINDINGS)}
