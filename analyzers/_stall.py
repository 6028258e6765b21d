"""A stall the job recovered from: which rank stalled, where, and for how long.

When the hang watchdog fired but every rank went on and the job ended normally, the ranks'
heartbeats (written on progress) show one gap each around the watchdog's trigger. The rank
that stalled is the one that was behind when its gap began: its last collective before the gap
comes earlier in its group's sequence than the collective the other ranks were then waiting in
(every rank of a group issues its collectives in the same order). A rank that did not answer
the watchdog's stack dump in time (manifest ``hangs[].ranks_not_dumped``), or answered it
long after the trigger, was not running at all then: stopped (SIGSTOP, a debugger), frozen or
swapped out.
"""

from __future__ import annotations

LATE_DUMP_S = 5.0  # a dump written this long after the trigger: the process was not running


def _gap(beats: list[dict], at: int | None) -> tuple[dict, dict] | None:
    """The two consecutive progress beats around ``at`` (else the longest gap)."""
    ts = [(h, h.get("t_ns")) for h in beats if isinstance(h.get("t_ns"), int)
          and h.get("event") in (None, "start", "progress")]
    pairs = list(zip(ts, ts[1:]))
    if not pairs:
        return None
    if at is not None:
        around = [(a, b) for a, b in pairs if a[1] <= at <= b[1]]
        if around:
            return around[0][0][0], around[0][1][0]
    a, b = max(pairs, key=lambda p: p[1][1] - p[0][1])
    return a[0], b[0]


def _position(beat: dict) -> tuple[str, int] | None:
    c = beat.get("last_collective")
    if isinstance(c, dict) and isinstance(c.get("seq"), int):
        return str(c.get("pg")), c["seq"]
    return None


def _where(c) -> str:
    if not isinstance(c, dict):
        return "no collective yet"
    return f"{c.get('op')} #{c.get('seq')} of group {c.get('pg')}"


def describe(run, views: dict) -> dict | None:
    """{"ranks", "stalled_s", "step", "after", "waiting", "text", ...} for the rank(s) that
    stalled, or None when the heartbeats do not single one out."""
    man = run.launcher
    hangs = [h for h in man.get("hangs") or [] if isinstance(h, dict)]
    trig = next((h["t_ns"] for h in hangs if isinstance(h.get("t_ns"), int)), None)
    gaps = {}
    for r, v in views.items():
        g = _gap(v.heartbeats or [], trig)
        if g and _position(g[0]) is not None:
            gaps[r] = g
    if len(gaps) < 2:
        return None
    pos = {r: _position(g[0]) for r, g in gaps.items()}
    groups = {p[0] for p in pos.values()}
    if len(groups) != 1:  # different groups' sequences do not compare
        return None
    low = min(p[1] for p in pos.values())
    behind = sorted(r for r, p in pos.items() if p[1] == low)
    if len(behind) == len(gaps):
        return None
    not_dumped = sorted({int(r) for h in hangs for r in h.get("ranks_not_dumped") or []
                         if isinstance(r, int)})
    late = {}
    for r in behind:
        d = views[r].dump or {}
        if trig and isinstance(d.get("t_ns"), int) and (d["t_ns"] - trig) / 1e9 > LATE_DUMP_S:
            late[r] = round((d["t_ns"] - trig) / 1e9, 1)
    first = behind[0]
    before, after = gaps[first]
    stalled = round((after["t_ns"] - before["t_ns"]) / 1e9, 1)
    others = sorted(set(gaps) - set(behind))
    waiting = next((c for r in others for c in gaps[r][0].get("inflight") or []
                    if isinstance(c, dict)), None) or gaps[others[0]][0].get("last_collective")
    who = f"rank {first}" if len(behind) == 1 else f"ranks {','.join(map(str, behind))}"
    text = (f"Stall (the job recovered): {who} stopped progressing for {stalled:.1f} s in step "
            f"{before.get('step')}, after {_where(before.get('last_collective'))}; "
            f"rank{'s' * (len(others) > 1)} {','.join(map(str, others))} waited for it in "
            f"{_where(waiting)}")
    frozen = [r for r in behind if r in not_dumped or r in late]
    if frozen:
        text += (f"; {'it' if len(behind) == 1 else 'they'} did not answer the hang watchdog's "
                 f"stack dump in time" + (f" (written {late[frozen[0]]:.1f} s after the trigger)"
                                          if frozen[0] in late else "")
                 + ": the process was not running (stopped by a signal such as SIGSTOP, a "
                   "debugger, frozen or swapped out), not blocked in the job's code")
    code = man.get("exit_code")
    text += (f"; then it went on and every rank finished" +
             (f" (exit code {code})" if isinstance(code, int) else ""))
    return {"ranks": behind, "stalled_s": stalled, "step": before.get("step"),
            "after": before.get("last_collective"), "waiting_ranks": others, "waiting_in": waiting,
            "not_running": frozen, "text": text}
