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

While it lives, a launcher touches its record every HEARTBEAT_S (Heartbeat). Whether another
launcher still runs (watch): on this host, its process exists; on another host, its record
changes while this one watches it for up to STALE_AFTER_S by its own clock (clocks of different
hosts are never compared). A launcher of the job that is gone means the run directory is not
joined (trainprof/launch/outdir.py).

After the job, only the last node to finish analyzes: each node marks its record finished
(after reducing its local ranks' digests), then looks at the other node records; when none of
them is still running (finished, or gone: killed) it tries to create nodes/.analysis-claim with
O_EXCL, and only the node that creates it analyzes; the claim names the nodes it took for gone,
and such a node that finishes after all analyzes again. Standard library only.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from pathlib import Path

from trainprof.rundir.files import UNREADABLE, RunDirError, read_json, read_json_or_problem

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
        rec = read_json_or_problem(p, problems, default=UNREADABLE)
        if rec is UNREADABLE:
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


def claim_analysis(run: str | os.PathLike, node: str, presumed_dead: list | None = None) -> bool:
    """True for exactly one caller per run directory: the one that creates nodes/.analysis-claim
    (O_EXCL), which says who analyzes and which nodes it took for gone (``presumed_dead``: such
    a node that finishes after all analyzes again)."""
    import json

    p = Path(run) / NODES_DIR / CLAIM
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, (json.dumps({"node": node, "t_ns": time.time_ns(),
                                  "presumed_dead": [str(n) for n in presumed_dead or []]})
                      + "\n").encode())
    finally:
        os.close(fd)
    return True


def read_claim(run: str | os.PathLike) -> dict | None:
    """nodes/.analysis-claim, or None when it cannot be read (yet)."""
    try:
        doc = read_json(Path(run) / NODES_DIR / CLAIM)
    except RunDirError:
        return None
    if not isinstance(doc, dict):
        return None
    dead = doc.get("presumed_dead")
    doc["presumed_dead"] = [x for x in dead if isinstance(x, str)] if isinstance(dead, list) else []
    return doc


def pending(run: str | os.PathLike, node: str) -> list[dict] | None:
    """The other nodes' records not finished yet ([] when this node is the last), or None when
    this node's own record is not there (nothing to decide with)."""
    recs = read_records(run)
    if not any(r.get("node") == node for r in recs):
        return None
    return [r for r in recs if r.get("node") != node and not finished(r)]


# --------------------------------------------------------------------------- liveness
HEARTBEAT_S = 5.0     # a running launcher touches its node record this often
STALE_AFTER_S = 20.0  # a record of another host unchanged this long (watched): its launcher is gone


class Heartbeat:
    """A launcher's heartbeat: a daemon thread that touches (utime) its node record every
    HEARTBEAT_S while the launcher lives, so that the other nodes can tell a running launcher
    from one that was killed (SIGKILL, a lost node) and left its record saying "running".
    It never creates, rewrites or removes a file; failures are ignored."""

    def __init__(self, path: str | os.PathLike, interval: float | None = None):
        import threading

        self.path, self.interval = Path(path), interval or HEARTBEAT_S
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainprof-node-heartbeat",
                                       daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            try:  # never through a symlink: only the record this launcher wrote
                os.utime(self.path, follow_symlinks=os.utime not in os.supports_follow_symlinks)
            except (OSError, NotImplementedError):
                pass


def _this_host() -> str:
    return socket.gethostname()


def pid_alive(pid) -> bool | None:
    """Whether a process of this host exists; None when the record names none."""
    if type(pid) is not int or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # exists, not ours to signal
    return True


def _stamp(path: Path):
    """(inode, mtime, size) of a record, read through open() so that a network file system
    revalidates its cached attributes (NFS close-to-open); None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return st.st_ino, st.st_mtime_ns, st.st_size
    finally:
        os.close(fd)


def last_touched_ns(run: str | os.PathLike, node: str) -> int | None:
    """The last time node ``node``'s record was touched (mtime, ns; its launcher touches it every
    HEARTBEAT_S while it lives); None without the record or for a node id that is not a plain
    file name."""
    if not node or node.startswith(".") or "/" in node or "\\" in node or "\0" in node:
        return None
    st = _stamp(node_path(run, node))
    return st[1] if st else None


def state(rec: dict) -> str:
    """What a node record says without watching it: "ended" (its launcher finished its work:
    job, digests), "alive" / "dead" (a launcher of this host: its process exists or not), or
    "unknown" (a launcher of another host: watch it; it heartbeats until it exits, also after
    its job ended while it reduces its digests)."""
    if finished(rec):
        return "ended"
    if rec.get("host") == _this_host():
        alive = pid_alive(rec.get("launcher_pid"))
        if alive is not None:
            return "alive" if alive else "dead"
    return "unknown"


def watch(run: str | os.PathLike, recs: list[dict], wait_s: float | None = None,
          until_any_alive: bool = False, sleep=time.sleep) -> dict[str, dict]:
    """The liveness of node records (from read_records): {file: {"node", "host", "state",
    "seen_s", "stamp"}} with state ended / alive / dead. A record of this host is decided by its
    launcher's process; one of another host by watching it for up to ``wait_s`` (default
    STALE_AFTER_S) with this host's clock only (the hosts' and the file server's clocks may
    disagree): a running launcher touches it every HEARTBEAT_S, so a record that changes (or
    says its launcher ended) is alive (ended), one unchanged all along is dead. Returns as soon
    as every record is decided (``until_any_alive``: as soon as one is alive)."""
    wait_s = STALE_AFTER_S if wait_s is None else wait_s
    root = Path(run)
    out: dict[str, dict] = {}
    first: dict[str, tuple] = {}
    for r in recs:
        f = r.get("_file") or f"{NODES_DIR}/{r.get('node')}.json"
        out[f] = {"node": r.get("node"), "host": r.get("host"), "state": state(r),
                  "seen_s": 0.0, "stamp": _stamp(root / f)}
        st = out[f]["stamp"]
        if out[f]["state"] == "dead" and st and time.time_ns() - st[1] < 2 * HEARTBEAT_S * 1e9:
            out[f]["state"] = "unknown"  # touched just now: a container sharing the host name?
        if out[f]["state"] == "unknown":
            first[f] = out[f]["stamp"]
    t0 = time.monotonic()
    while first:
        if until_any_alive and any(v["state"] == "alive" for v in out.values()):
            break
        elapsed = time.monotonic() - t0
        for f, s0 in list(first.items()):
            now = _stamp(root / f)
            if now != s0:
                try:
                    rec = read_json(root / f)
                    ended = isinstance(rec, dict) and state(rec) == "ended"
                except RunDirError:
                    ended = False
                out[f].update(state="ended" if ended else "alive", stamp=now,
                              seen_s=round(elapsed, 1))
                del first[f]
        if not first or elapsed >= wait_s:
            break
        sleep(min(0.5, max(0.05, wait_s / 40)))
    for f in first:
        out[f].update(state="dead", seen_s=round(time.monotonic() - t0, 1))
    return out


def describe(info: dict) -> str:
    """One node of watch()'s result, for a message: "node N (host H)"."""
    return f"node {info.get('node')} (host {info.get('host')})"
