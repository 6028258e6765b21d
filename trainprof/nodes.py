"""Launcher records of a job that runs on several nodes (docs/run-directory.md, "Multi-node").

Every `trainprof wrap` invocation (one per node) writes its own record, RUN/nodes/<id>.json,
where <id> is ``<host>-<pid>-<random>`` (unique per invocation, also for containers that share
a host name): its command, start and end, exit code or signal, status, hang events and the
ranks it started (the ranks whose meta.json names this node). Only the launcher that created
the run directory writes manifest.json (the job's identity: schema version, kind, job id, and
its own launcher fields for older readers); the others join it. The reader (RunDir.launcher)
merges the node records over the manifest: the node records are the source of truth for what
each launcher did.

The job is recognized by its job id: `wrap --job-id`, else torchrun's ``--rdzv-id`` in the
command, else TORCHELASTIC_RUN_ID in the launcher's environment.

After the job, only the last node to finish analyzes: each node marks its record finished
(after reducing its local ranks' digests), then looks at every node record; when all are
finished it tries to create nodes/.analysis-claim with O_EXCL, and only the node that creates it
analyzes. Standard library only.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from pathlib import Path

NODES_DIR = "nodes"
NODE_KIND = "trainprof-node"
CLAIM = ".analysis-claim"
NODE_FILE_RE = re.compile(r"[A-Za-z0-9._-]+\.json")
ENV_NODE = "TRAINPROF_NODE"  # the job's ranks record which launcher started them (meta "node")
# a node's fields that describe one launcher, merged over manifest.json's on read
STATUS_ORDER = ("hung", "killed", "failed", "failed_to_start", "running", "ok")


def new_node_id(host: str | None = None) -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def node_path(run: str | os.PathLike, node: str) -> Path:
    return Path(run) / NODES_DIR / f"{node}.json"


def _flag_value(cmd: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last ``--name VALUE`` / ``--name=VALUE`` in cmd (either spelling)."""
    value = None
    for i, a in enumerate(cmd):
        for n in names:
            if a == n and i + 1 < len(cmd):
                value = cmd[i + 1]
            elif a.startswith(n + "="):
                value = a[len(n) + 1:]
    return value


def job_id_of(cmd: list[str], environ=None, explicit: str | None = None) -> str | None:
    """The job's id: explicit (--job-id), torchrun's --rdzv-id, else TORCHELASTIC_RUN_ID;
    None when none is known (torchrun's default id "none" does not count)."""
    environ = os.environ if environ is None else environ
    for v in (explicit, _flag_value(cmd, ("--rdzv-id", "--rdzv_id")),
              environ.get("TORCHELASTIC_RUN_ID")):
        if v and v.strip() and v.strip().lower() != "none":
            return v.strip()
    return None


def nnodes_of(cmd: list[str]) -> int | None:
    """torchrun's --nnodes (the upper bound of MIN:MAX), or None."""
    v = _flag_value(cmd, ("--nnodes",))
    try:
        return int(str(v).split(":")[-1]) if v else None
    except ValueError:
        return None


def read_records(run: str | os.PathLike, problems: list[str] | None = None,
                 clean=None) -> list[dict]:
    """Every node record in RUN/nodes/ (sorted by start time), each with ``_file``; files that
    cannot be read are problems. ``clean(spec_obj, where)``: the reader's field-type check."""
    from trainprof.rundir import RunDirError, read_json

    d = Path(run) / NODES_DIR
    try:
        entries = sorted(d.iterdir())
    except FileNotFoundError:
        return []
    except OSError as e:
        if problems is not None:
            problems.append(f"{d}: cannot list: {e.strerror or e}; the node records are not read")
        return []
    out = []
    for p in entries:
        if not NODE_FILE_RE.fullmatch(p.name) or p.name.startswith("."):
            continue
        try:
            rec = read_json(p)
        except RunDirError as e:
            if problems is not None:
                problems.append(str(e))
            continue
        if not isinstance(rec, dict) or rec.get("kind") != NODE_KIND:
            if problems is not None:
                problems.append(f"{p}: not a trainprof node record; ignored")
            continue
        if clean is not None:
            rec = clean(rec, str(p))
        rec["_file"] = f"{NODES_DIR}/{p.name}"
        out.append(rec)
    return sorted(out, key=lambda r: (_ns(r.get("start_time")) or 0, r["_file"]))


def _ns(t) -> int | None:
    """The ``ns`` of a time field ({"iso", "ns"}), or None when it is not one (a record written
    by another version, or damaged, must not stop a launcher that reads it)."""
    ns = t.get("ns") if isinstance(t, dict) else None
    return ns if isinstance(ns, int) and not isinstance(ns, bool) else None


def _first_rank(rec: dict) -> int:
    ranks = [r for r in rec.get("ranks") or [] if isinstance(r, int)] \
        if isinstance(rec.get("ranks"), list) else []
    return min(ranks) if ranks else 1 << 62


def merge(manifest: dict, records: list[dict]) -> dict:
    """The launcher view of a job from manifest.json and the node records: the manifest's
    job-level fields, and from the nodes ``nodes`` (one entry each, the node holding rank 0
    first), ``command`` (that node's), ``start_time`` (earliest), ``end_time`` (latest, None
    while a node runs), ``status`` / ``exit_code`` / ``signal`` (the worst node's: hung, killed,
    failed, ... ok; of equals the one that ended first), and hangs, first failures and
    forwarded signals of all nodes."""
    if not records:
        return manifest
    recs = sorted(records, key=lambda r: (_first_rank(r), _ns(r.get("start_time")) or 0))
    out = dict(manifest)
    out["nodes"] = [{**{k: r.get(k) for k in ("node", "host", "command", "start_time",
                                               "end_time", "status", "exit_code", "signal",
                                               "signal_name", "ranks")}, "file": r.get("_file")}
                    for r in recs]
    out["command"] = recs[0].get("command", manifest.get("command"))
    starts = [r["start_time"] for r in recs if _ns(r.get("start_time")) is not None]
    if starts:
        out["start_time"] = min(starts, key=lambda t: t["ns"])
    ends = [r.get("end_time") for r in recs]
    out["end_time"] = (max(ends, key=lambda t: _ns(t) or 0)
                       if ends and all(isinstance(e, dict) for e in ends) else None)

    def badness(r):
        s = r.get("status") or "running"
        return (STATUS_ORDER.index(s) if s in STATUS_ORDER else 0,
                _ns(r.get("end_time")) or 1 << 62)

    worst = min(recs, key=badness)
    for k in ("status", "exit_code", "signal", "signal_name", "job_exit_code", "job_signal"):
        out[k] = worst.get(k)
    for k in ("hangs", "first_failures", "signals_forwarded"):
        items = [x for r in recs for x in (r.get(k) or [])]
        if items or k in out:
            out[k] = items
    return out


def finished(rec: dict) -> bool:
    return rec.get("finished_ns") is not None


def claim_analysis(run: str | os.PathLike, node: str) -> bool:
    """True for exactly one caller per run directory: the one that creates nodes/.analysis-claim
    (O_EXCL)."""
    p = Path(run) / NODES_DIR / CLAIM
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, f'{{"node": "{node}", "t_ns": {time.time_ns()}}}\n'.encode())
    finally:
        os.close(fd)
    return True


def pending(run: str | os.PathLike, node: str) -> list[dict] | None:
    """The other nodes' records not finished yet ([] when this node is the last), or None when
    this node's own record is not there (nothing to decide with)."""
    recs = read_records(run)
    if not any(r.get("node") == node for r in recs):
        return None
    return [r for r in recs if r.get("node") != node and not finished(r)]
