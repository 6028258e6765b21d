"""The hang finding's words (analyzers/hang.py): its kind, its message from the post-mortem (the
culprit, its victims, what became of the other ranks, a desync said by what differs between
the ranks, who waits where)."""

from __future__ import annotations

from trainprof.analyzers import _hang_steps as steps_desync
from trainprof.analyzers._hang_exits import _first_line
from trainprof.analyzers._hang_views import _rank_s, _ranks, describe_failure
from trainprof.wording import ranks_phrase, verb

def kind_of(pm) -> str:
    """The finding's kind: ``hang`` (the ranks stopped progressing: the watchdog fired, ranks
    dumped, or every rank stalled before the job ended), ``desync`` (a rank issued another
    collective than its peers, or never arrived at one they entered), ``rank_failure`` (a rank's
    process failed: an exception, an error exit, a signal). A crash is never a hang."""
    if pm["hung"]:
        return "hang"
    c = pm["culprit"]
    if c and c["reason"] in ("desync", "never_arrived"):
        return "desync"
    return "rank_failure" if pm["died"] else "desync"


def _message(pm) -> str:
    parts = []
    c = pm["culprit"]
    head = {"hang": "Hang", "desync": "Collective desynchronization",
            "rank_failure": "Rank failure"}[pm.get("kind") or kind_of(pm)]
    if pm["recovered"]:
        head = "Stall (the job recovered)"
    elif head == "Hang" and pm["job"].get("running") and pm.get("stalled_s") is not None:
        head = f"Hang in progress (no rank progressed for {pm['stalled_s']:.0f} s; the job still runs)"
    if c:
        where = f"; it is at {c['frame']}" if c["frame"] else ""
        code = f" (`{c['code']}`)" if c["frame"] and c.get("code") else ""
        parts.append(f"{head}: rank {_ranks(c['ranks'])} {c['how']}{where}{code}")
        if c["reason"] == "exited_early":
            parts[-1] = f"{head}: {_rank_s(c['ranks'])} left the job early: {c['how']}"
            for v in c["victims"]:
                parts.append(f"rank {v['rank']} then {v['how']}: a consequence, not the cause")
            if c.get("also_failed"):
                parts.append(f"{_rank_s(c['also_failed'])} had also ended before the launcher "
                             f"stopped the job")
            parts.append(c["suggestion"])
        elif c.get("suggestion"):
            parts[-1] += f" ({c['suggestion']})"
        if c.get("silent"):
            parts[-1] = f"{head}: {_rank_s(c['ranks'])} {c['how']}" + (where + code if pm["hung"] else "")
            parts += c["consequences"]
            if c["consequences"]:
                parts[-1] += ": a consequence of the desynchronization, not its cause"
            ended = [row for row in pm["ranks"] if row["state"] == "ended_by_launcher"]
            parts += _after_first(ended, (pm["died"] or [{}])[0].get("failure")) if pm["died"] else []
        if c["reason"] == "died":
            parts[-1] = f"{head}: rank {c['ranks'][0]} was the first to fail: {c['how']}{where}{code}"
            if c.get("also_failed"):
                parts.append(f"{_rank_s(c['also_failed'])} had also ended before the launcher "
                             f"stopped the job")
        for v in c.get("victims") or [] if c["reason"] != "exited_early" else []:
            parts.append(f"rank {v['rank']} was the first to end ({v['how']}): a victim of "
                         f"the mismatch, not its cause")
        if c.get("victims") and c.get("also_failed") and c["reason"] != "exited_early":
            parts.append(f"{_rank_s(c['also_failed'])} had also ended before the launcher "
                         f"stopped the job")
        if c["reason"] == "died" or c.get("victims"):
            ended = [row for row in pm["ranks"] if row["state"] == "ended_by_launcher"]
            parts += _after_first(ended, (pm["died"] or [{}])[0].get("failure"))
    else:
        parts.append(f"{head}: no culprit could be singled out")
    if pm["desync"] and not (c and c["reason"] == "desync"):
        parts.append(_desync_text(pm["desync"][0]))
    by_wait: dict = {}  # (op, pg, seq) -> rows of the ranks blocked in it
    for row in pm["ranks"]:
        w = row["waiting_in"]
        if w and row["state"] == "in_collective":
            by_wait.setdefault((w.get("op"), w.get("pg"), w.get("seq")), []).append(row)
    if by_wait:
        (op, pg, seq), rows = max(by_wait.items(), key=lambda kv: len(kv[1]))
        frame = next((row["user_frame"] for row in rows if row["user_frame"]), None)
        who = [row["rank"] for row in rows]
        parts.append(f"{ranks_phrase(who)} {verb(len(who), 'waits', 'wait')} in {op} #{seq} of "
                     f"group {pg}" + (f" at {frame}" if frame else ""))
    if pm["ranks_without_data"]:
        parts.append(f"no data from ranks {_ranks(pm['ranks_without_data'])}")
    return "; ".join(parts)


