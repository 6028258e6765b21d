"""Hang dumps: on request, every rank writes all its threads' Python stacks, its in-flight and
last collectives and PyTorch's flight-recorder trace into its rank directory.

The request is a file, not a signal: a Python signal handler runs only when the main thread
executes bytecode, and a rank stuck in a C collective call never does. The session's ticker
thread (probes/ticker.py) stats RUN/hang-trigger.json every TRAINPROF_HANG_POLL_S (default 1 s;
one stat, no read unless it changed). The launcher writes the trigger (`trainprof wrap --hang-timeout`), and so does
`trainprof hang --dump RUN` for a live job.

Output (ranks/rank-N/):
  hang-dump.json          {trigger_id, t_ns, rank, pid, step, step_started_ns, threads[{thread_id,
                           name, main, daemon, trainprof, frames[{file, line, function, code}]
                           (outermost first)}], last_collective, inflight[], heartbeat{...},
                           flight_recorder{file|error}, complete}
  flight-recorder.pkl     torch's own flight-recorder dump (pickle), or .json when only the JSON
                           variant works. gloo (torch >= 2.8) fills entries but leaves their
                           state 'scheduled' and pg_config keys empty; NCCL fills everything.
The stack dump is written first and rewritten with complete=true after the flight recorder, so a
rank that dies while dumping still leaves its stacks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

from trainprof import settings
from trainprof.probes import runtime
from trainprof.rundir.files import HANG_DUMP, HANG_TRIGGER, write_json_atomic
from trainprof.probes.heartbeat import compact, inflight_records

FR_PICKLE = "flight-recorder.pkl"
FR_JSON = "flight-recorder.json"
ENV_POLL = "TRAINPROF_HANG_POLL_S"
MAX_FRAMES = 200


def attach(session) -> None:
    w = Watchdog(session)
    session.state["hang_watchdog"] = w
    session.on_close(w.stop)
    w.start()


def read_trigger(path: Path) -> dict | None:
    import json

    try:
        with open(path, "rb") as f:
            t = json.loads(f.read())
        return t if isinstance(t, dict) else None
    except (OSError, ValueError):
        return None


def library_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the job's own code: the standard library, torch, and
    trainprof's probes. Frames get lib=true so the post-mortem can name the job's frame."""
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths.get("stdlib"), paths.get("platstdlib"),
            os.path.dirname(os.path.abspath(__file__))}
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        dirs.add(os.path.dirname(os.path.abspath(torch.__file__)))
    return tuple(os.path.join(d, "") for d in dirs if d)


def thread_stacks() -> list[dict]:
    """Every thread's Python stack, outermost frame first."""
    lib = library_dirs()
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.current_thread()
    out = []
    for tid, frame in frames.items():
        if tid == me.ident and me.name.startswith("trainprof-"):
            continue  # the dumping thread itself says nothing about the hang
        t = threads.get(tid)
        name = t.name if t is not None else None
        stack = traceback.extract_stack(frame)[-MAX_FRAMES:]
        out.append({"thread_id": tid, "name": name, "main": tid == main,
                    "daemon": bool(t.daemon) if t is not None else None,
                    "trainprof": bool(name and name.startswith("trainprof-")),
                    "frames": [{"file": fs.filename, "line": fs.lineno, "function": fs.name,
                                "code": fs.line or "",
                                "lib": fs.filename.startswith(lib + ("<frozen",))}
                               for fs in stack]})
    out.sort(key=lambda s: (not s["main"], s["trainprof"], str(s["name"])))
    return out


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def flight_recorder_dump(dir_: Path) -> dict:
    """Write torch's flight-recorder trace next to the stacks. Returns where, or why not."""
    if "torch" not in sys.modules:
        return {"error": "torch not imported"}
    try:
        from torch._C import _distributed_c10d as c10d
    except Exception as e:  # noqa: BLE001
        return {"error": f"torch.distributed unavailable: {e}"}
    # torch >= 2.8 keeps two recorders: _dump_fr_trace holds the gloo (CPU event) one,
    # _dump_nccl_trace the NCCL (CUDA event) one; the other is an empty dump. Take every dump
    # there is and keep the fullest (the one with entries).
    errors, best = [], None
    for group in ((("_dump_fr_trace", FR_PICKLE), ("_dump_nccl_trace", FR_PICKLE)),
                  (("_dump_fr_trace_json", FR_JSON), ("_dump_nccl_trace_json", FR_JSON))):
        for name, fname in group:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            try:
                data = fn()
                if isinstance(data, str):
                    data = data.encode()
                if best is None or len(data) > len(best[2]):
                    best = (name, fname, data)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name}: {type(e).__name__}: {e}")
        if best is not None:
            name, fname, data = best
            write_bytes_atomic(dir_ / fname, data)
            return {"file": fname, "api": name, "bytes": len(data)}
    return {"error": "; ".join(errors) or "no flight-recorder dump function in this torch"}


class Watchdog:
    def __init__(self, session):
        self.session = session
        self.trigger_path = Path(session.run_dir) / HANG_TRIGGER
        try:
            self.poll = max(0.05, settings.value(ENV_POLL))
        except ValueError:
            self.poll = 1.0
        self._seen = self._stat()
        t = read_trigger(self.trigger_path) if self._seen else None
        self.handled = t.get("id") if t else None  # a trigger older than this rank is stale
        self.dumps = 0
        self._stopped = False

    def start(self) -> None:
        self.session.ticker.every(self.poll, self.check)  # the probes' periodic thread

    def stop(self) -> None:
        self._stopped = True

    def _stat(self):
        try:
            st = os.stat(self.trigger_path)
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def check(self) -> None:
        """One poll: a new trigger (one stat; read only when it changed) gets a dump."""
        if self._stopped:
            return
        try:
            st = self._stat()
            if st is None or st == self._seen:
                return
            self._seen = st
            t = read_trigger(self.trigger_path)
            if t is None or t.get("id") == self.handled:
                return
            self.handled = t.get("id")
            self.dump(t)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"hang dump failed: {type(e).__name__}: {e}")

    def dump(self, trigger: dict | None = None) -> Path:
        s = self.session
        hb = s.state.get("heartbeat")
        rec = {"trigger_id": (trigger or {}).get("id"), "trigger": trigger, "t_ns": time.time_ns(),
               "rank": s.rank, "pid": os.getpid(), "step": s.clock.step,
               "step_started_ns": s.clock.start_ns, "threads": thread_stacks(),
               "last_collective": compact(s.state.get("last_collective")),
               "inflight": inflight_records(s.state),
               "heartbeat": dict(hb.last) if hb is not None else None,
               "flight_recorder": None, "complete": False}
        path = s.dir / HANG_DUMP
        try:
            s.flush_streams()  # the streams' queued records belong with the dump
        except Exception:  # noqa: BLE001
            pass
        write_json_atomic(path, rec, indent=None)
        rec["flight_recorder"] = flight_recorder_dump(s.dir)
        rec["complete"] = True
        rec["dump_ms"] = (time.time_ns() - rec["t_ns"]) / 1e6
        write_json_atomic(path, rec, indent=None)
        self.dumps += 1
        runtime.warn(f"rank {s.rank}: hang dump written to {path}")
        return path
