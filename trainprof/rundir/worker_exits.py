"""RUN/worker-exits.jsonl: how each worker of a torchrun job ended (written by the torchrun agent's
probe, probes/elastic_agent.py; read by RunDir.worker_exits). The format's reading side, shared by
`wrap` (first failure on its stderr and in the manifest) and the hang analyzer."""

from __future__ import annotations

STREAM = "worker-exits.jsonl"  # in the run directory's top level


def describe_exit(code) -> dict:
    """{"exitcode", "signal", "signal_name"} of a subprocess-style exit code (-N: signal N)."""
    if not isinstance(code, int) or isinstance(code, bool):
        return {"exitcode": None, "signal": None, "signal_name": None}
    sig = -code if code < 0 else None
    name = None
    if sig:
        import signal

        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
    return {"exitcode": code, "signal": sig, "signal_name": name}


def summarize(records: list[dict]) -> dict:
    """From worker-exits.jsonl records: {"first_failures": [...], "terminated": [...],
    "workers": {rank: row}}, each row {rank, local_rank, pid, host, exitcode, signal,
    signal_name, first}. Per host only the first close of the latest restart counts (the one that
    stopped the workers; later closes find them all ended)."""
    latest: dict = {}
    for rec in records:
        if not isinstance(rec, dict) or rec.get("event") != "workers_closed":
            continue
        ws = rec.get("workers")
        if not isinstance(ws, list):
            continue
        host = str(rec.get("host"))
        restart = rec.get("restart") if isinstance(rec.get("restart"), int) else 0
        if host not in latest or restart > latest[host][0]:  # the first close of a round
            latest[host] = (restart, rec)
    rows: dict = {}
    for host, (_, rec) in sorted(latest.items()):
        for w in rec["workers"]:
            if not isinstance(w, dict) or not isinstance(w.get("rank"), int):
                continue
            at_close, code = w.get("exitcode_at_close"), w.get("exitcode")
            failed_first = isinstance(at_close, int) and at_close != 0
            row = {"rank": w["rank"], "local_rank": w.get("local_rank"), "pid": w.get("pid"),
                   "host": host, "t_close_ns": rec.get("t_ns"),
                   **describe_exit(at_close if failed_first else code), "first": failed_first,
                   "ended_by_launcher": at_close is None and isinstance(code, int) and code != 0}
            rows[w["rank"]] = row
    return {"workers": rows,
            "first_failures": [r for _, r in sorted(rows.items()) if r["first"]],
            "terminated": [r for _, r in sorted(rows.items()) if r["ended_by_launcher"]]}


def how(row: dict) -> str:
    """'killed by SIGKILL (signal 9)' / 'exited with code 1'."""
    if row.get("signal"):
        return f"killed by {row.get('signal_name')} (signal {row['signal']})"
    return f"exited with code {row.get('exitcode')}"


def launcher_unrecorded(man: dict) -> dict | None:
    """When the launcher's record (manifest.json) never got the job's end: {"state", "text"},
    state "dead" (a launcher of this host whose process is gone: killed, e.g. by SIGKILL),
    "unknown" (of another host: still running there, or killed) or "alive" (the job is still
    running); None when the end is recorded, or there is no launcher record (a probe-only run)."""
    if not isinstance(man, dict) or not man or man.get("end_time") \
            or man.get("status") not in (None, "running") or isinstance(man.get("exit_code"), int):
        return None
    from trainprof.rundir import nodes  # lazy: start-up time of the job's bootstrap

    pid, host = man.get("launcher_pid"), man.get("host")
    who = "the launcher (`trainprof wrap`" + (f", pid {pid}" if isinstance(pid, int) else "") \
        + (f" on {host}" if isinstance(host, str) else "") + ")"
    state = nodes.state(man)
    if state == "alive":
        return {"state": state, "text": f"{who} is still running: the job has not ended yet"}
    if state == "dead":
        text = (f"{who} ended without recording the job's exit (killed, e.g. by SIGKILL?): the "
                f"job's status and exit code are unknown")
    else:
        text = (f"{who} has not recorded the job's exit: it is still running there, or it was "
                f"killed (e.g. by SIGKILL); the job's status and exit code are unknown")
    return {"state": "dead" if state == "dead" else "unknown", "text": text}


def launcher_last_seen_ns(run_path, man: dict) -> int | None:
    """When a launcher that never recorded the job's end was last alive: its node record's last
    touch (nodes.Heartbeat touches it every HEARTBEAT_S while the launcher lives, so a launcher
    killed by SIGKILL left it within that of its death), on the file system's clock. None
    without a node record."""
    from trainprof.rundir import nodes  # lazy: start-up time of the job's bootstrap

    node = man.get("node") if isinstance(man, dict) else None
    return nodes.last_touched_ns(run_path, node) if isinstance(node, str) else None
