"""Choosing and clearing the run directory of `trainprof wrap` / `trainprof demo` (--out, --force).

The rules (docs/security.md):

* `/`, the home directory and its ancestors, and the current directory and its ancestors are
  refused outright, with or without --force.
* An empty or missing directory is used as is. A non-empty one is used only when its
  manifest.json says it is a trainprof run (``"kind": "trainprof-run"``); anything else is
  refused, even with --force.
* --force then removes only the files that run wrote: the files listed in its manifest's
  ``files`` inventory (written when the job ended) that also follow trainprof's layout, plus
  summary.json / report.html when their content is trainprof's, plus manifest.json. Without an
  inventory (the launcher itself was killed) the layout alone decides. Only regular files are
  removed, symlinks are never followed, and folders go only when nothing is left in them. Every
  other file stays, and is named.
* Several `wrap` invocations of one job (one per node, docs/run-directory.md "Multi-node") share
  one --out: the first creates the run, the others join it without --force when its manifest
  names the same job id and all of its launchers still run: none has finished (a finished one
  means a rerun, refused like any previous run), and none is gone (killed: a process gone from
  this host, or a record of another host that did not change while watched, trainprof/rundir/nodes.py
  watch; refused too, naming it, with --out NEW_DIR or --force as the way out). The decision
  and the first records are made under a lock file (RUN/.trainprof.lock, O_EXCL), so that nodes
  starting together never both create the run or remove each other's files.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainprof.rundir.worker_exits import STREAM as WORKER_EXITS
from trainprof.rundir.files import HANG_TRIGGER
from trainprof.rundir import nodes
from trainprof.rundir.compact import COMPACT_DIR
from trainprof.rundir.owned import (ANALYSIS_OUTPUTS, RUN_KIND, is_analysis_output as _is_analysis_output,
                                    read_run_manifest)
from trainprof.rundir.nodes import CLAIM, NODE_FILE_RE, NODE_KIND, NODES_DIR
from trainprof.rundir.files import (INJECTED, JOB_TRACES_DIR, MANIFEST, PROFILER_DIR, RANKS_DIR,
                                    REPORT, SUMMARY, is_job_trace_name)

LOCK = ".trainprof.lock"  # held while a launcher decides about --out (prepare_locked)
LOCK_WAIT_S, LOCK_STALE_S = 120.0, 60.0
TOP_FILES = (MANIFEST, SUMMARY, REPORT, INJECTED, HANG_TRIGGER, WORKER_EXITS, LOCK)
RANK_DIR_RE = re.compile(r"rank-\d{5,}")
COMPACT_FILE_RE = re.compile(r"[a-z0-9_]+(\.blocks)?\.bin|keys\.jsonl|state\.json"
                             r"|[a-z_]+\.window-\d+\.jsonl")  # rundir/compact.py
RANK_FILE_RE = re.compile(r"[a-z0-9_]+(\.prev)?\.jsonl|meta\.json|hang-dump\.json"
                          r"|flight-recorder\.(pkl|json)|(memory|oom)_snapshot\.pickle")
TRACE_RE = re.compile(r"rank-\d{5,}\.pt\.trace\.json(\.gz)?")
DIGESTS_DIR = "digests"  # trainprof/analysis/digest.py: RUN/digests/rank-NNNNN.json
DIGEST_RE = re.compile(r"rank-\d{5,}\.json")
# temporaries of an interrupted atomic write: .NAME.PID.THREAD.tmp (rundir.write_json_atomic)
# and .report.html.XXXXXXXX (reports/html.py)
TMP_RE = re.compile(r"\.(?P<name>.+)\.\d+\.\d+\.tmp|\.(?P<html>report\.html)\.[A-Za-z0-9_]{8}")
MAX_INVENTORY = 200_000  # files; a larger run keeps no inventory (the layout alone decides)


class OutDirError(Exception):
    """--out cannot be used (exit 2); the message says why and what to do."""


@dataclass
class Plan:
    """What --force does to a previous run: remove `remove` (relative paths), keep `keep`."""
    out: Path
    remove: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)

    def describe(self, limit: int = 6) -> str:
        def names(items):
            tops: dict[str, int] = {}
            for rel in items:
                head = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
                tops[head] = tops.get(head, 0) + 1
            parts = [f"{k} ({n} file{'s' if n > 1 else ''})" if k.endswith("/") else k
                     for k, n in tops.items()]
            return ", ".join(parts[:limit]) + (f", … {len(parts) - limit} more"
                                               if len(parts) > limit else "")

        text = f"{len(self.remove)} file(s) it wrote ({names(self.remove)})"
        if self.keep:
            shown = ", ".join(self.keep[:limit]) + (f", … {len(self.keep) - limit} more"
                                                      if len(self.keep) > limit else "")
            text += f"; {len(self.keep)} other entr{'y' if len(self.keep) == 1 else 'ies'} " \
                    f"would stay ({shown})"
        return text


def _is_layout_name(name: str, pattern) -> bool:
    """name (or the file an interrupted atomic write of it was for) matches pattern, a regex
    or a tuple of names."""
    def match(n):
        return n in pattern if isinstance(pattern, tuple) else bool(pattern.fullmatch(n))

    if match(name):
        return True
    m = TMP_RE.fullmatch(name)
    return bool(m) and match(m.group("name") or m.group("html"))


def layout_files(out: Path) -> tuple[list[str], list[str]]:
    """(relative paths of regular files that follow trainprof's layout, every other entry).
    Nothing is followed through a symlink."""
    ours, other = [], []

    def walk_dir(rel: str, accept) -> None:
        path = out / rel
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            other.append(rel + "/")
            return
        if not entries:
            return
        for e in entries:
            accept(f"{rel}/{e.name}", e)

    def top(rel, e):
        if e.is_symlink():
            other.append(rel)
        elif e.is_dir(follow_symlinks=False) and e.name == RANKS_DIR:
            walk_dir(rel, ranks)
        elif e.is_dir(follow_symlinks=False) and e.name == PROFILER_DIR:
            walk_dir(rel, profiler)
        elif e.is_dir(follow_symlinks=False) and e.name == DIGESTS_DIR:
            walk_dir(rel, lambda r, x: (ours if _regular(x) and _is_layout_name(x.name, DIGEST_RE)
                                        else other).append(r))
        elif e.is_dir(follow_symlinks=False) and e.name == NODES_DIR:
            walk_dir(rel, lambda r, x: (ours if _regular(x) and (
                x.name == CLAIM or _is_layout_name(x.name, NODE_FILE_RE)) else other).append(r))
        elif _regular(e) and _is_layout_name(e.name, TOP_FILES):
            ours.append(rel)
        else:
            other.append(rel)

    def profiler(rel, e):
        if _regular(e) and _is_layout_name(e.name, TRACE_RE):
            ours.append(rel)
        elif e.name == JOB_TRACES_DIR and e.is_dir(follow_symlinks=False):
            walk_dir(rel, job_ranks)  # the probes' links to the job's own traces
        else:
            other.append(rel)

    def job_ranks(rel, e):
        if e.is_dir(follow_symlinks=False) and RANK_DIR_RE.fullmatch(e.name):
            walk_dir(rel, lambda r, x: (ours if _regular(x) and is_job_trace_name(x.name)
                                        else other).append(r))
        else:
            other.append(rel)

    def ranks(rel, e):
        if e.is_dir(follow_symlinks=False) and not e.is_symlink() and RANK_DIR_RE.fullmatch(e.name):
            walk_dir(rel, rank_entry)
        else:
            other.append(rel)

    def rank_entry(rel, e):
        if e.name == COMPACT_DIR and e.is_dir(follow_symlinks=False) and not e.is_symlink():
            walk_dir(rel, lambda r, x: (ours if _regular(x) and _is_layout_name(x.name, COMPACT_FILE_RE)
                                        else other).append(r))  # the bounded capture's tables
        else:
            (ours if _regular(e) and _is_layout_name(e.name, RANK_FILE_RE) else other).append(rel)

    try:
        entries = sorted(os.scandir(out), key=lambda e: e.name)
    except OSError as err:
        raise OutDirError(f"{out}: cannot list it: {err.strerror or err}") from err
    for e in entries:
        top(e.name, e)
    return ours, other


def _regular(e) -> bool:
    try:
        return e.is_file(follow_symlinks=False)
    except OSError:
        return False





def plan_force(out: Path, manifest: dict) -> Plan:
    ours, other = layout_files(out)
    inventory = manifest.get("files")
    listed = set(inventory) if isinstance(inventory, list) and \
        all(isinstance(x, str) for x in inventory) else None
    node_records = [rel for rel in ours if rel.startswith(NODES_DIR + "/")
                    and NODE_FILE_RE.fullmatch(rel.rsplit("/", 1)[-1]) and _is_node_record(out / rel)]
    if listed is not None:  # every node's inventory: each lists what its launcher wrote
        for rel in node_records:
            listed |= _node_files(out / rel)
    plan = Plan(out)
    for rel in ours:
        name = rel.rsplit("/", 1)[-1]
        if rel in (MANIFEST, LOCK):
            continue  # manifest.json removed last (the directory stays identifiable); the lock
            # is the launcher's that plans this, held while it decides
        if rel in node_records or rel == f"{NODES_DIR}/{CLAIM}":
            ok = True
        elif rel.startswith(DIGESTS_DIR + "/") and not TMP_RE.fullmatch(name):
            doc = _read_small_json(out / rel)  # written after the inventory: known by content
            ok = isinstance(doc, dict) and doc.get("kind") == "trainprof-trace-digest"
        elif rel in ANALYSIS_OUTPUTS:
            ok = _is_analysis_output(out / rel)
        elif TMP_RE.fullmatch(name):
            ok = True  # an interrupted write of one of our files
        else:
            ok = listed is None or rel in listed
        (plan.remove if ok else plan.keep).append(rel)
    plan.keep += other
    plan.remove.append(MANIFEST)
    return plan


def _read_small_json(path: Path):
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 64 << 20:
            return None
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _is_node_record(path: Path) -> bool:
    doc = _read_small_json(path)
    return isinstance(doc, dict) and doc.get("kind") == NODE_KIND


def _node_files(path: Path) -> set[str]:
    doc = _read_small_json(path)
    files = doc.get("files") if isinstance(doc, dict) else None
    return {x for x in files if isinstance(x, str)} if isinstance(files, list) else set()


def execute(plan: Plan) -> list[str]:
    """Remove the plan's files, then the folders left empty; returns what could not go."""
    failed = []
    for rel in plan.remove:
        p = plan.out / rel
        try:
            if p.is_symlink() or not p.is_file():
                continue
            p.unlink()
        except OSError as e:
            failed.append(f"{rel} ({e.strerror or e})")
    dirs = sorted({str(a) for rel in plan.remove for a in Path(rel).parents if str(a) != "."},
                  key=lambda d: -d.count("/"))
    for d in dirs + [RANKS_DIR, f"{PROFILER_DIR}/{JOB_TRACES_DIR}", PROFILER_DIR, NODES_DIR,
                     DIGESTS_DIR]:
        try:
            (plan.out / d).rmdir()  # only when empty
        except OSError:
            pass
    return failed


def protected(out: Path) -> str | None:
    """Why out must never be a run directory, or None."""
    target = out.resolve()
    if target == Path(target.anchor):
        return "the file system root"
    for label, base in (("your home directory", _home()), ("your home directory", _pw_home()),
                        ("the current directory", _cwd())):
        if base is None:
            continue
        base = base.resolve()
        if target == base:
            return label
        if target in base.parents:
            return f"an ancestor of {label}"
    return None


def _home() -> Path | None:
    try:
        return Path.home()  # $HOME
    except RuntimeError:
        return None


def _pw_home() -> Path | None:
    try:
        import pwd

        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except (ImportError, KeyError, OSError):
        return None


def _cwd() -> Path | None:
    try:
        return Path.cwd()
    except OSError:
        return None


def prepare(out: Path, force: bool, log=None, job_id: str | None = None,
            claim=None) -> set[str]:
    """Make out ready for a new run. Returns the relative paths already in it (kept files of a
    previous run, or the other nodes' files when joining), which the new run's inventory leaves
    out. OutDirError when out is refused.

    ``job_id``: this launcher's job (trainprof/rundir/nodes.py); a run directory of the same job whose
    nodes are all still running is joined (``joined`` True on the result). ``claim(joined)`` is
    called under the lock, for the launcher's first records (manifest.json when creating, its
    node record), so that nodes starting together see each other."""
    why = protected(out)
    if why:
        raise OutDirError(f"{out}: is {why}; trainprof never writes a run into it. "
                          f"Use --out NEW_DIR.")
    if out.is_symlink() and not out.exists():
        raise OutDirError(f"{out}: a dangling symlink")
    if out.exists() and not out.is_dir():
        raise OutDirError(f"{out}: exists and is not a directory")
    if out.is_dir() and _entries(out) and read_run_manifest(out) is None \
            and not os.path.lexists(out / LOCK):  # another launcher may be creating the run
        raise _foreign(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = _Lock(out)
    except OSError:  # nowhere to write: the launcher runs the job without probes (its note)
        return Prepared()
    observed = _observe(out, job_id)  # outside the lock: watching takes seconds
    with lock:
        result = _decide(out, force, log, job_id, observed)
        if claim is not None:
            claim(result.joined)
    return result


class Prepared(set):
    """The paths already in --out (a set, what the run's inventory leaves out), and whether
    this launcher joined another node's run of the same job."""
    joined: bool = False


def _entries(out: Path) -> list[str]:
    try:
        return [n for n in os.listdir(out) if n != LOCK]
    except OSError as e:
        raise OutDirError(f"{out}: cannot list it: {e.strerror or e}") from e


def _foreign(out: Path) -> OutDirError:
    return OutDirError(
        f"{out}: not empty and not a trainprof run directory (no manifest.json of kind "
        f"{RUN_KIND}); trainprof does not write into it, even with --force. Use --out NEW_DIR.")


def _observe(out: Path, job_id: str | None) -> dict:
    """The liveness of the launchers of a run of the same job in out (nodes.watch), when it
    matters: a run whose launchers are all still running is joined, but one whose launcher of
    another host was killed (its record says "running" forever) must not be."""
    try:
        man = read_run_manifest(out) if out.is_dir() else None
        if job_id is None or man is None or man.get("job_id") != job_id \
                or finished_nodes(out, man):
            return {}
        return nodes.watch(out, nodes.read_records(out))
    except Exception:  # noqa: BLE001 - a damaged record: decided under the lock as before
        return {}


def _gone(out: Path, observed: dict) -> list[dict]:
    """The launchers observed dead whose records are still unchanged (re-read under the lock)."""
    return [dict(info, file=f) for f, info in observed.items()
            if info["state"] == "dead" and nodes._stamp(out / f) == info["stamp"]]


def _decide(out: Path, force: bool, log, job_id: str | None,
            observed: dict | None = None) -> Prepared:
    result = Prepared()
    if not _entries(out):
        return result
    manifest = read_run_manifest(out)
    if manifest is None:
        raise _foreign(out)
    same_job = job_id is not None and manifest.get("job_id") == job_id
    if same_job:
        done = finished_nodes(out, manifest)
        gone = [] if done else _gone(out, observed or {})
        if not done and not gone:
            result.update(layout_files(out)[0])
            result.joined = True
            if log:
                log(f"joining job {job_id} in {out}: another node of the job created it")
            return result
    plan = plan_force(out, manifest)
    if not force:
        if same_job and done:
            raise OutDirError(
                f"{out}: holds a previous trainprof run of job {job_id!r} that already finished "
                f"on {', '.join(done[:4])} (its launcher recorded its end, or its process is gone "
                f"from this host; a rerun with the same rendezvous id?). Use --out NEW_DIR, or "
                f"--force to remove {plan.describe()}.")
        if same_job:
            who = ", ".join(nodes.describe(g) for g in gone[:4]) + \
                (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
            raise OutDirError(
                f"{out}: holds a trainprof run of job {job_id!r} whose launcher is gone: {who} "
                f"still says running, but its record has not changed for {gone[0]['seen_s']:.0f} "
                f"s (launchers touch theirs every {nodes.HEARTBEAT_S:g} s; killed?). This is not "
                f"a node of that run joining it (a rerun with the same rendezvous id?). Use --out "
                f"NEW_DIR, or --force to remove {plan.describe()}.")
        other = manifest.get("job_id")
        hint = (f" (job {other!r}; this is {'job ' + repr(job_id) if job_id else 'no known job'})"
                if other else "")
        multi = ("; for one run directory shared by the nodes of a job, give every node the same "
                 "torchrun --rdzv-id (or trainprof wrap --job-id ID)") if not job_id else ""
        raise OutDirError(f"{out}: holds a previous trainprof run{hint}. Use --out NEW_DIR, or "
                          f"--force to remove {plan.describe()}{multi}.")
    live = live_launchers(out, manifest)
    if live:
        raise OutDirError(f"{out}: in use by a trainprof launcher still running (pid "
                          f"{', '.join(map(str, live[:4]))} on this host); --force never removes a "
                          f"live run. Use --out NEW_DIR, or wait for it to end.")
    failed = execute(plan)
    if failed:
        raise OutDirError(f"{out}: --force could not remove {', '.join(failed[:5])}")
    if log:
        log(f"--force: removed {len(plan.remove)} file(s) of the previous run in {out}" +
            (f"; kept {len(plan.keep)} it did not write: {', '.join(plan.keep[:6])}"
             + (" …" if len(plan.keep) > 6 else "") if plan.keep else ""))
    result.update(set(layout_files(out)[0]) | set(plan.keep))
    return result


def finished_nodes(out: Path, manifest: dict) -> list[str]:
    """Node ids of the run's launchers that have ended (status no longer running, or, on this
    host, a launcher process that is gone): the job is over there."""
    done = []
    if _ended(manifest):
        done.append(str(manifest.get("node") or manifest.get("host")))
    d = out / NODES_DIR
    try:
        names = sorted(os.listdir(d))
    except OSError:
        names = []
    for name in names:
        if not NODE_FILE_RE.fullmatch(name) or name.startswith("."):
            continue
        doc = _read_small_json(d / name)
        if isinstance(doc, dict) and doc.get("kind") == NODE_KIND and _ended(doc):
            done.append(str(doc.get("node") or name[:-5]))
    return list(dict.fromkeys(done))


def live_launchers(out: Path, manifest: dict) -> list[int]:
    """Process ids of this host's launchers of the run in out that are still running."""
    import socket

    recs = [manifest]
    d = out / NODES_DIR
    try:
        names = sorted(os.listdir(d))
    except OSError:
        names = []
    recs += [_read_small_json(d / n) for n in names
             if NODE_FILE_RE.fullmatch(n) and not n.startswith(".")]
    live = []
    for rec in recs:
        if not isinstance(rec, dict) or rec.get("status") not in (None, "running"):
            continue
        pid = rec.get("launcher_pid")
        if rec.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0 \
                or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except (OSError, OverflowError):
            pass
        live.append(pid)
    return list(dict.fromkeys(live))


def _ended(rec: dict) -> bool:
    if rec.get("status") not in (None, "running"):
        return True
    import socket

    pid = rec.get("launcher_pid")
    if rec.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True  # killed before it could record the end
    except (OSError, OverflowError):
        pass
    return False


class _Lock:
    """RUN/.trainprof.lock, created with O_EXCL, holding "PID HOST": one launcher at a time
    decides about --out. A holder on this host whose process is gone is broken at once, a live
    one never; one on another host when this waiter has seen the lock unchanged for
    LOCK_STALE_S (by its own clock: the hosts' clocks and the file server's may disagree). A
    file of that name that is not such a lock is never removed (OutDirError). Waiting longer than LOCK_WAIT_S is an OutDirError."""

    def __init__(self, out: Path):
        self.path = out / LOCK
        self.fd = None
        self.ident = None  # (st_dev, st_ino) of the lock this launcher created

    def __enter__(self):
        deadline = time.monotonic() + LOCK_WAIT_S
        seen, since = None, time.monotonic()
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, f"{os.getpid()} {_hostname()}\n".encode())
                    st = os.fstat(fd)
                except OSError:  # a full disk: no lock left behind, none held
                    os.close(fd)
                    os.unlink(self.path)
                    raise
                self.fd, self.ident = fd, (st.st_dev, st.st_ino)
                return self
            except FileExistsError:
                holder = _lock_holder(self.path)
                if holder is None:
                    continue  # released meanwhile
                if holder is False:
                    raise OutDirError(f"{self.path}: not a trainprof lock file (trainprof's holds "
                                      f"a process id and a host); it is left as it is. Use "
                                      f"--out NEW_DIR.") from None
                state, pid, host = holder
                if state != seen:
                    seen, since = state, time.monotonic()
                alive = _holder_alive(pid, host)
                if alive is False or (alive is None and time.monotonic() - since > LOCK_STALE_S):
                    try:
                        if _lock_holder(self.path) == holder:  # the same lock: its holder died
                            os.unlink(self.path)
                        continue
                    except FileNotFoundError:
                        continue
                    except OSError:
                        pass  # cannot remove it: wait for its holder, as for a live one
                if time.monotonic() > deadline:
                    raise OutDirError(f"{self.path}: held by another trainprof launcher for over "
                                      f"{LOCK_WAIT_S:.0f} s; remove it if no launcher runs") from None
                time.sleep(0.05)
            except OSError:  # cannot write here: decided without a lock (single launcher)
                self.fd = None
                return self

    def __exit__(self, *exc):
        if self.fd is not None:
            try:
                os.close(self.fd)
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self.ident:  # never another launcher's lock
                    os.unlink(self.path)
            except OSError:
                pass
        return False


_LOCK_TEXT = re.compile(rb"(\d{1,10})(?: ([A-Za-z0-9._-]{1,255}))?\n?")


def _hostname() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:255] or "host"


def _lock_holder(path: Path):
    """((st_ino, st_mtime_ns, st_size), pid, host) of a trainprof lock file; None when there is
    none; False when the file is not one (not a small regular file holding "PID [HOST]", or
    empty for a moment while its holder writes it)."""
    import stat as st_mod

    try:
        st = os.lstat(path)
        if not st_mod.S_ISREG(st.st_mode) or st.st_size > 300:
            return False
        with open(path, "rb") as f:
            text = f.read(301)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    state = (st.st_ino, st.st_mtime_ns, st.st_size)
    if not text:
        return state, None, None  # just created: its holder writes it next
    m = _LOCK_TEXT.fullmatch(text)
    if not m:
        return False
    return state, int(m.group(1)), m.group(2).decode() if m.group(2) else None


def _holder_alive(pid: int | None, host: str | None) -> bool | None:
    """Whether the lock's holder, a process of this host, still exists; None when it is on
    another host (or the lock does not say)."""
    if pid is None or host is None or host != _hostname() or pid <= 0:
        return None
    return nodes.pid_alive(pid)


def inventory(out: Path, before: set[str]) -> list[str] | None:
    """The files this run wrote (trainprof's layout, not there before it), for the manifest;
    None when there are too many to list."""
    try:
        ours, _ = layout_files(out)
    except OutDirError:
        return None
    files = [rel for rel in ours if rel not in before and rel not in ANALYSIS_OUTPUTS
             and rel != LOCK
             and not TMP_RE.fullmatch(rel.rsplit("/", 1)[-1])]
    return files if len(files) <= MAX_INVENTORY else None