def _desync_text(d: dict) -> str:
    """A desync that is not the culprit's reason, said with what differs between the ranks:
    'desynchronized at collective #41 of group 0: rank 0 issued all_reduce (c10d.all_reduce,
    4 B) in step 20, rank 1 all_reduce (ddp.bucket, 799.8 kB) in step 20'."""
    if d.get("by") == "steps":
        return (f"the ranks had fallen out of step before: {_rank_s(d['deviating'])} "
                f"{steps_desync.describe(d)}")
    vs = [f"{_rank_s(v['ranks'])} {'issued ' if i == 0 else ''}{variant_text(d, v)}"
          for i, v in enumerate(d["variants"])]
    src = "" if d["source"] == "probe" else " (flight recorder)"
    return f"desynchronized at collective #{d['seq']} of group {d['pg']}{src}: {', '.join(vs)}"


def variant_text(d: dict, v: dict) -> str:
    """One side of a desync: 'all_reduce (ddp.bucket, 799.8 kB) in step 21' (its API where
    known, its size where known, its step)."""
    call = (d.get("calls") or {}).get(str(v["ranks"][0])) or \
        (f"{v['op']} ({v['api']})" if v.get("api") else str(v["op"]))
    size = steps_desync.size_text(v.get("bytes"))
    if "(" in call:  # 'all_reduce (ddp.bucket)': its size goes with the API
        call = call[:-1] + (f", {size})" if size else ")")
    elif size:
        call += f" ({size})"
    st = v.get("steps") or []
    return call + (f" in step {st[0]}" if len(st) == 1 else f" in steps {st[0]}-{st[-1]}" if st else "")


def _after_first(ended: list[dict], first: dict | None) -> list[str]:
    """What became of the ranks the launcher ended after the first failure: those that had
    already failed on their own (their failure record) are said so, with the time after the
    first; the launcher ended the others."""
    same, other, stopped = [], [], []
    t0 = (first or {}).get("t_ns")
    for row in ended:
        f = row.get("failure") or {}
        if not f.get("t_ns"):
            stopped.append(row["rank"])
            continue
        later = f" {(f['t_ns'] - t0) / 1e9:.2f} s later" if t0 and f["t_ns"] >= t0 else ""
        if first and (f.get("exc_type"), _first_line(f).get("exc")) == \
                (first.get("exc_type"), _first_line(first).get("exc")):
            same.append((row["rank"], later))
        else:
            other.append((row["rank"], later, describe_failure(_first_line(f)) or "failed"))
    out = []
    for r, later in same:
        out.append(f"rank {r} raised the same error{later}, before the launcher stopped it")
    for r, later, what in other:
        out.append(f"rank {r} failed too{later}: {what}")
    if stopped:
        out.append(f"the launcher then ended {_rank_s(stopped)}")
    return out
