"""How the ranks of a stopped job ended, for the hang post-mortem (analyzers/hang.py): process
exits and fatal signals, ranks that left the job early (uneven inputs) and desyncs of dying ranks."""

from __future__ import annotations

from trainprof._lazy import pd
from trainprof.analyzers import _fatal_stacks as fatal
from trainprof.analyzers._hang_views import MIN_LEAD_S, _rank_s, describe_failure, fmt_frame
from trainprof.rundir import worker_exits


def ended_normally(run, r, workers: dict) -> bool:
    """Rank ``r`` ended as a clean process: exit code 0 in worker-exits.jsonl (``workers``: its
    summary by rank), else a heartbeat closed without a failure record, else a job whose
    launcher status is ``ok``."""
    ex = workers.get(r)
    if ex is not None:
        return ex.get("exitcode") == 0 and not ex.get("signal") and not ex.get("ended_by_launcher")
    hb = run.stream_tail(r, "heartbeat")
    if hb is not None:
        return hb.get("event") == "close" and not isinstance(hb.get("failure"), dict)
    return run.launcher.get("status") == "ok"


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
    collective call (its fatal-stacks.txt) is placed in the collective it died in, with the
    job's call site: its heartbeat's in-flight one when the beat saw it waiting in that op
    (op, sequence number and size as recorded), else the one after the last it is known to
    have issued in that group (seq = last + 1, size unknown). The ledger compares it with its
    peers'."""
    for r, v in views.items():
        if not v.fatal or v.closed or v.dump:
            continue
        ex = exits["workers"].get(r)
        if ex is not None and ex.get("signal") not in FATAL_SIGNALS:
            continue  # it ended otherwise: the dump is a forked child's (a DataLoader worker)
        call = fatal.collective_call(v.fatal["main_thread"])
        if call is None:
            continue
        v.fatal_call = call
        v.frame, v.user_frame = call["frame"], call["call_site"]
        site = fmt_frame(call["call_site"])
        beat = fatal.confirmed_inflight(v.inflight, call)
        if beat is not None:
            v.inflight = [dict(beat, inferred="fatal-stacks", call_site=site)] \
                + [c for c in v.inflight if c is not beat]
            continue
        entry, why = fatal.infer_inflight(run.frame("collectives"), r,
                                          [v.last_collective] + v.inflight, v.step, call)
        if entry is None:
            run.problems.append(f"rank {r} died of a fatal signal inside {call['op'] or 'a wait'}"
                                f"{f' at {site}' if site else ''} (fatal-stacks.txt), but {why}")
            continue
        v.inflight = [dict(entry, call_site=site)]


def _fatal_desync(run, views, desync) -> list[dict]:
    """The collectives probe's desynchronizations, checked against each side's own records.
    One that involves a collective placed by fatal-signal stacks (_infer_fatal) whose size is
    unknown is dropped when the ops agree (no evidence). Where the calls differ (op or API),
    ``calls`` names each rank's, and between two equally large sides the side that broke its
    own per-step order is ``deviating``."""
    inferred = {(str(c["pg"]), c["seq"], r): c for r, v in views.items() for c in v.inflight
                if c.get("inferred")}
    log = run.frame("collectives")
    out = []
    for d in desync:
        ranks = [r for x in d["variants"] for r in x["ranks"]]
        variants = sorted(d["variants"], key=lambda x: len(x["ranks"]))
        even = len(variants[0]["ranks"]) == len(variants[-1]["ranks"])
        involved = [r for r in ranks if (d["pg"], d["seq"], r) in inferred]
        if d["source"] != "probe" or not (involved or even):
            out.append(d)
            continue
        entries = {r: inferred.get((d["pg"], d["seq"], r)) or _entry_at(log, views[r], d, x)
                   for x in d["variants"] for r in x["ranks"]}
        keys = {r: fatal._key(e.get("api"), e.get("op")) for r, e in entries.items()}
        if len(set(keys.values())) < 2:  # a size mismatch: evidence only where both are known
            if not any(entries[r].get("bytes") is None for r in involved):
                out.append(d)
            continue
        d = dict(d, calls={str(r): f"{entries[r].get('op') or '?'} ({k})" if k else
                           str(entries[r].get("op")) for r, k in keys.items()})
        if even:
            odd = fatal.deviating(log, entries, d["pg"], d["seq"])
            if odd:
                d["deviating"] = odd
        out.append(d)
    return out


def _entry_at(log, view, d: dict, variant: dict) -> dict:
    """{op, api, bytes, step} of the collective ``view``'s rank issued at (d's pg, seq): its log
    record, else its heartbeat's last or in-flight one, else the variant's op and size."""
    e = {"op": variant["op"], "api": None, "bytes": variant.get("bytes"),
         "step": (variant.get("steps") or [None])[-1]}
    if not log.empty and "api" in log:
        row = log[(log["rank"] == view.rank) & (log["pg"].astype(str) == d["pg"])
                  & (log["seq"] == d["seq"])]
        if len(row):
            e["api"] = row["api"].iloc[-1] if pd.notna(row["api"].iloc[-1]) else None
            if pd.notna(row["step"].iloc[-1]):
                e["step"] = int(row["step"].iloc[-1])
            return e
    for c in [view.last_collective] + view.inflight:
        if isinstance(c, dict) and str(c.get("pg")) == d["pg"] and c.get("seq") == d["seq"]:
            if isinstance(c.get("api"), str):
                e["api"] = c["api"]
            if isinstance(c.get("step"), int):
                e["step"] = c["step"]
            break
    return e


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


def victim_how(d: dict) -> str:
    """How a rank that died (a ``_died`` record) ended, and the collective it waited in:
    'killed by SIGABRT (signal 6) while it waited in all_reduce #14 of group 0, called at ...'."""
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
