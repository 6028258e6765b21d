"""Hang post-mortem: verdict, per-rank state, desync / never-arrived evidence, stack groups."""

from __future__ import annotations

from collections import Counter

from trainprof.reports import kit, ranks as rk
from trainprof.wording import ranks_phrase, share_label

TITLE = "Hangs"


def _wait(w) -> str:
    if not isinstance(w, dict):
        return ""
    return f"{w.get('op')} #{w.get('seq')} (group {w.get('pg')}, {w.get('source')})"


def render(metrics: dict, summary: dict) -> str:
    if not metrics.get("hung") and not metrics.get("desync") and not metrics.get("died"):
        stalled = metrics.get("stalled_s")
        return kit.para(f"No hang: {metrics.get('ranks_with_heartbeat', 0)} rank(s) sent "
                        f"heartbeats" + (f"; last progress {stalled:.1f} s before the job ended"
                                         if isinstance(stalled, (int, float)) else "") + ".")
    out = [kit.para(rk.cap_numbers(metrics.get("message", "")))]
    out.append(kit.kv({"detected by": "; ".join(metrics.get("detected_by") or []) or "desync only",
                       "job status": (metrics.get("job") or {}).get("status"),
                       "no progress for": f"{metrics['stalled_s']:.1f} s"
                       if isinstance(metrics.get("stalled_s"), (int, float)) else None}))
    rows = [{"rank": r["rank"], "state": r["state"], "step": r["step"],
             "waiting in": _wait(r.get("waiting_in")),
             "frame": r.get("user_frame") or r.get("frame"),
             "code": r.get("code"), "stalled s": r.get("stalled_s")}
            for r in metrics.get("ranks") or []]
    if len(rows) > rk.MAX_RANKS:  # capped: the ranks unlike the rest first
        states = Counter(r["state"] for r in rows)
        culprits = set(rk.named(summary))
        rows.sort(key=lambda r: (r["rank"] not in culprits, states[r["state"]],
                                 -(r["stalled s"] if isinstance(r["stalled s"], (int, float)) else 0)))
    out.append(rk.rank_table(rows, [(k, k) for k in ("rank", "state", "step", "waiting in", "frame",
                                                     "code", "stalled s")],
                             worst_label="rarest state, then longest stalled"))
    desync = [{"source": d["source"], "group": d["pg"], "seq": d["seq"],
               "what": "ranks out of step" if d.get("by") == "steps" else "calls differ",
               "variants": "; ".join(f"{ranks_phrase(v['ranks'])}: {v.get('call') or v['op']}"
                                     for v in d["variants"])}
              for d in metrics.get("desync") or []]
    if desync:
        out.append(kit.para("Desynchronized collectives (first differing sequence number "
                            "per group)"))
        out.append(kit.table(desync))
    missing = [{"source": m["source"], "group": m["pg"], "seq": m["seq"], "op": m.get("op"),
                "waiting ranks": rk.rank_list(m["waiting_ranks"]),
                "never arrived": rk.rank_list(m["missing_ranks"])}
               for m in metrics.get("never_arrived") or []]
    if missing:
        out.append(kit.para("Ranks that never arrived at a collective the others wait in"))
        out.append(kit.table(missing))
    sizes = [len(g.get("ranks") or []) for g in metrics.get("stack_groups") or []]
    groups = [{"ranks": rk.rank_list(g["ranks"]), "share": share_label(len(g.get("ranks") or []), sizes),
               "in collective": "yes" if g["in_collective"] else "no",
               "frame": g.get("user_frame") or g.get("frame"), "code": g.get("code"),
               "innermost frames": " ← ".join(f"{f['function']}:{f['line']}"
                                              for f in (g.get("frames") or [])[:5])}
              for g in metrics.get("stack_groups") or []]
    if groups:
        out.append(kit.para("Main-thread stacks grouped across ranks"))
        out.append(kit.table(groups))
    return "\n".join(out)
