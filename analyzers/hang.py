"""Hang post-mortem: which ranks are stuck where, in which collective, who never arrived, whether
the ranks desynchronized, and the culprit rank with its frame.

Inputs (every one optional; a kill -9 leaves some missing or torn):
  manifest.json                 status "hung" and hangs[] events from `wrap --hang-timeout`
  ranks/rank-N/heartbeat.jsonl  progress records (probes/heartbeat.py; torn last line tolerated)
  ranks/rank-N/hang-dump.json   all-thread stacks + in-flight collectives (probes/hang_watchdog.py)
  ranks/rank-N/flight-recorder.pkl|json  torch's flight recorder (read by _flight_recorder)
  ranks/rank-N/collectives.jsonl, groups.jsonl  the collectives probe's log
  ranks/rank-N/steps.jsonl      last step closed
  worker-exits.jsonl            how each worker process ended, recorded by the torchrun agent
                                (probes/elastic_agent.py): a rank killed by SIGKILL says nothing
                                itself

A hang is present when the launcher said so (status "hung", hangs[] events), when ranks dumped,
or when every rank's progress stopped long before the job ended (stall > max(5 s, 3x the usual
gap between heartbeats, 2x the longest step)) without the ranks closing their heartbeat. A
desynchronization (different op or size at one sequence number of a group, or ranks that issued
different numbers of collectives of a group in one step) is reported even if the job crashed
instead of hanging. A rank whose process died first (a signal or a non-zero exit
the launcher saw before it stopped the others; or, without that record, a heartbeat that stopped
while the other ranks went on) is named with its step, last collective and signal, and with the
exception it recorded (heartbeat ``failure`` records, probes/heartbeat_exit.py); a rank that died
waiting in a collective another, live rank never arrived at is its victim, not the culprit. The
finding's kind is ``hang``, ``desync`` or ``rank_failure`` (kind_of): a crash is never a hang.
Clean runs (every heartbeat closed) are silent.

Two collective sources are analyzed side by side and never mixed, as their sequence numbers
differ: "probe" (collectives probe: 0-based seq per group) and "flight_recorder" (torch's
collective_seq_id, 1-based, from dumps or the heartbeats' fr counters).

Parts: what is read of each rank (analyzers/_hang_views.py: RankView, dumps, stacks), how
the ranks of a stopped job ended (analyzers/_hang_exits.py), the op/size ledger
(analyzers/_hang_ledger.py) and ranks that fell out of step silently (analyzers/_hang_steps.py);
when it hung (analyzers/_hang_detect.py); the finding's words (analyzers/_hang_wording.py).
This module builds the post-mortem and picks the culprit.
"""

from __future__ import annotations

from trainprof.analyzers import _flight_recorder as fr
from trainprof.analyzers import _hang_ledger as led
from trainprof.analyzers import _hang_steps as steps_desync
from trainprof.analyzers._hang_detect import _detect
from trainprof.analyzers._hang_exits import (_clean_exits, _died, _early_exit, _fatal_desync,
                                             _fmt_collective, _infer_fatal, _note_left, _worker_exits)
from trainprof.analyzers._hang_exits import victim_how as _victim_how
# the per-rank view and readers are also this module's (tests and trainprof hang read them here)
from trainprof.analyzers._hang_views import (DUMP, RankView, _desync_fr,  # noqa: F401
                                             _members, _missing_fr_heartbeats, _rank_s,
                                             _ranks, _read_dump, _stack_groups, describe_failure,
                                             fmt_frame)
from trainprof.analyzers._hang_wording import _message, kind_of, variant_text
from trainprof.findings import AnalyzerResult, Finding
from trainprof.rundir import worker_exits

