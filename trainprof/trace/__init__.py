"""Profiler-trace parsing: each rank's Chrome trace parsed once into columnar frames.

    traces, errors = load_traces({0: path0, 1: path1})   # parallel processes across ranks
    tr = load_trace(path)                                 # one file; raises TraceError

``Trace`` (one rank) — the schema other modules code against:

- ``rank`` (int | None): ``distributedInfo.rank`` read as a JSON field (never a regex over raw
  text), else the rank the caller gave, else None. ``world_size`` property likewise.
- ``meta`` (dict): the trace's top-level keys except traceEvents (distributedInfo with rank,
  world_size, backend, pg_config; deviceProperties; baseTimeNanoseconds; schemaVersion;
  displayTimeUnit; traceName; record_shapes; profile_memory; ...), plus ``path`` (str) and
  ``span_ns`` ([first event start, last event end] in absolute ns, or None when empty).
- ``tables`` (numpy only, trainprof/trace/_table.py): ``tables.events``, ``.comm``, ``.memory``,
  ``.steps``, each a ``Table`` with the columns below (string columns as ``Cat``: codes into
  sorted distinct values). Analysis code reads these, so that analyzing traces never imports
  pandas. ``events``, ``comm``, ``memory``, ``steps``: the same tables as pandas DataFrames
  (categorical string columns), built on first use.
- ``events``, one row per complete ('X') event, sorted by ts_ns (stable):
    name, cat            strings (cat: cpu_op, user_annotation, python_function,
                         cuda_runtime, cuda_driver, kernel, gpu_memcpy, gpu_memset,
                         gpu_user_annotation, ...)
    ts_ns, dur_ns, end_ns  int64 ns. Absolute epoch ns when the trace has baseTimeNanoseconds
                         (its ts are µs relative to it); otherwise ts*1000 (Kineto's older traces
                         carry absolute epoch µs, so those are absolute too)
    pid, tid             int64 (-1 when not an integer)
    stream               int64 CUDA stream for GPU events, -1 on the host
    is_gpu               bool: cat in kernel/gpu_memcpy/gpu_memset/gpu_user_annotation
    step                 int64 N of the ProfilerStep#N containing the event: host events by
                         their start time, GPU events through the correlation id of the runtime
                         call that launched them (else by time); -1 outside every step, and
                         for kernels/memcpys/memsets whose launch is not in the trace (queued
                         before recording started; counted in stats["gpu_ops_without_launch"])
    correlation, external_id  int64, -1 when absent
    input_dims, input_types   object (lists as recorded, or None; present when record_shapes)
    concrete_inputs      object ("Concrete Inputs": scalar arguments as strings, e.g. is_causal
                         "True"; None when not recorded)
- ``comm``: collective arguments, one row per event that carries them (PyTorch's
    record_param_comms cpu_op, and on newer traces the NCCL kernels themselves):
    row (int64 index into events), and where present collective (str, e.g. "allreduce"),
    in_nelems, out_nelems, group_size, dtype, pg_name (str), pg_desc (str), pg_ranks (list of
    int; the trace's "[0, 1]" string parsed), seq (int64, -1 when absent), coll_rank, src_rank,
    dst_rank. Missing values are None (object columns); a column every row has as an integer
    is int64.
- ``memory``: the ``[memory]`` instant events: ts_ns, bytes, total_allocated,
    total_reserved, device_type, device_id, addr (all int64).
- ``steps``: ProfilerStep spans: step, start_ns, end_ns (int64), sorted. A trace
    without ProfilerStep (no schedule/step()) gets one window, step 0, over the whole trace (every
    event in it) and ``meta["whole_trace_window"] = True``.
- ``launch``: a kernel's launch figures, one row per event with any (Kineto writes them on CUDA
    kernels; ROCm traces have grid and block): row (int64 index into events), grid_blocks and
    block_threads (the products of grid and block), regs_per_thread, shared_mem (bytes),
    blocks_per_sm, warps_per_sm, est_occupancy_pct — float64, NaN where absent.
- Dialects (trainprof/trace/_dialects.py): PyTorch 1.8-1.10 categories (Kernel, Runtime,
  Operator, Memcpy, Memset; "external id"), MTIA (mtia_runtime, mtia_ccp_events), XPU and
  PrivateUse1 runtimes and CUPTI range-profiler spans (cuda_profiler_range) are read under
  today's category names; ``meta["dialect"]`` lists the categories renamed.
- ``stats`` (dict): events (all traceEvents), complete ('X' rows), malformed, decoder.

Helpers: ``Trace.host_events()``, ``Trace.gpu_events()`` (pandas), ``name_mask(col, pred)`` (a
boolean mask computed once per distinct name of a Cat or categorical column: use it instead of
``.str``).
"""

from __future__ import annotations

import importlib

__all__ = ["GPU_CATS", "Trace", "TraceError", "load_trace", "load_traces", "name_mask", "parse_trace"]


_SUBMODULES = ("_columns", "_decode", "_discover", "_document", "_frames")


def __getattr__(name: str):
    # numpy and the decoder load with the first name used (PEP 562): a process that only
    # finds traces (_discover.py) never imports them
    if name.startswith("__") or name in _SUBMODULES:
        raise AttributeError(name)  # a submodule not imported yet: the import system loads it
    frames = importlib.import_module(f"{__name__}._frames")
    try:
        value = getattr(frames, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(dir(importlib.import_module(f"{__name__}._frames"))))
