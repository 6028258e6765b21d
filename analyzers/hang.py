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
desynchronization (different op or size at one sequence number of a group) is reported even if
the job crashed instead of hanging. A rank whose process died first (a signal or a non-zero exit
the launcher saw before it stopped the others; or, without that record, a heartbeat that stopped
while the other ranks went on) is named with its step, last collective and signal, and with the
exception it recorded (heartbeat ``failure`` records, probes/heartbeat_exit.py); a rank that died
waiting in a collective another, live rank never arrived at is its victim, not the culprit. The
finding's kind is ``hang``, ``desync`` or ``rank_failure`` (kind_of): a crash is never a hang.
Clean runs (every heartbeat closed) are silent.

Two collective sources are analyzed side by side and never mixed, as their sequence numbers
differ: "probe" (collectives probe: 0-based seq per group) and "flight_recorder" (torch's
collective_seq_id, 1-based, from dumps or the heartbeats' fr counters).
"""

from __future__ import annotations

import json
import os

from trainprof import safeio
from trainprof._lazy import pd
from trainprof.analyzers import _fatal_stacks as fatal
from trainprof.analyzers import _flight_recorder as fr
from trainprof.analyzers import _hang_ledger as led
from trainprof.findings import AnalyzerResult, Finding
from trainprof.rankranges import rank_list
from trainprof.rundir import worker_exits
from trainprof.rundir.files import HANG_DUMP, RunDirError, rank_dir, read_json
from trainprof.wording import ranks_phrase

NAME = "hang"
DUMP = HANG_DUMP  # written by probes/hang_watchdog.py
HEARTBEAT, HEARTBEAT_PREV = "heartbeat", "heartbeat.prev"
MIN_STALL_S = 5.0
MIN_LEAD_S = 2.0   # a heartbeat must stop this long before the others' to single its rank out
PROGRESS_EVENTS = (None, "start", "progress")  # heartbeat events that mean progress
FAILURE_KINDS = ("exception", "exit")          # how a rank recorded that its process failed
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


def _rank_path(run, r):
    """A rank's folder, in whichever of the analyzed run directories holds it."""
    return run.rank_path(r) if hasattr(run, "rank_path") else rank_dir(run.path, r)


def _completed_by(c: dict, logged: dict) -> bool:
    """Whether the logged (ended) collective shows ``c`` completed: same group, ``c`` no later
    in its sequence (a group's collectives complete in order)."""
    seq, last = c.get("seq"), logged.get("seq")
    return (logged.get("end_ns") is not None and isinstance(seq, int) and isinstance(last, int)
            and str(c.get("pg")) == str(logged.get("pg")) and seq <= last)


def _read_dump(run, r):
    p = _rank_path(run, r) / DUMP
    if not os.path.exists(p):  # (False also when its folder cannot be read: RunDir says so)
        return None
    try:
        d = run.hang_dump(p) if hasattr(run, "hang_dump") else read_json(p)  # fields type-checked
    except RunDirError as e:
        run.problems.append(f"{e} (hang dump ignored)")
        return None
    if not isinstance(d, dict):
        run.problems.append(f"{p}: expected a JSON object, hang dump ignored")
        return None
    if not d.get("complete"):
        run.problems.append(f"{p}: dump incomplete (rank died while dumping?); stacks used")
    return d


def _read_fr(run, r):
    for name in fr.FILES:
        p = _rank_path(run, r) / name
        if os.path.exists(p):
            try:
                return fr.load(p)
            except fr.FlightRecorderError as e:
                run.problems.append(str(e))
    return None


def _main_stack(dump) -> list[dict] | None:
    if not dump:
        return None
    threads = [t for t in dump.get("threads") or [] if isinstance(t, dict)]
    main = [t for t in threads if t.get("main")] or [t for t in threads if not t.get("trainprof")]
    return main[0].get("frames") or [] if main else None


def _is_lib(f: dict) -> bool:
    if "lib" in f:
        return bool(f["lib"])
    path = str(f.get("file") or "")  # dumps from older probes: guess from the path
    return ("/torch/" in path or "/probes/" in path or path.startswith("<frozen")
            or ("/lib/python3" in path and "-packages/" not in path))


def fmt_frame(f: dict | None) -> str | None:
    if not f:
        return None
    path = str(f.get("file") or "?")
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{f.get('line')} in {f.get('function')}"


def _torn_tail(path) -> bool:
    try:
        with open(safeio.open_regular(path)[0], "rb") as f:  # never blocks on a FIFO
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except OSError:
        return False


def _failure(heartbeats) -> dict | None:
    """How the rank's process failed, as it recorded it (probes/heartbeat_exit.py): the last
    heartbeat's ``failure`` {kind, exc_type, exc, exit_code, t_ns}, unless the rank stepped on
    after it (a sys.exit the job caught)."""
    for i in range(len(heartbeats) - 1, -1, -1):
        h = heartbeats[i]
        f = h.get("failure")
        if not isinstance(f, dict) or f.get("kind") not in FAILURE_KINDS:
            continue
        step = h.get("step") if isinstance(h.get("step"), int) else -1
        if any(isinstance(x.get("step"), int) and x["step"] > step for x in heartbeats[i + 1:]):
            return None
        out = {"kind": f["kind"]}
        for k, typ in (("exc_type", str), ("exc", str), ("exit_code", int), ("t_ns", int)):
            if isinstance(f.get(k), typ) and not isinstance(f.get(k), bool):
                out[k] = f[k]
        if "t_ns" not in out and isinstance(h.get("t_ns"), int):
            out["t_ns"] = h["t_ns"]
        return out
    return None


def describe_failure(f: dict | None) -> str | None:
    """'raised RuntimeError: boom' / 'called sys.exit(7)' from a rank's failure record."""
    if not f:
        return None
    if f["kind"] == "exception":
        text = f": {f['exc']}" if f.get("exc") else ""
        return f"raised {f.get('exc_type') or 'an exception'}{text}"
    msg = f" ({f['exc']})" if f.get("exc") else ""
    return f"called sys.exit with exit code {f.get('exit_code')}{msg}"


def _blocked_in_c10d(stack) -> bool:
    return any("torch/distributed" in str(f.get("file") or "") for f in stack or [])


class RankView:
    def __init__(self, run, r):
        self.rank = r
        # read for this post-mortem only (not kept in the run's cache)
        self.heartbeats = run.stream_once(r, HEARTBEAT) or run.stream_once(r, HEARTBEAT_PREV)
        self.torn = _torn_tail(run.stream_path(r, HEARTBEAT))
        if self.torn:  # its newest state was lost: never accuse it on stale data alone
            run.problems.append(f"{run.stream_path(r, HEARTBEAT)}: last line torn (process killed "
                                f"mid-write); rank {r}'s latest state is unknown")
        self.last_hb = self.heartbeats[-1] if self.heartbeats else None
        self.closed = bool(self.last_hb and self.last_hb.get("event") == "close")
        self.dump = _read_dump(run, r)
        self.fr = _read_fr(run, r)
        last_step = run.stream_tail(r, "steps")  # the steps are read as one table too
        self.steps = [last_step] if last_step else []
        last = run.stream_tail(r, "collectives")  # the log itself is read as one table
        self.collectives = [last] if last else []
        self.present = bool(self.heartbeats or self.dump or self.fr or self.steps
                            or run.rank_meta(r))
        self.failure = _failure(self.heartbeats)
        progress = [h.get("t_ns") for h in self.heartbeats if h.get("event") in PROGRESS_EVENTS]
        progress += [s.get("end_ns") for s in self.steps[-1:]]
        progress += [c.get("end_ns") for c in self.collectives[-1:]]
        self.last_progress_ns = max((int(t) for t in progress if t), default=None)
        src = self.dump if self.dump else (self.last_hb or {})
        steps = [src.get("step")] + [s["step"] + 1 for s in self.steps[-1:] if "step" in s]
        self.step = max((s for s in steps if isinstance(s, int)), default=None)
        self.last_collective = src.get("last_collective")
        self.inflight = [c for c in src.get("inflight") or [] if isinstance(c, dict)]
        if not self.dump and self.collectives:
            # a heartbeat's in-flight list is as old as the beat: a collective the log shows
            # completed after it (a later one of its group ended) was no longer in flight
            self.inflight = [c for c in self.inflight if not _completed_by(c, self.collectives[-1])]
        self.stack = _main_stack(self.dump)
        self.frame = self.stack[-1] if self.stack else None
        user = [f for f in self.stack or [] if not _is_lib(f)]
        self.user_frame = user[-1] if user else None
        self.fr_inflight = fr.inflight(self.fr) if self.fr else []
        # faulthandler's stacks of a fatal signal (probes/fatal_dump.py); used by _infer_fatal
        self.fatal = fatal.parse(run.fatal_stacks(r)) if hasattr(run, "fatal_stacks") else None
        self.fatal_call = None  # the collective call its main thread died in
        done = [s.get("step") for s in self.steps[-1:] if isinstance(s.get("step"), int)]
        self.last_step_done = done[0] if done else None

    def latest_collective(self) -> dict | None:
        """The newest collective this rank is known to have issued: the last record of its
        collectives log, or of its heartbeat / dump when newer (the log is flushed at
        intervals, so a killed rank's last ones may be only in the heartbeat)."""
        cands = [c for c in ([self.last_collective] + self.collectives[-1:] + self.inflight)
                 if isinstance(c, dict) and c.get("op")]
        if not cands:
            return None
        c = max(cands, key=lambda c: (c.get("enqueue_ns") or 0, c.get("seq") or 0))
        return {k: c.get(k) for k in ("pg", "seq", "op", "bytes", "step", "enqueue_ns", "end_ns")}

    @property
    def blocked(self) -> bool:
        """Waiting in a collective: its main thread sits in torch.distributed (when dumped),
        or it has in-flight collectives (heartbeat / flight recorder only)."""
        if self.fatal_call is not None:
            return True
        if self.stack is not None:
            return _blocked_in_c10d(self.stack)
        counters = ((self.last_hb or {}).get("fr") or {}).values()
        return bool(self.inflight or self.fr_inflight
                    or any(e is not None and e > (d or 0) for e, d in counters))

    def waiting_in(self) -> dict | None:
        if self.inflight:
            c = min(self.inflight, key=lambda c: c.get("enqueue_ns") or 0)
            w = {"source": "probe", **{k: c.get(k) for k in ("pg", "seq", "op", "bytes",
                                                             "dtype", "enqueue_ns", "step")}}
            if c.get("inferred"):  # from its fatal-signal stacks: where the job called it
                w.update(inferred=c["inferred"], call_site=c.get("call_site"))
            return w
        if self.fr_inflight:
            e = self.fr_inflight[0]
            return {"source": "flight_recorder", "pg": e["pg"], "seq": e["seq"], "op": e["op"],
                    "input_sizes": e["input_sizes"], "enqueue_ns": e["time_created_ns"]}
        return None


# --------------------------------------------------------------------------- collectives


def _longest_step_s(run) -> float:
    """The longest step of any rank, in s (step 0, which includes set-up, left out)."""
    st = run.steps()
    if st.empty or "step" not in st or "dur_ms" not in st:
        return 0.0
    d = pd.to_numeric(st.loc[pd.to_numeric(st["step"], errors="coerce") >= 1, "dur_ms"],
                      errors="coerce")
    return float(d.max()) / 1e3 if d.notna().any() and d.max() > 0 else 0.0


def _members(run) -> dict:
    """{pg: member ranks} from every rank's groups.jsonl."""
    members: dict = {}
    for r in run.ranks:
        for g in run.stream(r, "groups"):
            if g.get("pg") is not None and isinstance(g.get("ranks"), list):
                members.setdefault(str(g["pg"]), set()).update(g["ranks"])  # ints (checked)
    return members


def _desync_fr(cmp) -> list[dict]:
    return [{"source": "flight_recorder", "pg": m["pg"], "seq": m["seq"],
             "variants": [{"op": s["op"], "input_sizes": s["input_sizes"], "ranks": s["ranks"]}
                          for s in m["by_signature"].values()]}
            for m in cmp.get("mismatches", [])]


def _missing_fr_heartbeats(views) -> list[dict]:
    """Without dumps: the heartbeats' flight-recorder counters {pg: [enqueued, completed]}. A
    rank whose log shows progress after its last beat (a beat is periodic: a rank killed between
    two beats leaves an old one) has counters that say too little: it is left out."""
    groups: dict = {}
    for v in views.values():
        hb = v.last_hb or {}
        logged = [x.get("end_ns") for x in v.steps[-1:] + v.collectives[-1:]]
        logged = [t for t in logged if isinstance(t, int)]
        if logged and isinstance(hb.get("t_ns"), int) and hb["t_ns"] < max(logged):
            continue
        for pg, (enq, done) in (hb.get("fr") or {}).items():
            groups.setdefault(pg, {})[v.rank] = (enq, done)
    out = []
    for pg, by_rank in sorted(groups.items()):
        enq = {r: e for r, (e, _) in by_rank.items() if e is not None}
        if not enq:
            continue
        top = max(enq.values())
        waiting = sorted(r for r, (e, d) in by_rank.items() if e == top and (d or 0) < top)
        behind = sorted(r for r, e in enq.items() if e < top)
        if waiting and behind:
            out.append({"source": "flight_recorder", "pg": pg, "seq": top, "op": None,
                        "waiting_ranks": waiting, "missing_ranks": behind,
                        "missing_last_seq": {str(r): enq[r] for r in behind}})
    return out


# --------------------------------------------------------------------------- stacks


def _stack_groups(views) -> list[dict]:
    groups: dict = {}
    for v in views.values():
        if v.stack is None:
            continue
        key = json.dumps([(f.get("file"), f.get("line"), f.get("function")) for f in v.stack])
        groups.setdefault(key, []).append(v)
    out = []
    for i, vs in enumerate(sorted(groups.values(), key=lambda vs: (-len(vs), vs[0].rank))):
        v = vs[0]
        out.append({"id": i, "ranks": sorted(x.rank for x in vs),
                    "majority": i == 0 and len(groups) > 1,
                    "frame": fmt_frame(v.frame), "user_frame": fmt_frame(v.user_frame),
                    "code": (v.user_frame or v.frame or {}).get("code"),
                    "in_collective": _blocked_in_c10d(v.stack),
                    "frames": [{k: f.get(k) for k in ("file", "line", "function", "code")}
                               for f in reversed(v.stack[-12:])]})  # innermost first
    if len(out) == 1:
        out[0]["majority"] = True
    return out


# --------------------------------------------------------------------------- detection


def _detect(run, views, exits=None) -> dict:
    man = run.launcher
    reasons = []
    if man.get("status") == "hung":
        reasons.append("the hang watchdog terminated the job (manifest status 'hung')")
    elif man.get("hangs"):
        reasons.append(f"the hang watchdog fired {len(man['hangs'])} time(s)")
    dumped = sorted(v.rank for v in views.values() if v.dump)
    if dumped and not man.get("hangs"):
        reasons.append(f"hang dumps present on {len(dumped)} rank(s)")
    gaps = []
    for v in views.values():
        ts = [h["t_ns"] for h in v.heartbeats[1:] if h.get("event") in PROGRESS_EVENTS
              and h.get("t_ns")]
        gaps += [(b - a) / 1e9 for a, b in zip(ts, ts[1:])]
    gaps.sort()
    p90_gap = gaps[int(0.9 * (len(gaps) - 1))] if gaps else 0.0
    longest_step = _longest_step_s(run)
    threshold = max(MIN_STALL_S, 3 * p90_gap, 2 * longest_step)
    end_ns = (man.get("end_time") or {}).get("ns")
    closes = [w["t_close_ns"] for w in (exits or {}).get("first_failures", [])
              if isinstance(w.get("t_close_ns"), int)]
    if closes:  # the torchrun agent stopped the workers then: the job's end, not its own exit
        end_ns = min([end_ns] + closes) if end_ns else min(closes)
    # A rank's own failure ends the job: the others' wait for the launcher to stop them after it
    # (and its own exit) is no stall. Its failure record dates it; without one, a rank the agent
    # saw fail first ended no later than it closed its heartbeat.
    failed_at = [v.failure["t_ns"] for v in views.values() if v.failure and v.failure.get("t_ns")]
    first_ranks = {w["rank"] for w in (exits or {}).get("first_failures", [])}
    failed_at += [v.last_hb["t_ns"] for r, v in views.items() if r in first_ranks and v.closed
                  and isinstance(v.last_hb.get("t_ns"), int)]
    if failed_at:
        end_ns = min([end_ns] + failed_at) if end_ns else min(failed_at)
    if end_ns is None:
        ended = [run.rank_meta(r).get("ended_ns") for r in views]
        end_ns = max((e for e in ended if e), default=None)
    last = max((v.last_progress_ns for v in views.values() if v.last_progress_ns), default=None)
    stalled = (end_ns - last) / 1e9 if end_ns and last else None
    live = [v for v in views.values() if v.heartbeats and not v.closed]
    quiet_end = None
    if stalled is not None and stalled > threshold and live and not reasons:
        quiet_end = _work_ended(man, views, live)
    if stalled is not None and stalled > threshold and live and not reasons and not quiet_end:
        reasons.append(f"no rank progressed during the last {stalled:.1f} s before the job ended "
                       f"(threshold {threshold:.1f} s) and {len(live)} rank(s) never closed")
    recovered = bool(reasons) and man.get("status") == "ok" and not live
    return {"reasons": reasons, "end_ns": end_ns, "last_progress_ns": last, "p90_gap_s": p90_gap,
            "stalled_s": None if stalled is None else round(stalled, 3),
            "threshold_s": round(threshold, 3), "recovered": recovered,
            **({"quiet_end": quiet_end} if quiet_end else {})}


def _work_ended(man: dict, views: dict, live: list) -> str | None:
    """Why a stall before the end is the job's own shutdown, not a hang (None when it may be
    one): the job exited 0, every rank reached the same step and none had a collective in
    flight. Ray Train ends its workers without letting them close their heartbeat and takes
    seconds to shut down after the work."""
    if man.get("status") != "ok" or man.get("exit_code") not in (0, None) or man.get("signal"):
        return None
    steps = {v.step for v in views.values() if v.heartbeats}
    if len(steps) != 1 or None in steps or any(v.blocked for v in live):
        return None
    return (f"the job exited 0 after every rank reached step {steps.pop()} with no collective in "
            f"flight; {len(live)} rank(s) ended without closing their heartbeat (their launcher "
            "ended them, e.g. Ray Train's workers)")


# --------------------------------------------------------------------------- process exits


def _worker_exits(run) -> dict:
    """worker_exits.summarize() of RUN/worker-exits.jsonl ({} workers when absent)."""
    return worker_exits.summarize(run.worker_exits())


def _died(run, views, exits, det) -> list[dict]:
    """The ranks whose process ended first: from the torchrun agent's record of how its
    workers ended; for a one-process job, from the launcher's own exit status; else a rank
    whose heartbeat stopped while every other rank went on (MIN_LEAD_S and 2x the usual gap
    between heartbeats ahead of them) in a job that failed."""
    man = run.launcher
    stopped_ns = _stopped_by_us_ns(man)
    first = [dict(w, source="torchrun agent (worker-exits.jsonl)")
             for w in exits["first_failures"] if w["rank"] in views
             and not (stopped_ns and (w.get("t_close_ns") or 0) >= stopped_ns)]
    if len(first) > 1 and len(first) == len(views) and len({w["signal"] for w in first}) == 1 \
            and first[0]["signal"]:
        first = []  # every rank killed by one signal at once: the job was stopped from outside
    if not first and not exits["workers"] and len(views) == 1 and not stopped_ns \
            and man.get("status") in ("failed", "killed"):
        (r,) = views
        code = man.get("signal")
        row = worker_exits.describe_exit(-code if isinstance(code, int) and code > 0
                                          else man.get("exit_code"))
        if row["exitcode"]:
            first = [dict(row, rank=r, pid=None, host=man.get("host"),
                          source="the launcher's exit status (manifest.json)")]
    recorded = sorted((v.failure.get("t_ns") or 0, r) for r, v in views.items() if v.failure)
    if not first and not exits["workers"] and recorded and man.get("status") != "ok" \
            and not stopped_ns:  # no agent record: the ranks' own records of their failure
        t0 = recorded[0][0]
        for t, r in recorded:
            if t - t0 <= MIN_LEAD_S * 1e9 or t == 0:  # the first failure and those beside it
                code = views[r].failure.get("exit_code")
                first.append(dict(worker_exits.describe_exit(code if code is not None else 1),
                                  rank=r, pid=None, host=None,
                                  source="the rank's own failure record (heartbeat.jsonl)"))
    if not first and not exits["workers"] and man.get("status") in ("failed", "killed") \
            and not det["reasons"] and not stopped_ns:
        lp = {r: v.last_progress_ns for r, v in views.items() if v.last_progress_ns and v.heartbeats}
        lead = max(MIN_LEAD_S, 2 * det.get("p90_gap_s", 0.0))
        if len(lp) > 1:
            r0 = min(lp, key=lp.get)
            rest = min(t for r, t in lp.items() if r != r0)
            if not views[r0].closed and (rest - lp[r0]) / 1e9 > lead:
                first = [dict(worker_exits.describe_exit(None), rank=r0, pid=None, host=None,
                              source=f"heartbeat: it stopped {(rest - lp[r0]) / 1e9:.1f} s before "
                                     f"any other rank's and never closed")]
    # a death by a signal is a cause; an error exit beside it is usually its consequence (a
    # collective failing on the dead peer): signals first, then the earliest last progress
    # (of error exits, the one its rank recorded first)
    first.sort(key=lambda w: (not w.get("signal"), (views[w["rank"]].failure or {}).get("t_ns")
                              or views[w["rank"]].last_progress_ns or 0))
    out = []
    for w in first:
        v = views[w["rank"]]
        out.append({**{k: w.get(k) for k in ("rank", "pid", "host", "exitcode", "signal",
                                               "signal_name", "source")},
                    "step": v.step, "last_step_done": v.last_step_done,
                    "last_collective": v.latest_collective(),
                    "last_progress_ns": v.last_progress_ns, "failure": v.failure,
                    "waiting_in": v.waiting_in() if v.blocked else None})
    return out


FATAL_SIGNALS = (4, 6, 7, 8, 11)  # SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV: what faulthandler dumps


def _infer_fatal(run, views, exits) -> None:
    """A rank killed by a fatal signal whose main thread died inside a torch.distributed
    collective call (its fatal-stacks.txt) waited in the collective after its last logged one
    in that group: made its in-flight entry (seq = last + 1, size unknown), with the job's call
    site, for the ledger to compare with its peers'."""
    for r, v in views.items():
        if not v.fatal or v.closed or v.inflight or v.dump:
            continue
        ex = exits["workers"].get(r)
        if ex is not None and ex.get("signal") not in FATAL_SIGNALS:
            continue  # it ended otherwise: the dump is a forked child's (a DataLoader worker)
        call = fatal.collective_call(v.fatal["main_thread"])
        if call is None:
            continue
        v.fatal_call = call
        v.frame, v.user_frame = call["frame"], call["call_site"]
        entry, why = fatal.infer_inflight(run.frame("collectives"), r, v.last_collective, v.step,
                                          call)
        site = fmt_frame(call["call_site"])
        if entry is None:
            run.problems.append(f"rank {r} died of a fatal signal inside {call['op'] or 'a wait'}"
                                f"{f' at {site}' if site else ''} (fatal-stacks.txt), but {why}")
            continue
        v.inflight = [dict(entry, call_site=site)]


def _fatal_desync(run, views, desync) -> list[dict]:
    """Desynchronizations that involve a collective inferred from fatal-signal stacks: dropped
    when the ops agree (its size is unknown: no evidence); kept otherwise, with the side that
    broke its own per-step order (``deviating``) when the sides are equally large."""
    inferred = {(str(c["pg"]), c["seq"], r): c for r, v in views.items() for c in v.inflight
                if c.get("inferred")}
    if not inferred:
        return desync
    log = run.frame("collectives")
    out = []
    for d in desync:
        ranks = [r for x in d["variants"] for r in x["ranks"]]
        if d["source"] != "probe" or not any((d["pg"], d["seq"], r) in inferred for r in ranks):
            out.append(d)
            continue
        entries = {}
        for x in d["variants"]:
            for r in x["ranks"]:
                c = inferred.get((d["pg"], d["seq"], r))
                if c is None:
                    e = {"op": x["op"], "api": None, "bytes": x.get("bytes"),
                         "step": (x.get("steps") or [None])[-1]}
                    if not log.empty and "api" in log:
                        row = log[(log["rank"] == r) & (log["pg"].astype(str) == d["pg"])
                                  & (log["seq"] == d["seq"])]
                        if len(row):
                            e["api"] = row["api"].iloc[-1] if pd.notna(row["api"].iloc[-1]) else None
                            if pd.notna(row["step"].iloc[-1]):
                                e["step"] = int(row["step"].iloc[-1])
                    c = e
                entries[r] = c
        keys = {r: fatal._key(e.get("api"), e.get("op")) for r, e in entries.items()}
        if len(set(keys.values())) < 2:
            continue
        d = dict(d, calls={str(r): f"{entries[r].get('op') or '?'} ({k})" if k else
                           str(entries[r].get("op")) for r, k in keys.items()})
        variants = sorted(d["variants"], key=lambda x: len(x["ranks"]))
        if len(variants[0]["ranks"]) == len(variants[-1]["ranks"]):
            odd = fatal.deviating(log, entries, d["pg"], d["seq"])
            if odd:
                d["deviating"] = odd
        out.append(d)
    return out


def _stopped_by_us_ns(man: dict) -> int | None:
    """When `trainprof wrap` itself stopped the job (a signal it passed on, e.g. Ctrl-C, or the
    hang watchdog's kill): worker exits from then on are that stop, not failures."""
    times = [x.get("t_ns") for x in man.get("signals_forwarded") or [] if isinstance(x, dict)]
    times += [h.get("killed_ns") for h in man.get("hangs") or [] if isinstance(h, dict)]
    times = [t for t in times if isinstance(t, int)]
    return min(times) if times else None


def _fmt_collective(c: dict | None) -> str | None:
    if not c:
        return None
    step = f" in step {c['step']}" if c.get("step") is not None else ""
    return f"{c.get('op')} #{c.get('seq')} of group {c.get('pg')}{step}"


# --------------------------------------------------------------------------- ranks that left


JOIN_HINT = ("uneven inputs (ranks given different numbers of batches)? If so, torch's Join "
             "context manager (DDP: `with model.join():`) lets a rank that ran out of inputs "
             "shadow its peers' collectives until they finish")
EXIT_SLACK_NS = int(MIN_LEAD_S * 1e9)  # clocks of one host agree; of several, about this well


def _add_step_spans(run, rows: list[dict]) -> list[dict]:
    """``rows`` (of _clean_exits), each with {steps, first, last}: the steps its rank recorded
    (steps.jsonl), when it recorded any."""
    st = run.steps()
    if st.empty or "step" not in st or "rank" not in st:
        return rows
    want = st["rank"].isin([x["rank"] for x in rows])
    g = pd.to_numeric(st.loc[want, "step"], errors="coerce").groupby(st.loc[want, "rank"])
    span = g.agg(["nunique", "min", "max"]).dropna()
    for x in rows:
        if x["rank"] in span.index and span.loc[x["rank"], "nunique"] > 0:
            n, a, b = span.loc[x["rank"], ["nunique", "min", "max"]]
            x.update(steps=int(n), first=int(a), last=int(b))
    return rows


def _clean_exits(run, views, exits) -> dict:
    """The ranks whose process ended normally, {rank: {rank, exitcode, exit_ns, last_step_done,
    steps, first, last, source}}: exit code 0 in the torchrun agent's record, or (without one) a
    heartbeat closed without a failure record. ``exit_ns``: its heartbeat's close, else its
    meta.json ``ended_ns`` (None when neither)."""
    out = {}
    for r, v in views.items():
        if v.failure:
            continue
        ex = exits["workers"].get(r)
        if ex is not None:
            if ex.get("exitcode") != 0 or ex.get("signal") or ex.get("ended_by_launcher"):
                continue
            source = "torchrun agent (worker-exits.jsonl): exit code 0"
        elif v.closed:
            source = "heartbeat closed without a failure record"
        else:
            continue
        t = v.last_hb.get("t_ns") if v.closed else None
        if not isinstance(t, int) or isinstance(t, bool):
            t = run.rank_meta(r).get("ended_ns")
        out[r] = {"rank": r, "exitcode": 0 if ex is not None else None,
                  "exit_ns": t if isinstance(t, int) and not isinstance(t, bool) else None,
                  "last_step_done": v.last_step_done, "source": source}
    return out


def _failed_in(d: dict) -> dict | None:
    """The collective a failed rank was in when it failed: the one it waited in, else its
    latest (its log closes a collective that failed, with the time of the error)."""
    c = d.get("waiting_in") or d.get("last_collective")
    if not isinstance(c, dict) or c.get("pg") is None or not isinstance(c.get("seq"), int):
        return None
    return c


def _early_exit(run, views, died, clean, ledger, members) -> dict | None:
    """Ranks that ended normally (exit code 0) while their peers still ran collectives, when
    the first failure is a peer failing in a collective they never issued: the failure is the
    consequence of their leaving. None otherwise (a rank that failed first on its own, or
    whose collective the ranks that left had issued, stays the culprit)."""
    if not died or not clean:
        return None
    victims, gone = [], set()
    for d in died:
        c = _failed_in(d)
        if c is None:
            continue
        pg, seq = str(c["pg"]), c["seq"]
        t_fail = (d.get("failure") or {}).get("t_ns") or d.get("last_progress_ns")
        last = ledger.max_seq(pg)
        group = members.get(pg) or set(last)
        left = [r for r in sorted(clean) if r in group and last.get(r, -1) < seq
                and not (clean[r]["exit_ns"] and t_fail
                         and clean[r]["exit_ns"] > t_fail + EXIT_SLACK_NS)]
        if left:
            victims.append((d, c, left))
            gone |= set(left)
    if not victims or victims[0][0] is not died[0]:
        return None  # the first failure is not explained by a rank that left
    gone = sorted(gone)
    _add_step_spans(run, [clean[r] for r in gone])
    stayed = sorted({d["rank"] for d, _, _ in victims} | {r for r in views if r not in clean})
    out_v = []
    for d, c, left in victims:
        f = d.get("failure")
        what = worker_exits.how(d) if d.get("exitcode") is not None else "died"
        raised = describe_failure(_first_line(f))
        if raised:
            what = f"{raised} ({what})"
        step = f" in step {c['step']}" if c.get("step") is not None else ""
        out_v.append({"rank": d["rank"], "collective": {k: c.get(k) for k in
                                                        ("pg", "seq", "op", "step")},
                      "how": f"failed in {c.get('op') or 'a collective'} #{c['seq']} of group "
                             f"{c['pg']}{step}, which {_rank_s(left)} never issued: {what}"})
    also = [d["rank"] for d in died if d["rank"] not in {v["rank"] for v in out_v}]
    return {"ranks": gone, "exits": [clean[r] for r in gone], "victims": out_v,
            "also_failed": also, "how": _left_text(gone, clean, stayed, views),
            "suggestion": JOIN_HINT}


def _note_left(run, c: dict, clean: dict, views) -> None:
    """A never_arrived culprit whose process had ended normally: said, with how it ended."""
    gone = [r for r in c["ranks"] if r in clean]
    if not gone:
        return
    _add_step_spans(run, [clean[r] for r in gone])
    c["how"] += "; it had " + _left_text(gone, clean, [r for r in views if r not in clean], views)
    c["early_exit"] = [clean[r] for r in gone]
    c["suggestion"] = JOIN_HINT


def _first_line(f: dict | None) -> dict | None:
    """A failure record with its exception text cut to its first line (gloo's add a trace)."""
    if not f or not isinstance(f.get("exc"), str):
        return f
    line = next((x for x in f["exc"].splitlines() if x.strip()), "")
    if len(line) > 240:  # at the end of a sentence when one ends in reach, else cut
        end = line.rfind(". ", 60, 240)
        line = line[:end + 1] + " …" if end > 0 else line[:239] + "…"
    return dict(f, exc=line)


def _left_text(gone, clean, stayed, views=None) -> str:
    """'exited normally (exit code 0) after step 29 while rank 1 was still training (rank 0
    ran 30 steps, 0-29; rank 1 went on to step 30)'."""
    rows = [clean[r] for r in gone]
    code = " (exit code 0)" if all(x["exitcode"] == 0 for x in rows) else ""
    lasts = sorted({x["last_step_done"] for x in rows if x["last_step_done"] is not None})
    after = (f" after step {lasts[0]}" if len(lasts) == 1 else
             f" after steps {lasts[0]}-{lasts[-1]}" if lasts else "")
    text = f"exited normally{code}{after}"
    if stayed:
        text += f" while {_rank_s(stayed)} {'was' if len(stayed) == 1 else 'were'} still training"
    ran = sorted({(x.get("steps"), x.get("first"), x.get("last")) for x in rows if x.get("steps")})
    bits = []
    if len(ran) == 1:
        n, a, b = ran[0]
        bits.append(f"{_rank_s(gone)} ran {n} step{'s' * (n != 1)}, {a}-{b}" if a != b else
                    f"{_rank_s(gone)} ran {n} step{'s' * (n != 1)}")
    on = sorted({views[r].step for r in stayed if views and views[r].step is not None})
    if on and lasts and on[-1] > lasts[-1]:
        bits.append(f"{_rank_s(stayed)} went on to step {on[-1]}" if len(on) == 1 else
                    f"{_rank_s(stayed)} went on to steps {on[0]}-{on[-1]}")
    return text + (f" ({'; '.join(bits)})" if bits else "")


# --------------------------------------------------------------------------- assembly


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
    det = _detect(run, views, exits)
    died = _died(run, views, exits, det)
    ledger, members = led.Ledger(run, views), _members(run)
    fr_dumps = {r: v.fr for r, v in views.items() if v.fr}
    cmp = fr.compare(fr_dumps) if fr_dumps else {}
    desync = _fatal_desync(run, views, led.desync(ledger, P2P_OPS, SIZE_STRICT_OPS)) \
        + _desync_fr(cmp)
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
            "stalled_s": round((det["end_ns"] - v.last_progress_ns) / 1e9, 3)
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
        | {"exit_not_recorded": unrecorded["text"] if unrecorded else None},
        "last_progress_ns": det["last_progress_ns"], "stalled_s": det["stalled_s"],
        "stall_threshold_s": det["threshold_s"], "quiet_end": det.get("quiet_end"),
        "ranks_with_heartbeat": sum(1 for v in views.values() if v.heartbeats),
        "ranks_without_data": [r for r, v in views.items() if not v.present],
        "flight_recorder": {"ranks": sorted(fr_dumps), "groups": cmp.get("groups", {}),
                            "inflight": cmp.get("inflight", {})} if fr_dumps else None,
    }
    pm["kind"] = kind_of(pm)
    if pm["recovered"]:  # which rank stalled, where, for how long (analyzers/_stall.py)
        from trainprof.analyzers import _stall

        pm["stall"] = _stall.describe(run, views)
    pm["message"] = pm["stall"]["text"] if pm.get("stall") else _message(pm)
    return pm


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


