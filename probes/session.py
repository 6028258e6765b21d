"""ProbeSession: the probes of one rank, wired together.

Capture probes beyond the frame (collectives, memory, heartbeat, NaN watch, telemetry) are
modules listed in ATTACHED_PROBES; each exposes ``attach(session)`` and may register
``session.on_step(fn)`` (called with the closed step's record) and ``session.on_close(fn)``.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
import time
import weakref
from pathlib import Path

from trainprof import settings
from trainprof.probes import compact, job_profiler, profile_ranks, runtime
from trainprof.probes.rankinfo import device_info, identity, mesh_info, process_group_at_exit
from trainprof.probes.steps import StepClock
from trainprof.probes.ticker import Ticker
from trainprof.rundir.files import (JOB_TRACES_DIR, META, STEPS, JsonlWriter, is_job_trace_name,
                                    job_trace_dir, profiler_trace_path, rank_dir, write_json_atomic)
from trainprof.probes.compact import RING_WEIGHTS
from trainprof.probes.profiler_window import ProfilerWindow, parse_steps

DEFAULT_PROFILE_STEPS = "3-4"
MAX_JOB_TRACES = 20  # paths of the job's own profiler traces kept in meta.json (the last ones)
MAX_SPANS = 256      # overhead spans of one kind kept in meta.json (the last ones)

# Probe modules attached to every session, in order. A module that is not present in this
# build is skipped silently; one that fails to attach is reported and skipped.
ENV_PROBES_OFF = "TRAINPROF_PROBES_OFF"
ENV_FLUSH_S = "TRAINPROF_FLUSH_S"  # how often queued stream records are written (seconds)
# the probes' names are settings vocabulary (TRAINPROF_PROBES_OFF names them): trainprof/settings.py
ATTACHED_PROBES: tuple[str, ...] = tuple(f"trainprof.probes.{n}" for n in settings.ATTACHED_PROBE_NAMES)
EARLY_PROBES: tuple[str, ...] = settings.EARLY_PROBE_NAMES


class ProbeSession:
    def __init__(self, run_dir: str, reason: str, run_info: dict | None = None):
        self.pid = os.getpid()
        self.run_dir = Path(run_dir)
        self.meta = identity()
        self.meta["activated_by"] = reason
        if os.environ.get("TRAINPROF_NODE"):  # the launcher (wrap) that started this rank
            self.meta["node"] = os.environ["TRAINPROF_NODE"]
        if run_info:
            self.meta["run_info"] = dict(run_info)
        self.rank = int(self.meta["rank"])
        self.dir = rank_dir(self.run_dir, self.rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._writers: dict[str, JsonlWriter] = {}
        try:
            self.flush_interval = max(0.01, settings.value(ENV_FLUSH_S))
        except ValueError:
            self.flush_interval = 1.0
        # the probes' periodic work (this flush, heartbeats, hang-trigger polls): one thread
        self.ticker = Ticker()
        self._step_listeners: list = []
        self._close_listeners: list = []
        self._meta_lock = threading.Lock()
        self._closed = False
        # Live state probes share (e.g. the collective log's last/in-flight ops for the heartbeat).
        self.state: dict = {}
        self._mesh_numel = 0  # size of the largest DeviceMesh recorded so far
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # every optimizer seen stepping

        self.compact = compact.attach_store(self)
        self.clock = StepClock(self.stream(STEPS), self.stream("steps_device"))
        self.profiler = None
        self.window = self._profile_window()
        _install_job_profiler_guard(self)
        self._maybe_start_profiler()
        # TRAINPROF_PROBES_OFF=collectives,telemetry: leave those probes out (to bisect a cost,
        # or to drop one a job cannot have); recorded in meta so analysis knows what was not watched
        off = {x.strip() for x in os.environ.get(ENV_PROBES_OFF, "").split(",") if x.strip()}
        known = {n.rsplit(".", 1)[-1] for n in ATTACHED_PROBES} | set(EARLY_PROBES)
        if off - known:
            runtime.warn(f"{ENV_PROBES_OFF}: no probe named {', '.join(sorted(off - known))} "
                         f"(known: {', '.join(sorted(known))})")
        if off & known:
            self.meta["probes_off"] = sorted(off & known)
        self.write_meta()
        for name in ATTACHED_PROBES:
            if name.rsplit(".", 1)[-1] not in off:
                self._attach(name)
        self.ticker.every(self.flush_interval, self.flush_streams)
        self.ticker.start()
        atexit.register(self._atexit)

    # -- plumbing other probes use
    def stream(self, name: str) -> JsonlWriter:
        """A deferred JSONL stream of this rank: records are queued on the job's thread and
        written at every step boundary (one write per stream that has records) and by the
        ticker thread every flush interval (what is queued between steps); records that must
        survive a SIGKILL at once are written with ``urgent=True``."""
        if name not in self._writers:
            store = getattr(self, "compact", None)

            if store is not None and name in RING_WEIGHTS:  # a ring within the rank's budget
                self._writers[name] = store.ring_writer(self.dir / f"{name}.jsonl", name)
            else:
                self._writers[name] = JsonlWriter(self.dir / f"{name}.jsonl", deferred=True)
        return self._writers[name]

    def flush_streams(self) -> None:
        for w in list(self._writers.values()):
            w.flush()
        if self.compact is not None:  # the rows the streams' flushes just handed over
            self.compact.flush()

    def on_step(self, fn) -> None:
        self._step_listeners.append(fn)

    def on_close(self, fn) -> None:
        self._close_listeners.append(fn)

    def update_meta(self, **fields) -> None:
        with self._meta_lock:
            self.meta.update(fields)
        self.write_meta()

    def write_meta(self) -> None:
        try:
            with self._meta_lock:
                write_json_atomic(self.dir / META, self.meta)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"could not write {self.dir / META}: {e}")

    def _attach(self, module_name: str) -> None:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                return  # not part of this build
            runtime.warn(f"probe {module_name} disabled: {e}")
            return
        try:
            module.attach(self)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"probe {module_name} disabled: {type(e).__name__}: {e}")

    # -- profiler window
    def _profile_window(self):
        try:
            window = parse_steps(os.environ.get(runtime.ENV_PROFILE_STEPS, DEFAULT_PROFILE_STEPS))
        except ValueError as e:
            runtime.warn(f"profiler window disabled: {e}")
            return None
        if window is not None:
            self.meta["profile_steps"] = list(window)
        return window

    def _maybe_start_profiler(self) -> None:
        """Start the profiler one step ahead of the window (that step is its warm-up)."""
        if self.window is None or self.profiler is not None:
            return
        first, last = self.window
        step = self.clock.step  # the step about to run
        if step < first - 1 or step > last:
            return

        if job_profiler.enabled_now():  # the job's, started before the guard was installed
            self.job_profiler_started({"kind": "profiler", "api": None, "where": None})
            job_profiler.adopt_running()
            return
        if not self._profile_this_rank():
            self.window = None
            return
        try:
            import torch

            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self.profiler = ProfilerWindow(profiler_trace_path(self.run_dir, self.rank),
                                           warmup=first - step, active=last - first + 1, cuda=cuda,
                                           on_span=self.note_span)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"profiler window disabled: {type(e).__name__}: {e}")
            self.window = None

    def _profile_this_rank(self) -> bool:
        """--profile-ranks (TRAINPROF_PROFILE_RANKS, probes/profile_ranks.py): decided once, just
        before the window, when the job's DeviceMesh (if any) is known. Recorded in meta.json
        (``profiled``, ``profile_policy``, ``profile_ranks``) so that analysis knows a trace
        absent on purpose from a lost one."""
        try:
            spec = profile_ranks.canonical(os.environ.get(profile_ranks.ENV))
            mesh = self.meta.get("mesh") or None
            ok, policy = profile_ranks.decide(spec, self.rank, int(self.meta.get("world_size") or 1),
                                              self.meta.get("local_rank"), mesh)
        except Exception as e:  # noqa: BLE001 - a bad spec profiles this rank, as before
            runtime.warn(f"--profile-ranks: {type(e).__name__}: {e}; this rank is profiled")
            ok, policy, spec = True, "all", "all"
        self.update_meta(profiled=ok, profile_policy=policy, profile_ranks=spec)
        return ok

    def _in_window(self, step: int) -> bool:
        return self.window is not None and self.window[0] <= step <= self.window[1]

    def job_profiler_started(self, info: dict) -> None:
        """The job is starting a profiler session of its own (called by probes/job_profiler.py
        before the job's call runs): stop and discard trainprof's window, for good."""
        if self.profiler is not None:
            prof, self.profiler = self.profiler, None
            prof.discard()
        skipped = self.window is not None  # trainprof's window is pending or was running
        self.window = None
        old = self.meta.get("job_profiler")
        if old is not None and not skipped:  # every cycle of the job's schedule comes here
            return
        with self._meta_lock:
            if skipped:
                self.meta.pop("profile_steps", None)
        self.update_meta(job_profiler={**info, "step": self.clock.step, "window_skipped": skipped,
                                       "traces": list((old or {}).get("traces") or [])})
        if skipped and self.rank == 0:
            runtime.warn("the job runs its own profiler: trainprof's profiler window steps aside "
                         "(the analysis uses the job's traces)")

    def note_span(self, kind: str, start_ns: int, end_ns: int | None = None) -> None:
        """A span of wall-clock time (ns) in which trainprof's own work ran beside the job's steps
        (``trace_export``: the profiler window's trace written on a thread of ours; ``nan_replay``)
        or the job's own profiler did (``job_profiler``: from its start to its stop;
        ``job_trace_export``): meta.json ``overhead_spans``, whose steps the analysis leaves out
        of step statistics. ``end_ns`` None: still running (a later call with the same kind and
        start closes it). meta.json is written by the ticker thread: the caller never waits on
        the disk."""
        with self._meta_lock:
            spans = self.meta.setdefault("overhead_spans", [])
            for s in reversed(spans):
                if s["kind"] == kind and s["start_ns"] == start_ns:
                    s["end_ns"] = end_ns
                    break
            else:
                spans.append({"kind": kind, "start_ns": int(start_ns), "end_ns": end_ns})
                same = [s for s in spans if s["kind"] == kind]
                if len(same) > MAX_SPANS:
                    spans.remove(same[0])
        self.ticker.call_soon(self.write_meta)

    def job_profiler_trace(self, path: str) -> None:
        """The job's profiler wrote a Chrome trace: remember where (the last ones)."""
        rec = dict(self.meta.get("job_profiler") or
                   {"kind": "profiler", "step": self.clock.step, "window_skipped": False})
        rec["traces"] = ([p for p in rec.get("traces") or [] if p != path] + [path])[-MAX_JOB_TRACES:]
        self.update_meta(job_profiler=rec)

    def _link_job_trace(self) -> None:
        """Without a trace of its own, hard-link the job's traces into the run directory: the
        last under this rank's name in RUN/profiler/, and each recorded one under its own name
        in RUN/profiler/job/rank-NNNNN/ (meta ``links``), so that the run directory holds every
        window the analysis may choose (links: nothing copied, the job's files stay where they
        are). A file that cannot be linked (another file system, gone) is skipped: the analysis
        follows meta's path."""
        jp = self.meta.get("job_profiler") or {}
        traces = [t for t in jp.get("traces") or [] if isinstance(t, str)]
        own = profiler_trace_path(self.run_dir, self.rank)
        if not traces or own.exists():
            return
        try:
            src = Path(traces[-1])
            with open(src, "rb") as f:
                gz = f.read(2) == b"\x1f\x8b"
            dst = own if gz else own.with_name(own.name[:-len(".gz")])
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
            with self._meta_lock:
                jp["linked"] = dst.name
        except OSError as e:
            runtime.warn(f"job's last trace not linked into the run directory: {e}")
        links = self._link_job_traces(traces)
        if links:
            with self._meta_lock:
                jp["links"] = links

    def _link_job_traces(self, traces: list[str]) -> dict[str, str]:
        """Hard-link each of the job's traces into RUN/profiler/job/rank-NNNNN/ under its own
        name; returns {the job's path: the link's path relative to RUN/profiler/}."""
        d = job_trace_dir(self.run_dir, self.rank)
        links: dict[str, str] = {}
        made = ready = False
        for t in traces:
            src = Path(t)
            if not is_job_trace_name(src.name):
                continue
            dst = d / src.name
            try:
                if not ready:
                    d.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        d.mkdir()
                        made = True
                    except FileExistsError:
                        pass
                    ready = True
                try:
                    os.link(src, dst)
                except FileExistsError:
                    if not os.path.samefile(src, dst):  # another of the job's files: kept as is
                        continue
            except OSError:
                continue  # another file system, or the job's file is gone: meta's path only
            links[t] = f"{JOB_TRACES_DIR}/{d.name}/{src.name}"
        if made and not links:
            try:
                d.rmdir()  # the folder made above, left empty
            except OSError:
                pass
        return links

    # -- events from the job
    def note_mesh(self, mesh) -> None:
        # DTensor and FSDP2 build sub-meshes during every step: skip those before any work
        if mesh.size() <= self._mesh_numel:
            return
        info = mesh_info(mesh)
        current = self.meta.get("mesh") or {}
        if current and _mesh_size(current) >= _mesh_size(info):
            return  # keep the root mesh, not the sub-meshes sliced from it
        self._mesh_numel = max(self._mesh_numel, mesh.size())
        self.update_meta(mesh={k: info[k] for k in ("dim_names", "shape", "coord", "device_type")},
                         coords=info["coords"])

    def on_optimizer_step(self, optimizer) -> None:
        try:
            self.optimizers.add(optimizer)
            if self.clock.on_optimizer_step(optimizer):
                self._boundary()
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"step probe error: {e}")

    def mark_step(self, source: str = "marker") -> None:
        try:
            if self.clock.on_marker():
                self._boundary()
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"step probe error: {e}")

    def _boundary(self) -> None:
        extra = {"profiled": True} if self._in_window(self.clock.step) else None
        if self.clock.step == 0:
            self._refresh_device()
        rec = self.clock.close_step(extra)
        for fn in self._step_listeners:
            try:
                fn(rec)
            except Exception as e:  # noqa: BLE001
                runtime.warn(f"step listener {getattr(fn, '__qualname__', fn)} failed: {e}")
        t0 = time.perf_counter_ns()
        # the step's records go to disk now, on the ticker thread (one write per stream with
        # news; the job's thread never waits on the disk): a job that aborts (a C++ terminate,
        # SIGKILL, torchrun's SIGTERM) keeps every step it finished but the last few ms
        self.ticker.call_soon(self.flush_streams)
        if self.profiler is not None:
            self.profiler.step()  # may export the trace: book that time as probe overhead
            if self.profiler.done:  # exported (or failed: never retried)
                self.profiler, self.window = None, None
        else:
            self._maybe_start_profiler()
        self.clock.overhead_ns += time.perf_counter_ns() - t0

    def _refresh_device(self) -> None:
        """At activation the job may not have chosen its device yet; by the first step it has."""
        info = device_info(int(self.meta.get("local_rank", 0)))
        if info.get("device") != self.meta.get("device"):
            self.update_meta(**info)

    # -- shutdown
    def _atexit(self) -> None:
        if os.getpid() == self.pid:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # each part runs whatever the others do; an exit raised into one of them (the job's
        # signal handler calling sys.exit while we write) is raised again once all have run:
        # a profiler left running at interpreter teardown can crash the process
        pending = None
        for fn in [*self._close_listeners, self._stop_profiler, self._link_job_trace_quietly,
                   self._resolve_device_events, self._final_meta, self.ticker.stop,
                   *[w.close for w in list(self._writers.values())], self._close_compact]:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                runtime.warn(f"close step {getattr(fn, '__qualname__', fn)} failed: {e}")
            except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt
                pending = pending or e
        if pending is not None:
            raise pending

    def _close_compact(self) -> None:
        if self.compact is not None:
            self.compact.close()

    def _stop_profiler(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if "trainprof.probes.profiler_window" in sys.modules:  # its trace export, if pending
            sys.modules["trainprof.probes.profiler_window"].wait_exports()

    def _link_job_trace_quietly(self) -> None:
        try:
            self._link_job_trace()
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"job's trace not linked into the run directory: {type(e).__name__}: {e}")

    def _resolve_device_events(self) -> None:
        try:
            self.clock.resolve_device_events(wait=True)
        except Exception:  # noqa: BLE001
            pass

    def _final_meta(self) -> None:
        self.meta["ended_ns"] = time.time_ns()
        self.meta["steps_recorded"] = self.clock.step
        pg = process_group_at_exit()
        if pg is not None:
            self.meta["process_group_at_exit"] = pg
        self.write_meta()


def _install_job_profiler_guard(session) -> None:
    try:
        job_profiler.install()
        before = job_profiler.started_before_session()
        if before is not None:
            session.job_profiler_started(before)
        for kind, start_ns, end_ns in job_profiler.spans_before_session():
            session.note_span(kind, start_ns, end_ns)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job profiler detection unavailable: {type(e).__name__}: {e}")


def _mesh_size(m: dict) -> int:
    n = 1
    for s in m.get("shape") or []:
        n *= int(s)
    return n
