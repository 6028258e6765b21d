"""What the hang post-mortem reads of each rank (heartbeats, hang dumps, flight-recorder
dumps, stacks: RankView) and of the job's collectives and stacks (analyzers/hang.py)."""

from __future__ import annotations

import json
import os

from trainprof import safeio
from trainprof._lazy import pd
from trainprof.analyzers import _fatal_stacks as fatal
from trainprof.analyzers import _flight_recorder as fr
from trainprof.rankranges import rank_list
from trainprof.rundir.files import HANG_DUMP, RunDirError, rank_dir, read_json
from trainprof.wording import ranks_phrase

HEARTBEAT, HEARTBEAT_PREV = "heartbeat", "heartbeat.prev"


DUMP = HANG_DUMP  # written by probes/hang_watchdog.py


MIN_LEAD_S = 2.0   # a heartbeat must stop this long before the others' to single its rank out


PROGRESS_EVENTS = (None, "start", "progress")  # heartbeat events that mean progress


FAILURE_KINDS = ("exception", "exit")          # how a rank recorded that its process failed


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
        if self.inflight:  # the one its fatal stacks place it in, else the oldest
            c = next((c for c in self.inflight if c.get("inferred")), None) \
                or min(self.inflight, key=lambda c: c.get("enqueue_ns") or 0)
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


def _ranks(rs) -> str:
    return rank_list(sorted(rs))


def _rank_s(rs) -> str:
    return ranks_phrase(sorted(rs))