def _culprit(views, desync, missing, stacks, hung, died=(), early=None) -> dict | None:
    def describe(ranks, reason, how):
        v = views[ranks[0]]
        return {"ranks": ranks, "reason": reason, "how": how,
                "frame": fmt_frame(v.user_frame or v.frame), "innermost_frame": fmt_frame(v.frame),
                "code": (v.user_frame or v.frame or {}).get("code"), "step": v.step}

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


def _victim_how(d: dict) -> str:
    what = worker_exits.how(d) if d.get("exitcode") is not None else "died"
    raised = describe_failure(d.get("failure"))
    if raised:
        what = f"{raised} ({what})"
    w = d.get("waiting_in")
    where = (f" while it waited in {w.get('op') or 'collective'} #{w.get('seq')} of group "
             f"{w.get('pg')}" if w else " while it waited for its peer")
    if w and w.get("call_site"):
        where += f", called at {w['call_site']}"
    return what + where


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
            return describe(odd, "desync",
                            f"issued {calls[str(odd[0])]} as collective #{d['seq']} of group "
                            f"{d['pg']}, out of its per-step order, while "
                            f"{_rank_s(rest)} issued {calls[str(rest[0])]} there")
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


def _ranks(rs) -> str:
    return rank_list(sorted(rs))


def _rank_s(rs) -> str:
    return ranks_phrase(sorted(rs))


