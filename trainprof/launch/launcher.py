"""Run a job under the probes: prepare the run directory, start the command with the bootstrap
on PYTHONPATH, forward signals, watch for hangs, and record how it ended. Used by `trainprof wrap`
and `demo`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from trainprof import __version__
from trainprof.rundir import nodes
from trainprof.launch import outdir
from trainprof.rundir import worker_exits
from trainprof.probes import runtime
from trainprof.rundir.files import HANG_DUMP, HANG_TRIGGER
from trainprof.rundir.files import (MANIFEST, RANKS_DIR, SCHEMA_VERSION, RunDirError,
                                    collect_rank_entries, iter_jsonl, read_json, write_json_atomic)

BOOTSTRAP_DIR = Path(__file__).resolve().parents[1] / "_bootstrap"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
RELEVANT_ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "OMP_", "SLURM_", "MASTER_",
                         "WORLD_SIZE", "GLOO_", "TRAINPROF_")
# Exit code of `trainprof wrap --on-hang kill` when it terminated a hung job (as timeout(1) does).
HANG_EXIT_CODE = 124
HEARTBEAT = "heartbeat.jsonl"  # probes/heartbeat.py: grows only when its rank progresses


class LaunchError(Exception):
    pass


def prepare_run_dir(out: Path, force: bool, job_id: str | None = None) -> outdir.Prepared:
    """Refuse an --out that is not ours to write (trainprof/launch/outdir.py: OutDirError, exit 2);
    with force, remove only what a previous trainprof run there wrote; join the run of another
    node of the same job (``job_id``, trainprof/rundir/nodes.py). Returns the paths already in out
    (files kept), which this run's inventory leaves out, with ``joined``, ``node`` (this
    launcher's node id) and ``job_id``; this launcher's first records are written under the
    run directory's lock."""
    node = nodes.new_node_id()
    start = _now()

    def claim(joined: bool) -> None:
        base = {"host": socket.gethostname(), "launcher_pid": os.getpid(), "start_time": start,
                "status": "running", "trainprof_version": __version__}
        try:
            if not joined:  # the job's identity, for the nodes that join it
                write_json_atomic(out / MANIFEST, {"schema_version": SCHEMA_VERSION,
                                                   "kind": outdir.RUN_KIND, "job_id": job_id,
                                                   "node": node, **base})
            write_json_atomic(nodes.node_path(out, node),
                              {"kind": nodes.NODE_KIND, "node": node, "job_id": job_id, **base})
        except OSError:
            pass  # run_job finds the directory unwritable and runs the job without probes

    prepared = outdir.prepare(out, force, log=_log, job_id=job_id, claim=claim)
    prepared.node, prepared.job_id = node, job_id
    return prepared


