"""Memory probe: allocator statistics per step, a measured breakdown of model state, and
allocator snapshots (at exit with TRAINPROF_MEMORY_HISTORY=1, and at the moment of an OOM).

Stream `memory`, one record per step boundary:
    {"step", "t_ns", "device", "rss_bytes", "peak_rss_bytes",
     CUDA only: "allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes",
     "inactive_split_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes",
     "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"}
    and {"event": "oom", "t_ns", "step", "device", "alloc_bytes", "device_allocated_bytes",
         "device_free_bytes", "snapshot"} when the caching allocator runs out of memory.
meta.json `memory_breakdown` (measured once, at the second step boundary, from the optimizers'
parameters as this rank holds them — local shards of DTensor/FSDP2 parameters):
    {"params_bytes", "grads_bytes", "optimizer_state_bytes", "n_params_local", "param_dtypes",
     "optimizer_state_dtypes", "step"}
Snapshots: ranks/rank-NNNNN/memory_snapshot.pickle (exit), oom_snapshot.pickle (OOM), in the
format of torch.cuda.memory._dump_snapshot. memory_stats() reads host-side allocator counters:
no device synchronization.

The allocator keeps one history per process. When the job records its own
(torch.cuda.memory._record_memory_history), the job's wins: trainprof does not start its recording
when the job's is already on, and when the job starts one while trainprof's runs, trainprof's is
stopped first (which clears its entries) so the job records exactly what it would without
trainprof. The exit snapshot then holds the job's history. meta.json ``job_memory_history``
says when it happened.
"""

from __future__ import annotations

import functools
import os
import resource
import time

from trainprof import settings
from trainprof.probes import runtime

# torch.cuda.memory_stats() key -> our field
CUDA_STATS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "active_bytes.all.current": "active_bytes",
    "requested_bytes.all.current": "requested_bytes",
    "inactive_split_bytes.all.current": "inactive_split_bytes",
    "allocated_bytes.all.peak": "peak_allocated_bytes",
    "reserved_bytes.all.peak": "peak_reserved_bytes",
    "active_bytes.all.peak": "peak_active_bytes",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    "num_device_alloc": "num_device_alloc",
    "num_device_free": "num_device_free",
}
BREAKDOWN_AT_STEP = 1  # optimizer state exists after the first optimizer step
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: list = [None, None]  # (pid, fd): kept open, one pread per step instead of open/read/close


def rss_bytes() -> int | None:
    try:
        pid = os.getpid()
        if _statm[0] != pid:  # first call, or a forked child: the fd would name the parent
            _statm[:] = [pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)]
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