def _message(pm) -> str:
    parts = []
    c = pm["culprit"]
    head = {"hang": "Hang", "desync": "Collective desynchronization",
            "rank_failure": "Rank failure"}[pm.get("kind") or kind_of(pm)]
    if pm["recovered"]:
        head = "Stall (the job recovered)"
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
        d = pm["desync"][0]
        vs = "; ".join(f"{v['op']} on ranks {_ranks(v['ranks'])}" for v in d["variants"])
        parts.append(f"desynchronized at collective #{d['seq']} of group {d['pg']}: {vs}")
    by_wait: dict = {}  # (op, pg, seq) -> rows of the ranks blocked in it
    for row in pm["ranks"]:
        w = row["waiting_in"]
        if w and row["state"] == "in_collective":
            by_wait.setdefault((w.get("op"), w.get("pg"), w.get("seq")), []).append(row)
    if by_wait:
        (op, pg, seq), rows = max(by_wait.items(), key=lambda kv: len(kv[1]))
        frame = next((row["user_frame"] for row in rows if row["user_frame"]), None)
        parts.append(f"ranks {_ranks([row['rank'] for row in rows])} wait in {op} #{seq} of "
                     f"group {pg}" + (f" at {frame}" if frame else ""))
    if pm["ranks_without_data"]:
        parts.append(f"no data from ranks {_ranks(pm['ranks_without_data'])}")
    return "; ".join(parts)


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
                   evidence=evidence)
