"""HTA's numbers for one rank's GPU trace: get_temporal_breakdown (idle / compute / non-compute %
of the window) and get_comm_comp_overlap (% of communication time overlapped with compute), as
HTA (traceinsight 0.6.1) computes them; comm_compute reports them per rank beside its own
breakdown (analyzers/_comm_breakdown.py). The differences from HTA's own definitions:
docs/comm-compute.md."""

from __future__ import annotations

import re

import numpy as np


# HTA's kernel classes (hta/common/types.py, re.match on the name) and the categories its
# breakdown counts: events with a "stream" argument
_HTA_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_sync")
_HTA_STEP = re.compile(r"^ProfilerStep#(\d+)")
_HTA_COMM = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
_HTA_MEM = re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(
    r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)"
    r"|(^runFunction)|(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)"
    r"|(^collective_subgraph_execution)")


def _hta_merge(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HTA's merge_kernel_intervals: sorted by start, an interval joins the group before it
    unless it starts after every end seen so far; a group spans min start .. max end. A sub-µs
    op that HTA's rounding turns into a negative length (start rounded up past its end rounded
    down) counts as zero length here; HTA counts it negative, which can make its busy time of
    all ops less than that of the compute kernels alone (it then fails an assertion)."""
    if not len(s):
        return s, e
    e = np.maximum(e, s)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    first = np.ones(len(s), bool)
    first[1:] = s[1:] > np.maximum.accumulate(e)[:-1]
    idx = np.flatnonzero(first)
    return s[idx], np.maximum.reduceat(e, idx)


def _hta_overlap(comm: tuple, comp: tuple) -> int:
    """HTA's overlap sweep: +1/-1 at communication starts/ends, +2/-2 at compute ones; time
    while the running sum is 3."""
    t = np.concatenate([comm[0], comm[1], comp[0], comp[1]])
    d = np.concatenate([np.full(len(comm[0]), 1), np.full(len(comm[1]), -1),
                        np.full(len(comp[0]), 2), np.full(len(comp[1]), -2)])
    if not len(t):
        return 0
    order = np.argsort(t, kind="stable")
    t, run = t[order], np.cumsum(d[order])
    m = run[:-1] == 3
    return int((t[1:][m] - t[:-1][m]).sum())


def hta_view(ev, base_ns: int = 0) -> dict | None:
    """HTA's get_temporal_breakdown (idle / compute / non-compute % of the window) and
    get_comm_comp_overlap (% of communication time overlapped with compute), computed the way
    HTA (traceinsight 0.6.1) does:

    - its GPU ops: kernels, memcpys, memsets and CUDA synchronization events (cuda_sync);
    - when the trace has two or more distinct ``ProfilerStep#N`` names: only those launched (same
      correlation id) by a host event that starts before the latest ProfilerStep event — the
      GPU timeline's ProfilerStep annotation included — so the last profiled iteration, and ops
      queued before recording started, are left out; otherwise every GPU op of the trace;
    - timestamps in whole µs of the trace: start rounded up, end down;
    - window = first op start .. end of the last-starting group of overlapping ops; idle = window
      − merged busy time; compute = merged time of compute kernels (not NCCL, memcpy/memset,
      synchronization); non-compute = the rest.

    ``ev``: a trace's events Table. ``overlap_pct`` is 0.0 when there is no communication
    kernel (HTA divides 0 by 0: NaN)."""
    is_gpu = ev["cat"].isin(_HTA_GPU_CATS)
    if not is_gpu.any():
        return None
    ts, end = ev["ts_ns"], ev["end_ns"]
    up = lambda a: -((base_ns - a) // 1000)  # noqa: E731 - ceil to whole µs
    corr = ev["correlation"]
    name = ev["name"]
    step_names = name.value_mask(lambda n: _HTA_STEP.match(n) is not None)
    is_step = step_names[name.codes] if len(step_names) else np.zeros(len(ts), bool)
    if np.count_nonzero(np.bincount(name.codes[is_step])) >= 2:  # two distinct step names
        # HTA's host events: all but the GPU ops with a correlation id
        host = ~(is_gpu & (corr >= 0))
        before = up(ts) < up(int(ts[host & is_step].max()))
        launched = np.isin(corr, corr[host & before & (corr >= 0)])
        keep = is_gpu & (((corr >= 0) & launched) | ((corr < 0) & before))
    else:
        keep = is_gpu
    if not keep.any():
        return None
    kname = name[keep]
    comm_m = kname.mask(lambda n: _HTA_COMM.match(n) is not None)
    mem_m = kname.mask(lambda n: _HTA_MEM.match(n) is not None)
    comp_m = ~comm_m & ~mem_m & kname.mask(lambda n: _HTA_NOT_COMPUTE.match(n) is None)
    s, e = up(ts[keep]), (end[keep] - base_ns) // 1000
    alls, comp, comm = _hta_merge(s, e), _hta_merge(s[comp_m], e[comp_m]), _hta_merge(s[comm_m], e[comm_m])
    window = int(alls[1][-1] - alls[0][0])
    if window <= 0:
        return None
    busy, comp_t, comm_t = (int((x[1] - x[0]).sum()) for x in (alls, comp, comm))
    pct = lambda x: round(100 * (x / window), 2)  # noqa: E731
    return {"idle_pct": pct(window - busy), "compute_pct": pct(comp_t),
            "non_compute_pct": pct(busy - comp_t),
            "overlap_pct": round(100 * (_hta_overlap(comm, comp) / comm_t), 2) if comm_t else 0.0}
