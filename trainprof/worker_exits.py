"""RUN/worker-exits.jsonl: how each worker of a torchrun job ended (written by the torchrun agent's
probe, probes/elastic_agent.py; read by RunDir.worker_exits). The format's reading side, shared by
`wrap` (first failure on its stderr and in the manifest) and the hang analyzer."""

from __future__ import annotations

import signal

STREAM = "worker-exits.jsonl"  # in the run directory's top level


def describe_exit(code) -> dict:
    """{"exitcode", "signal", "signal_name"} of a subprocess-style exit code (-N: signal N)."""
    if not isinstance(code, int) or isinstance(code, bool):
        return {"exitcode": None, "signal": None, "signal_name": None}
    sig = -code if code < 0 else None
    name = None
    if sig:
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