# the process's high-water RSS either way; RUSAGE_THREAD skips summing every thread's CPU times
_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def peak_rss_bytes() -> int:
    return resource.getrusage(_RUSAGE).ru_maxrss * 1024  # Linux reports KiB


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sample(step: int) -> dict:
    rec = {"step": step, "t_ns": time.time_ns(), "device": "cpu",
           "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes()}
    if _cuda_in_use():
        import torch

        stats = torch.cuda.memory_stats()
        rec["device"] = f"cuda:{torch.cuda.current_device()}"
        for key, field in CUDA_STATS.items():
            if key in stats:
                rec[field] = int(stats[key])
    return rec


def _local(t):
    """The tensor this rank actually holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def model_state_breakdown(optimizers) -> dict:
    import torch

    params, seen = [], set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    out = {"params_bytes": 0, "grads_bytes": 0, "optimizer_state_bytes": 0, "n_params_local": 0,
           "param_dtypes": {}, "optimizer_state_dtypes": {}}
    for p in params:
        n = _nbytes(p)
        out["params_bytes"] += n
        out["n_params_local"] += _local(p).numel()
        dt = str(p.dtype).replace("torch.", "")
        out["param_dtypes"][dt] = out["param_dtypes"].get(dt, 0) + n
        if p.grad is not None:
            out["grads_bytes"] += _nbytes(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:  # skip scalar step counters
                    n = _nbytes(v)
                    out["optimizer_state_bytes"] += n
                    dt = str(v.dtype).replace("torch.", "")
                    out["optimizer_state_dtypes"][dt] = out["optimizer_state_dtypes"].get(dt, 0) + n
    return out


def attach(session) -> None:
    writer = session.stream("memory")
    history = settings.value("TRAINPROF_MEMORY_HISTORY")
    armed = {"cuda": False}
    if history:
        _watch_job_history()

    def on_step(rec) -> None:
        writer.write(sample(rec["step"]))
        if rec["step"] == BREAKDOWN_AT_STEP and len(session.optimizers):
            session.update_meta(memory_breakdown={**model_state_breakdown(list(session.optimizers)),
                                                  "step": rec["step"]})
        if not armed["cuda"] and _cuda_in_use():
            armed["cuda"] = True
            _arm_cuda(session, writer, history)

    session.on_step(on_step)


def _arm_cuda(session, writer, history: bool) -> None:
    import torch

    if history:
        try:
            _start_history(session)
            session.on_close(lambda: _dump(session.dir / "memory_snapshot.pickle"))
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"allocator history unavailable: {e}")

    def on_oom(device, alloc, device_allocated, device_free):
        path = session.dir / "oom_snapshot.pickle"
        writer.write({"event": "oom", "t_ns": time.time_ns(), "step": session.clock.step,
                      "device": int(device), "alloc_bytes": int(alloc),
                      "device_allocated_bytes": int(device_allocated),
                      "device_free_bytes": int(device_free),
                      "snapshot": path.name if _dump(path) else None}, urgent=True)

    try:
        torch._C._cuda_attach_out_of_memory_observer(on_oom)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"OOM observer unavailable: {e}")


# -- the allocator history: trainprof's (TRAINPROF_MEMORY_HISTORY=1) gives way to the job's
_history = {"ours": False, "job": False}  # trainprof's recording is on / the job has called


def _start_history(session) -> None:
    import torch

    if _history["job"] or _job_recording(torch):
        _job_history(session, trainprof_history="not started")
        return
    _original_record(torch)(max_entries=settings.value("TRAINPROF_MEMORY_HISTORY_ENTRIES"))
    _history["ours"] = True


def _original_record(torch):
    f = torch.cuda.memory._record_memory_history
    return getattr(f, "_trainprof_original", f)


def _job_recording(torch) -> bool:
    """The job turned history on before the watch below was installed: the allocator says so
    (torch._C._cuda_isHistoryEnabled, where this torch has it), else its snapshot already holds
    trace entries, or blocks with recorded stack frames."""
    try:
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if enabled is not None:
            return bool(enabled())
        snap = torch.cuda.memory._snapshot()
    except Exception:  # noqa: BLE001
        return False
    if any(snap.get("device_traces") or ()):
        return True
    return any(b.get("frames") for seg in snap.get("segments") or () for b in seg.get("blocks") or ())


def _job_history(session, trainprof_history: str) -> None:
    if session is None or session.meta.get("job_memory_history"):
        return
    session.update_meta(job_memory_history={"step": session.clock.step,
                                            "trainprof_history": trainprof_history})
    runtime.warn("the job records its own CUDA allocator history: TRAINPROF_MEMORY_HISTORY "
                 "gives way to it (the exit snapshot holds the job's recording)")


def _watch_job_history() -> None:
    """Wrap torch.cuda.memory._record_memory_history so that the job's first call stops
    trainprof's recording (clearing its entries) before the job's call runs unchanged."""
    try:
        import torch.cuda.memory as tcm

        original = tcm._record_memory_history
        if hasattr(original, "_trainprof_original"):
            return

        @functools.wraps(original)
        def _record_memory_history(*args, **kwargs):
            try:
                if not _history["job"]:
                    _history["job"] = True
                    stopped = _history["ours"]
                    if stopped:
                        _history["ours"] = False
                        original(None)  # off: drops trainprof's entries
                    _job_history(runtime.active(), "stopped" if stopped else "not started")
            except Exception as e:  # noqa: BLE001
                runtime.warn(f"allocator history hand-over: {type(e).__name__}: {e}")
            return original(*args, **kwargs)

        _record_memory_history._trainprof_original = original
        tcm._record_memory_history = _record_memory_history
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job allocator history detection unavailable: {type(e).__name__}: {e}")


def _dump(path) -> bool:
    try:
        import torch

        torch.cuda.memory._dump_snapshot(str(path))
        return True
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"memory snapshot failed: {e}")
        return False