def _log(msg: str) -> None:
    try:
        print(f"trainprof: {msg}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not change the job's outcome
        pass


def job_env(out: Path, profile_steps: str | None, extra: dict | None = None,
            settings: dict | None = None) -> dict:
    """The job's environment: ours, the bootstrap on PYTHONPATH, the run directory, and the
    TRAINPROF_* settings in their canonical spelling (trainprof.settings; None: unset)."""
    env = dict(os.environ)
    for k, v in (settings or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BOOTSTRAP_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[runtime.ENV_RUN_DIR] = str(out.resolve())
    if profile_steps is not None:
        env[runtime.ENV_PROFILE_STEPS] = profile_steps
    env.update(extra or {})
    return env


@dataclass
class HangPolicy:
    """`--hang-timeout` / `--on-hang`: what counts as hung and what to do about it."""
    timeout_s: float
    action: str = "dump"        # "dump": dump and keep waiting; "kill": dump, then end the job
    dump_wait_s: float = 15.0   # how long to wait for every rank's dump
    term_grace_s: float = 5.0   # SIGTERM to the job's process group, SIGKILL after this

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"hang timeout must be > 0 seconds, got {self.timeout_s}")
        if self.action not in ("dump", "kill"):
            raise ValueError(f"--on-hang must be dump or kill, got {self.action!r}")


class HangWatch:
    """Launcher-side watchdog. Progress = any rank's heartbeat.jsonl growing (a rank appends
    only when its step, collectives or flight-recorder counters advance). When no rank has
    progressed for timeout_s, it writes RUN/hang-trigger.json, which every rank's probe thread
    polls and answers with ranks/rank-N/hang-dump.json; with action "kill" it then terminates
    the job's process group. It is armed by the first heartbeat (a job still importing torch is
    not hung) and disarmed once every rank has closed its heartbeat."""

    def __init__(self, out: Path, policy: HangPolicy, pgid: int, manifest: dict,
                 save_manifest, log=None):
        self.out, self.policy, self.pgid = out, policy, pgid
        self.manifest, self.save_manifest = manifest, save_manifest
        self.log = log or (lambda msg: print(f"trainprof: {msg}", file=sys.stderr, flush=True))
        self.poll_s = min(1.0, max(0.05, policy.timeout_s / 10))
        self.killed = False
        self.job_done = threading.Event()
        self._sizes: dict[Path, tuple] = {}
        self._closed: set[Path] = set()
        self._events = 0
        self.thread = threading.Thread(target=self._run, name="trainprof-hang-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        """The job's leader process ended: stop watching (after a kill, let it complete)."""
        self.job_done.set()
        self.thread.join(timeout=self.policy.term_grace_s + 5 if self.killed else 2)

    def _heartbeats(self) -> dict[Path, tuple]:
        out = {}
        for p in (self.out / RANKS_DIR).glob(f"rank-*/{HEARTBEAT}"):
            try:
                st = p.stat()
                out[p] = (st.st_size, st.st_mtime_ns, st.st_ino)
            except OSError:
                pass
        return out

    def _is_closed(self, p: Path) -> bool:
        try:
            with open(p, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().rstrip(b"\n").split(b"\n")
            return b'"event":"close"' in lines[-1]
        except OSError:
            return False

    def _run(self) -> None:
        last_progress = None
        fired = False
        while not self.job_done.wait(self.poll_s):
            try:
                cur = self._heartbeats()
                changed = [p for p, st in cur.items() if self._sizes.get(p) != st]
                if changed:
                    self._sizes = cur
                    last_progress, fired = time.monotonic(), False
                    self._closed.update(p for p in changed if self._is_closed(p))
                if last_progress is None or fired or (cur and set(cur) <= self._closed):
                    continue
                stalled = time.monotonic() - last_progress
                if stalled >= self.policy.timeout_s:
                    fired = True
                    self._on_hang(stalled, [p for p in cur if p not in self._closed])
                    if self.killed:
                        return
            except Exception as e:  # noqa: BLE001 - the watchdog must not take wrap down
                self.log(f"hang watchdog error: {type(e).__name__}: {e}")

    def _on_hang(self, stalled: float, live: list[Path]) -> None:
        self._events += 1
        event = {"id": f"watchdog-{self._events}", "t_ns": time.time_ns(),
                 "stalled_s": round(stalled, 3),
                 "timeout_s": self.policy.timeout_s, "action": self.policy.action,
                 "ranks_live": sorted(_rank_of(p) for p in live)}
        self.log(f"no rank made progress for {stalled:.1f} s (--hang-timeout "
                 f"{self.policy.timeout_s:g}); asking {len(live)} rank(s) to dump stacks")
        write_json_atomic(self.out / HANG_TRIGGER, event)
        deadline = time.monotonic() + self.policy.dump_wait_s
        pending = {_rank_of(p): p.parent / HANG_DUMP for p in live}
        while pending and time.monotonic() < deadline and not self.job_done.is_set():
            for r, dump in list(pending.items()):
                d = _read_json_quiet(dump)
                if d and d.get("trigger_id") == event["id"] and d.get("complete"):
                    del pending[r]
            if pending:
                time.sleep(0.1)
        event["ranks_dumped"] = sorted(set(event["ranks_live"]) - set(pending))
        event["ranks_not_dumped"] = sorted(pending)
        event["dump_s"] = round((time.time_ns() - event["t_ns"]) / 1e9, 3)
        self.log(f"{len(event['ranks_dumped'])}/{len(live)} rank(s) dumped to "
                 f"{self.out / RANKS_DIR}/rank-*/{HANG_DUMP}; see `trainprof hang {self.out}`")
        if self.policy.action == "kill" and not self.job_done.is_set():
            self.killed = True
            event["killed_ns"] = time.time_ns()
            self.log(f"terminating the hung job (--on-hang kill, exit code {HANG_EXIT_CODE})")
            self._terminate()
        self.manifest.setdefault("hangs", []).append(event)
        self.save_manifest()

    def _terminate(self) -> None:
        _killpg(self.pgid, signal.SIGTERM)
        end = time.monotonic() + self.policy.term_grace_s
        while time.monotonic() < end:
            if not _group_alive(self.pgid):
                return
            time.sleep(0.1)
        _killpg(self.pgid, signal.SIGKILL)


def _rank_of(heartbeat: Path) -> int:
    return int(heartbeat.parent.name[5:])


def _read_json_quiet(path: Path):
    try:
        return read_json(path)
    except RunDirError:
        return None


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _now() -> dict:
    return {"iso": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "ns": time.time_ns()}


@dataclass
class JobResult:
    """How the job ended, and what trainprof could not do around it (one line each)."""
    code: int                     # shell convention: 128+N after signal N; 124 after --on-hang kill
    sig: int | None               # the signal the job died of, or None
    notes: list[str] = field(default_factory=list)
    first_failures: list = field(default_factory=list)  # workers whose end stopped the job
    probes_ran: bool = True       # False: the run directory was unwritable, the job ran bare
    record: "_Manifest | None" = None  # this launcher's records (node record, manifest.json)
    local_ranks: list = field(default_factory=list)  # the ranks this launcher started


NODE_FIELDS = ("node", "job_id", "host", "launcher_pid", "command", "cwd", "start_time",
               "end_time", "status", "exit_code", "signal", "signal_name", "job_exit_code",
               "job_signal", "trainprof_version", "hangs", "first_failures", "signals_forwarded",
               "files", "config", "env", "finished_ns", "heartbeat_s")


class _Manifest:
    """This launcher's records: its node record (RUN/nodes/<node>.json) and, when it created the
    run directory, manifest.json. Saving never raises; the first failure becomes a note."""

    def __init__(self, out: Path, data: dict, notes: list[str], node: str, owner: bool = True):
        self.out, self.data, self.notes = out, data, notes
        self.node, self.owner = node, owner
        self.local_ranks: list[int] = []
        self.lock = threading.Lock()
        self.failed = False

    def save(self) -> bool:
        with self.lock:
            path = self.out / MANIFEST
            try:
                if self.owner:
                    write_json_atomic(path, self.data)
                path = nodes.node_path(self.out, self.node)
                write_json_atomic(path, {"kind": nodes.NODE_KIND, "ranks": self.local_ranks,
                                         **{k: self.data[k] for k in NODE_FIELDS if k in self.data}})
                return True
            except Exception as e:  # noqa: BLE001 - our bookkeeping, never the job's outcome
                if not self.failed:
                    self.notes.append(f"could not write {path} ({reason(e)})")
                self.failed = True
                return False

    def finished(self) -> None:
        """The launcher's work after the job (digests) is done: the last node may analyze."""
        self.data["finished_ns"] = time.time_ns()
        self.save()


def reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"


def run_job(cmd: list[str], out: Path, profile_steps: str | None = None,
            env_extra: dict | None = None, config: dict | None = None,
            hang: HangPolicy | None = None, settings: dict | None = None,
            before: set[str] | None = None) -> JobResult:
    """Run cmd to completion with probes active. The exit code follows the shell convention
    (128+N when the job died of signal N), or HANG_EXIT_CODE when the hang watchdog terminated
    the job. Nothing that goes wrong with trainprof's own files changes it: a run directory
    that cannot be written at the start makes the job run without probes, and every later
    failure is one line in JobResult.notes."""
    config, env_extra = _with_hang_watch(dict(config or {}), dict(env_extra or {}), hang)
    notes: list[str] = []
    node = getattr(before, "node", None) or nodes.new_node_id()
    env_extra[nodes.ENV_NODE] = node
    manifest = _start_record(cmd, out, profile_steps, config, settings, before, node, notes)
    probes_ran = _open_run_dir(out, manifest, env_extra, notes)
    proc = _start_job(cmd, out, profile_steps, env_extra, settings, manifest, probes_ran)
    watch = HangWatch(out, hang, proc.pid, manifest.data, manifest.save) \
        if hang and probes_ran else None
    rc, watch = _wait_forwarding_signals(proc, manifest, watch, notes)
    result = _result(rc, proc, watch, notes, probes_ran, manifest)
    if probes_ran:
        try:
            _record_end(out, manifest, rc, watch, before or set(), result)
        except Exception as e:  # noqa: BLE001 - the job's outcome is decided already
            notes.append(f"could not finish the run record ({reason(e)})")
    return result


def _with_hang_watch(config: dict, env_extra: dict, hang: HangPolicy | None) -> tuple[dict, dict]:
    """The hang policy recorded in the config, and the flight recorder turned on for the dumps
    (unless the job sets its buffer size itself)."""
    if hang is not None:
        config.update(hang_timeout_s=hang.timeout_s, on_hang=hang.action)
        fr_vars = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
        if not any(k in os.environ for k in fr_vars):
            env_extra.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # flight recorder for the dumps
    return config, env_extra


def _start_record(cmd: list[str], out: Path, profile_steps: str | None, config: dict,
                  settings: dict | None, before, node: str, notes: list[str]) -> _Manifest:
    """This launcher's record of the job as it starts (saved by _open_run_dir)."""
    disabled = runtime.ENV_DISABLE in (settings or {}) and (settings or {})[runtime.ENV_DISABLE]
    return _Manifest(out, {
        "schema_version": SCHEMA_VERSION,
        "kind": outdir.RUN_KIND,
        "job_id": getattr(before, "job_id", None),
        "node": node,
        "command": list(cmd),
        "cwd": _cwd(),
        "host": socket.gethostname(),
        "trainprof_version": __version__,
        "python": sys.version.split()[0],
        "launcher_pid": os.getpid(),
        "start_time": _now(),
        "config": {"profile_steps": profile_steps, **config,
                   **({"probes_disabled": True} if disabled else {})},
        "env": {k: v for k, v in os.environ.items() if k.startswith(RELEVANT_ENV_PREFIXES)},
        "status": "running",
        "heartbeat_s": nodes.HEARTBEAT_S,
    }, notes, node, owner=not getattr(before, "joined", False))


def _open_run_dir(out: Path, manifest: _Manifest, env_extra: dict, notes: list[str]) -> bool:
    """Create the run directory and write the first record, then beat this node's heartbeat.
    False when nothing can be written: the job then runs as it is, without probes."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        ok = manifest.save()
    except OSError as e:
        notes.append(f"could not create {out} ({reason(e)})")
        ok = False
    if not ok:  # nowhere to write: run the job as it is, without probes
        notes[-1] += ": the job ran without probes"
        env_extra[runtime.ENV_DISABLE] = "1"
        return False
    try:  # until this launcher exits: the other nodes tell it from a killed one
        nodes.Heartbeat(nodes.node_path(out, manifest.node)).start()
    except Exception as e:  # noqa: BLE001 - bookkeeping, never the job
        notes.append(f"node heartbeat not started ({reason(e)})")
    return True


def _start_job(cmd: list[str], out: Path, profile_steps: str | None, env_extra: dict,
               settings: dict | None, manifest: _Manifest, probes_ran: bool) -> subprocess.Popen:
    """The job in its own process group, the bootstrap on its PYTHONPATH; LaunchError (and a
    "failed_to_start" record) when it cannot be started."""
    try:
        return subprocess.Popen(cmd, env=job_env(out, profile_steps, env_extra, settings),
                                process_group=0)
    except OSError as e:
        manifest.data.update(status="failed_to_start", end_time=_now(), error=str(e))
        if probes_ran:
            manifest.save()
        raise LaunchError(f"cannot start {cmd[0]!r}: {e.strerror or e}") from e


def _wait_forwarding_signals(proc: subprocess.Popen, manifest: _Manifest, watch,
                             notes: list[str]) -> tuple[int, "HangWatch | None"]:
    """Wait for the job, the hang watchdog running, and pass on the signals sent to us: the job
    runs in its own process group and Ctrl-C reaches only ours, so each is sent to the whole
    job group, as a terminal would have done without us. Returns (the job leader's return code,
    the watchdog or None when it could not start)."""
    def forward(signum, frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass
        try:  # the post-mortem tells a job stopped on purpose from one that failed
            manifest.data.setdefault("signals_forwarded", []).append(
                {"signal": signal.Signals(signum).name, "t_ns": time.time_ns()})
        except Exception:  # noqa: BLE001
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        if watch:
            try:
                watch.start()
            except Exception as e:  # noqa: BLE001
                notes.append(f"hang watchdog not started ({reason(e)})")
                watch = None
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if watch:
            watch.finish()
    return rc, watch


def _result(rc: int, proc: subprocess.Popen, watch, notes: list[str], probes_ran: bool,
            manifest: _Manifest) -> JobResult:
    """How the job ended in the shell's terms; a job the watchdog terminated ends with
    HANG_EXIT_CODE, its orphaned workers killed."""
    sig = -rc if rc < 0 else None
    code = 128 + sig if sig else rc
    result = JobResult(code, sig, notes, probes_ran=probes_ran, record=manifest)
    if watch and watch.killed:  # we ended it: say so, whatever the job's leader returned
        if _group_alive(proc.pid):
            _killpg(proc.pid, signal.SIGKILL)  # workers orphaned by their launcher
        result.code, result.sig = HANG_EXIT_CODE, None
    return result


def _record_end(out: Path, manifest: _Manifest, rc: int, watch, before: set[str],
                result: JobResult) -> None:
    m = manifest.data
    sig = -rc if rc < 0 else None
    code = 128 + sig if sig else rc
    m.update(end_time=_now(), exit_code=code, signal=sig,
             signal_name=signal.Signals(sig).name if sig else None,
             status="ok" if rc == 0 else ("killed" if sig else "failed"))
    if watch and watch.killed:
        m.update(status="hung", exit_code=HANG_EXIT_CODE, signal=None, signal_name=None,
                 job_exit_code=code, job_signal=sig)
    try:  # every rank's identity and mesh coordinates, gathered from the ranks' meta.json
        entries = collect_rank_entries(out)
        manifest.local_ranks = result.local_ranks = sorted(
            e["rank"] for e in entries["ranks"]
            if e.get("node") == manifest.node and isinstance(e.get("rank"), int))
        m.update(entries)
    except Exception as e:  # noqa: BLE001
        m["rank_entries_error"] = str(e)
    exits = out / worker_exits.STREAM
    if exits.is_file():  # written by the torchrun agent: how each worker ended
        summary = worker_exits.summarize(list(iter_jsonl(exits)))
        if summary["first_failures"]:
            result.first_failures = summary["first_failures"]
            m["first_failures"] = summary["first_failures"]
    files = outdir.inventory(out, before)
    if files is not None:
        m["files"] = files  # what --force may remove later (trainprof/launch/outdir.py)
    manifest.save()


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:
        return None


def exit_like(code: int, sig: int | None) -> None:
    """Leave this process the way the job left: same exit code, or death by the same signal."""
    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except Exception:  # noqa: BLE001 - a closed pipe: the exit status still goes through
            try:
                setattr(sys, name, open(os.devnull, "w"))  # so the final flush cannot fail
            except OSError:
                pass
    if sig:
        try:
            if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these cannot be caught anyway
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        except (OSError, ValueError):
            pass
    os._exit(code) if sig else sys.exit(code)