NAME = "hang"
P2P_OPS = fr.P2P_OPS
SIZE_STRICT_OPS = {"all_reduce", "allreduce", "broadcast", "reduce", "all_gather",
                   "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "barrier"}


def analyze(run) -> AnalyzerResult:
    pm = postmortem(run)
    if pm is None:
        return AnalyzerResult()
    if not pm["hung"] and not pm["desync"] and not pm["died"]:
        keys = ("hung", "ranks_with_heartbeat", "stalled_s", "stall_threshold_s", "quiet_end")
        return AnalyzerResult(metrics={k: pm[k] for k in keys})
    return AnalyzerResult(metrics=pm, findings=[finding(pm)])


# --------------------------------------------------------------------------- per rank


# --------------------------------------------------------------------------- collectives


# --------------------------------------------------------------------------- stacks


# --------------------------------------------------------------------------- detection


def postmortem(run) -> dict | None:
    """The whole post-mortem as a JSON-able dict, or None when the run holds no hang data."""
    ranks = list(range(run.world_size)) if run.world_size else list(run.ranks)
    ranks = sorted(set(ranks) | set(run.ranks))
    run.frame("collectives")  # one table of every rank's log; the views take its last records
    run.steps()  # (the same for the steps)
    unrecorded = worker_exits.launcher_unrecorded(run.launcher)
    if unrecorded and unrecorded["state"] != "alive":
        run.problems.append(f"{run.path}/manifest.json: {unrecorded['text']}")
    views = {r: RankView(run, r) for r in ranks}
    exits = _worker_exits(run)
    if not any(v.heartbeats or v.dump or v.fr for v in views.values()) \
            and run.launcher.get("status") != "hung" and not exits["first_failures"]:
        return None
    _infer_fatal(run, views, exits)
    det = _detect(run, views, exits, unrecorded)
    died = _died(run, views, exits, det)
    ledger, members = led.Ledger(run, views), _members(run)
    fr_dumps = {r: v.fr for r, v in views.items() if v.fr}
    cmp = fr.compare(fr_dumps) if fr_dumps else {}
    desync = steps_desync.lead_with(
        _fatal_desync(run, views, led.desync(ledger, P2P_OPS, SIZE_STRICT_OPS)),
        steps_desync.step_desync(run, P2P_OPS)) + _desync_fr(cmp)
    for d in desync:  # each side's call as the finding words it (the report and `hang` show it)
        for v in d["variants"]:
            v["call"] = variant_text(d, v)
    missing = led.missing(ledger, members, views)
    missing += [{"source": "flight_recorder", **m} for m in cmp.get("missing", [])] if cmp \
        else _missing_fr_heartbeats(views)
    for m in missing:  # a torn heartbeat lost its rank's newest state: unknown, not missing
        unknown = [r for r in m["missing_ranks"] if views[r].torn and not views[r].dump]
        if unknown and len(unknown) < len(m["missing_ranks"]):
            m["missing_ranks"] = [r for r in m["missing_ranks"] if r not in unknown]
            m["unknown_ranks"] = unknown
    hung = bool(det["reasons"])
    stacks = _stack_groups(views)
    clean = _clean_exits(run, views, exits)
    early = _early_exit(run, views, died, clean, ledger, members)
    culprit = _culprit(views, desync, missing, stacks, hung, died, early)
    if culprit is not None and culprit["reason"] == "never_arrived":
        _note_left(run, culprit, clean, views)
    rows = []
    for r, v in views.items():
        w = v.waiting_in()
        ex = exits["workers"].get(r)
        state = ("died" if any(d["rank"] == r for d in died) else
                 "ended_by_launcher" if ex and ex["ended_by_launcher"] else
                 "no_data" if not v.present else "exited" if v.closed else
                 "unknown (heartbeat torn)" if v.torn and v.stack is None else
                 "in_collective" if v.blocked else "outside_collective" if v.stack is not None
                 or v.heartbeats else "unknown")
        rows.append({
            "rank": r, "state": state, "step": v.step, "last_progress_ns": v.last_progress_ns,
            "stalled_s": round(max(0.0, (det["end_ns"] - v.last_progress_ns) / 1e9), 3)
            if det["end_ns"] and v.last_progress_ns else None,
            "waiting_in": w, "last_collective": v.last_collective, "dumped": bool(v.dump),
            "flight_recorder": bool(v.fr), "frame": fmt_frame(v.frame),
            "user_frame": fmt_frame(v.user_frame),
            "code": (v.user_frame or {}).get("code"),
            "stack_group": next((g["id"] for g in stacks if r in g["ranks"]), None),
            "failure": v.failure,
            "exit": {k: ex.get(k) for k in ("pid", "host", "exitcode", "signal", "signal_name",
                                            "first", "ended_by_launcher")} if ex else None})
    pm = {
        "hung": hung, "recovered": det["recovered"], "detected_by": det["reasons"],
        "desync": desync, "never_arrived": missing, "stack_groups": stacks, "culprit": culprit,
        "died": died,
        "ranks": rows, "job": {k: run.launcher.get(k) for k in ("status", "exit_code", "signal",
                                                                  "signal_name", "job_exit_code",
                                                                  "hangs", "signals_forwarded")}
        | {"exit_not_recorded": unrecorded["text"] if unrecorded else None,
           "running": bool(unrecorded and unrecorded["state"] == "alive")},
        "last_progress_ns": det["last_progress_ns"], "stalled_s": det["stalled_s"],
        "stall_threshold_s": det["threshold_s"], "quiet_end": det.get("quiet_end"),
        "ranks_with_heartbeat": sum(1 for v in views.values() if v.heartbeats),
        "ranks_without_data": [r for r, v in views.items() if not v.present],
        "flight_recorder": {"ranks": sorted(fr_dumps), "groups": cmp.get("groups", {}),
                            "inflight": cmp.get("inflight", {})} if fr_dumps else None,
    }
    pm["kind"] = kind_of(pm)
    if pm["recovered"]:  # which rank stalled, where, for how long (analyzers/_stall.py)
        from trainprof.analyzers import _stall  # lazy: start-up time of analyze

        pm["stall"] = _stall.describe(run, views)
    pm["message"] = pm["stall"]["text"] if pm.get("stall") else _message(pm)
    return pm


def _culprit(views, desync, missing, stacks, hung, died=(), early=None) -> dict | None:
    def describe(ranks, reason, how):
        v = views[ranks[0]]
        return {"ranks": ranks, "reason": reason, "how": how,
                "frame": fmt_frame(v.user_frame or v.frame), "innermost_frame": fmt_frame(v.frame),
                "code": (v.user_frame or v.frame or {}).get("code"), "step": v.step}

    silent = steps_desync.explains(desync, died, hung)
    if silent is not None:  # ranks out of step since: whatever followed is its consequence
        c = describe(silent["deviating"], "desync", steps_desync.describe(silent))
        c.update({"silent": True, "fix": steps_desync.fix(silent),
                  "consequences": steps_desync.consequences(died, early if not hung else None)})
        return c
    if early and not hung:  # a rank left the job: the first failure was its peers' collective
        c = describe(early["ranks"], "exited_early", early["how"])
        c.update({"early_exit": early["exits"], "victims": early["victims"],
                  "also_failed": early["also_failed"], "suggestion": early["suggestion"]})
        return c
    victims = _victims(died, desync, missing)
    if died and not victims:  # a process that died is the cause of whatever the others did next
        d = died[0]
        what = worker_exits.how(d) if d.get("exitcode") is not None else "stopped (its process died?)"
        raised = describe_failure(d.get("failure"))
        if raised:
            what = f"{raised} ({what})"
        where = f" in step {d['step']}" if d.get("step") is not None else ""
        done = f" (last completed step {d['last_step_done']})" if d.get("last_step_done") is not None else ""
        coll = _fmt_collective(d.get("last_collective"))
        how = f"{what}{where}{done}" + (f"; its last recorded collective: {coll}" if coll else "")
        if d.get("signal_name") == "SIGABRT" and not d.get("failure"):
            how += (" (gloo and NCCL abort a rank with SIGABRT on a collective mismatch or a "
                    "timeout: its stderr says which)")
        c = describe([d["rank"]], "died", how)
        c.update({k: d.get(k) for k in ("exitcode", "signal", "signal_name", "pid", "host", "source",
                                        "last_step_done", "last_collective")})
        c["also_failed"] = [x["rank"] for x in died[1:]]
        c["failure"] = d.get("failure")
        return c
    c = _culprit_alive(views, desync, missing, stacks, hung)
    if c is not None and victims:
        c["victims"] = [{"rank": d["rank"], "how": _victim_how(d)} for d in victims]
        c["also_failed"] = [d["rank"] for d in died if d not in victims]
        unwritten = [r for r in c["ranks"] if not views[r].closed and not views[r].dump
                     and not views[r].blocked]
        if c["reason"] == "never_arrived" and unwritten:
            # its log is written at step boundaries and at its close: ended before closing, the
            # collectives it issued since its last boundary are in no record
            c["records_incomplete"] = unwritten
            c["how"] += (" as far as its records show (or it issued another collective there: "
                         "its process ended before closing its log, which holds its collectives "
                         "up to its last step boundary)")
    return c


def _victims(died, desync, missing) -> list[dict]:
    """The ranks that died while waiting for a peer that never came: in a collective some rank
    never arrived at, or on the majority side of a desynchronized one (the backend aborts a
    rank whose peers disagree, or time out). Empty when a rank that died is itself one of those
    that never arrived or issued the odd collective: its death is then the cause."""
    if not died:
        return []
    dead = {d["rank"] for d in died}
    absent = {r for m in missing for r in m["missing_ranks"] + m.get("unknown_ranks", [])}
    waiting = {r for m in missing for r in m["waiting_ranks"]}
    for d in desync:
        variants = sorted(d["variants"], key=lambda x: len(x["ranks"]))
        if d.get("deviating"):
            absent |= set(d["deviating"])
            waiting |= {r for v in variants for r in v["ranks"]} - set(d["deviating"])
        elif len(variants) > 1 and len(variants[0]["ranks"]) < len(variants[-1]["ranks"]):
            absent |= set(variants[0]["ranks"])
            waiting |= {r for v in variants[1:] for r in v["ranks"]}
    if not absent or absent & dead or died[0]["rank"] not in waiting:
        return []
    return [d for d in died if d["rank"] in waiting]


def _culprit_alive(views, desync, missing, stacks, hung) -> dict | None:
    def describe(ranks, reason, how):
        v = views[ranks[0]]
        return {"ranks": ranks, "reason": reason, "how": how,
                "frame": fmt_frame(v.user_frame or v.frame), "innermost_frame": fmt_frame(v.frame),
                "code": (v.user_frame or v.frame or {}).get("code"), "step": v.step}

    if desync:
        d = desync[0]
        variants = sorted(d["variants"], key=lambda x: len(x["ranks"]))
        if d.get("deviating"):
            calls = d["calls"]
            odd = d["deviating"]
            rest = sorted(int(r) for r in calls if int(r) not in odd)
            side = {r: variant_text(d, v) for v in d["variants"] for r in v["ranks"]}
            return describe(odd, "desync",
                            f"issued {side[odd[0]]} as collective #{d['seq']} of group "
                            f"{d['pg']}, out of its per-step order, while "
                            f"{_rank_s(rest)} issued {side[rest[0]]} there")
        if len(variants[0]["ranks"]) < len(variants[-1]["ranks"]):
            minority = variants[0]
            others = ", ".join(f"{x['op']} on ranks {_ranks(x['ranks'])}" for x in variants[1:])
            return describe(minority["ranks"], "desync",
                            f"issued {minority['op']} as collective #{d['seq']} of group {d['pg']} "
                            f"while the others issued {others}")
    if missing:
        behind = sorted({r for m in missing for r in m["missing_ranks"]})
        sure = [r for r in behind if not views[r].torn] or behind
        free = [r for r in sure if not views[r].blocked and views[r].present]
        chosen = free or sure
        m = next(m for m in missing if chosen[0] in m["missing_ranks"])
        op = f"{m['op']} " if m.get("op") else ""
        return describe(chosen, "never_arrived",
                        f"never reached collective {op}#{m['seq']} of group {m['pg']}")
    present = [r for r, v in views.items() if v.present]
    if hung and len(present) == 1:
        return describe(present, "only_rank", "stopped progressing (the only rank)")
    if hung and len(stacks) > 1:
        outside = [g for g in stacks if not g["in_collective"]]
        if len(outside) == 1 and len(outside[0]["ranks"]) < sum(len(g["ranks"]) for g in stacks):
            return describe(outside[0]["ranks"], "stack_outlier",
                            "is the only stack group outside a collective")
    if hung:
        lp = {r: v.last_progress_ns for r, v in views.items() if v.last_progress_ns}
        if len(lp) > 1:
            oldest = min(lp.values())
            rest = sorted(lp.values())[1]
            if rest - oldest > 2e9:
                r = min(lp, key=lp.get)
                return describe([r], "oldest_progress", f"stopped progressing "
                                f"{(rest - oldest) / 1e9:.1f} s before any other rank")
    return None


def finding(pm) -> Finding:
    c = pm["culprit"]
    ranks = c["ranks"] if c else [r["rank"] for r in pm["ranks"] if r["state"] != "exited"]
    if pm.get("stall"):
        ranks = pm["stall"]["ranks"]
    severity = "warning" if pm["recovered"] else ("critical" if pm["hung"] else "error")
    evidence = {k: pm[k]
                for k in ("culprit", "desync", "never_arrived", "detected_by", "stalled_s", "died")}
    if pm.get("stall"):
        evidence["stall"] = pm["stall"]
    evidence["failures"] = {str(r["rank"]): r["failure"] for r in pm["ranks"] if r.get("failure")}
    keys = ("ranks", "majority", "frame", "user_frame", "code", "in_collective")
    evidence["stack_groups"] = [{k: g[k] for k in keys} for g in pm["stack_groups"]]
    evidence["waiting_in"] = {str(r["rank"]): r["waiting_in"] for r in pm["ranks"]
                              if r["waiting_in"]}
    return Finding(kind=pm.get("kind") or kind_of(pm), severity=severity, ranks=ranks, message=pm["message"],
                   evidence=evidence, fix=(c or {}).get("fix") or "")
