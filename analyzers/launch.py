"""Is the device starved? Idle time and kernel launches on GPU traces, per rank.

- Idle-time breakdown, per CUDA stream, HTA's definitions (hta/analyzers/breakdown_analysis.py
  ``get_idle_time_breakdown``): the GPU ops of a stream (kernels, memcpys, memsets) in start
  order; the gap before each op is idle time, classified as
  host wait   the op's runtime launch call started after the previous op had ended: the host
              had not enqueued it yet;
  kernel wait otherwise, a gap shorter than ``KERNEL_WAIT_NS`` (launch latency between
              back-to-back ops);
  other       the rest (the op was queued but waited, e.g. on an event from another stream).
- Device idle: time within the profiled steps' GPU window (first op start .. last op end) with
  no GPU op running on any stream, as a share of that window.
- Launch statistics (HTA's ``get_cuda_kernel_launch_stats`` and ``get_queue_length_summary``):
  per GPU op and its runtime call (same correlation id): launch delay = op start − call end,
  call duration vs op duration, short kernels, kernels per step, queue length per stream.
- A starved device is a finding: idle ≥ ``STARVED_IDLE`` of the window and host wait ≥
  ``HOST_WAIT_SHARE`` of the main stream's idle time; the host's step time says why: the data
  loader (``enumerate(DataLoader)`` spans), blocking synchronizations, or launch overhead.

Each rank's trace is reduced by ``trace_digest`` (small: per-step sums, per-stream rows,
summary statistics); ``analyze`` combines the digests. ``hta`` in a digest holds the same
breakdown computed exactly as HTA computes it (its event selection, whole-µs timestamps) for
cross-checks. Definitions and the differences from HTA: docs/launch.md.
"""

from __future__ import annotations

import collections

import numpy as np

from trainprof.analyzers import _gpu_calls
from trainprof.analyzers import _intervals as iv
from trainprof.analyzers import estimates
from trainprof.analyzers._stats import median, percentiles
from trainprof.analyzers._kernel_ops import LAUNCHED, launch_calls
from trainprof.findings import AnalyzerResult, Finding
from trainprof.trace.threads import main_thread

NAME = "launch"
KERNEL_WAIT_NS = 30_000        # HTA's consecutive_kernel_delay default: 30 in the trace's µs
SHORT_KERNEL_NS = 10_000       # a kernel shorter than this is "short"
RUNTIME_OUTLIER_NS = 50_000    # HTA's runtime_cutoff (50 µs)
LAUNCH_DELAY_OUTLIER_NS = 100_000  # HTA's launch_delay_cutoff (100 µs)
STARVED_IDLE = 0.50            # device idle ≥ this share of the profiled window ...
HOST_WAIT_SHARE = 0.50         # ... and host wait ≥ this share of the main stream's idle time
DATA_SHARE = 0.30              # host step time in the data loader: data-loader-bound
SYNC_SHARE = 0.30              # host step time blocked in synchronizations: synchronization-bound
OUTSIDE_SHARE = 0.30           # host step time outside the GPU's window of the step (before its
                               # first op, after its last): bound by host work the GPU never sees
MAX_STREAMS, MAX_STEPS, MAX_HTA_STREAMS = 8, 64, 32  # digest bounds
HTA_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync")
# host calls that block until the device catches up (as in analyzers/_comm_breakdown.py)
SYNC_CALLS = _gpu_calls.SYNC_CALLS  # CUDA and HIP
DATA_PREFIX = "enumerate(DataLoader)"


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 4)


def _us(ns) -> float:
    return round(float(ns) / 1e3, 3)


# --------------------------------------------------------------------------- idle breakdown
NO_LAUNCH = np.iinfo(np.int64).min  # launch_ts of an op whose launch call is not in the trace


def idle_by_stream(stream, ts, end, launch_ts, threshold) -> dict[int, dict]:
    """HTA's per-stream idle breakdown. ``launch_ts``: start of each op's runtime launch call
    (``NO_LAUNCH`` when not in the trace). Integer times in the caller's unit (ns, or HTA's
    whole µs): epoch ns do not fit a float64's 53 bits."""
    stream, ts, end, launch_ts = (np.asarray(a, dtype=np.int64) for a in (stream, ts, end, launch_ts))
    out = {}
    for s in np.unique(stream, return_counts=True)[0]:
        m = np.flatnonzero(stream == s)
        m = m[np.argsort(ts[m], kind="stable")]
        t, e, r = ts[m], end[m], launch_ts[m]
        prev = e[:-1]
        gap = t[1:] - prev
        host = r[1:] > prev
        kern = ~host & (gap < threshold)
        other = ~host & ~kern
        out[int(s)] = {"ops": int(len(m)), "busy": int(iv.length(iv.union(t, e))),
                       "host_wait": int(gap[host].sum()), "kernel_wait": int(gap[kern].sum()),
                       "other": int(gap[other].sum())}
    return out


def _queue(stream, launch_ts, op_ts) -> dict[int, dict]:
    """HTA's queue length per stream: +1 at each launch call, −1 when its op starts; count,
    mean over the change points (as HTA's summary does) and max."""
    out = {}
    stream = np.asarray(stream)
    for s in np.unique(stream, return_counts=True)[0]:
        m = stream == s
        t = np.concatenate([launch_ts[m], op_ts[m]])
        d = np.concatenate([np.ones(int(m.sum()), np.int64), -np.ones(int(m.sum()), np.int64)])
        order = np.argsort(t, kind="stable")
        q = np.cumsum(d[order])
        out[int(s)] = {"count": int(len(q)), "mean": round(float(q.mean()), 4), "max": int(q.max())}
    return out


# --------------------------------------------------------------------------- per-rank digest
def _stats_us(ns: np.ndarray) -> dict:
    if not len(ns):
        return {}
    p = percentiles(ns, (50, 95))
    return {"mean_us": _us(ns.mean()), "p50_us": _us(p[0]), "p95_us": _us(p[1]), "max_us": _us(ns.max())}


def _host_steps(trace) -> list[dict]:
    """Per profiled step: host span, time in the data loader (main thread) and in blocking
    synchronizations, from the host events."""
    ev = trace.tables.events
    step = ev["step"]
    s_all, e_all = ev["ts_ns"], ev["end_ns"]
    name = ev["name"]
    data_m = ~ev["is_gpu"] & name.startswith(DATA_PREFIX) & (ev["tid"] == main_thread(ev))
    data = iv.union(s_all[data_m], e_all[data_m])
    rt = ev["cat"].isin(["cuda_runtime", "cuda_driver"])
    sync_m = rt & name.isin(SYNC_CALLS)
    cp = ev["cat"].eq("gpu_memcpy") & name.mask(lambda n: "DtoH" in n and "Pageable" in n)
    if cp.any():  # cudaMemcpyAsync into pageable memory blocks like a synchronous copy
        pageable = ev["correlation"][cp]
        sync_m |= rt & name.isin(_gpu_calls.ASYNC_COPIES) & np.isin(ev["correlation"], pageable)
    sync = iv.union(s_all[sync_m], e_all[sync_m])
    steps = trace.tables.steps
    calls = collections.Counter(np.asarray(step)[np.asarray(sync_m)].tolist())  # one pass, not one per step
    # a call that waits for the device (a sync, a blocking copy) is the step's work, not set-up
    own = np.asarray(rt & ~sync_m)
    longest = _longest_by_step(np.asarray(step)[own], np.asarray(ev["dur_ns"])[own])
    out = []
    for st, lo, hi in zip(steps["step"].tolist(), steps["start_ns"].tolist(),
                          steps["end_ns"].tolist()):
        out.append({"step": st, "host_ns": hi - lo,
                    "data_ns": iv.length(iv.clip(data, lo, hi)),
                    "sync_ns": iv.length(iv.clip(sync, lo, hi)),
                    "sync_calls": calls.get(st, 0),
                    # the longest runtime call that does not wait for the device: ≥
                    # START_UP_CALL_MS is start-up, not steady state
                    "max_call_ns": longest.get(st, 0)})
    return out


def _longest_by_step(steps: np.ndarray, durs: np.ndarray) -> dict[int, int]:
    """step -> the longest duration among the events of that step (one pass)."""
    if not len(steps):
        return {}
    u, inv = np.unique(steps, return_inverse=True)
    m = np.zeros(len(u), dtype=np.int64)
    np.maximum.at(m, inv, durs.astype(np.int64))
    return {int(k): int(v) for k, v in zip(u.tolist(), m.tolist())}


def _hta_view(trace, launched: np.ndarray, rt_rows: np.ndarray) -> dict:
    """The idle breakdown, launch statistics and queue length exactly as HTA computes them:
    GPU ops of every profiled step but the last (all of them when the trace has fewer than two
    ProfilerSteps), timestamps in whole µs of the trace (start rounded up, end down)."""
    ev = trace.tables.events
    base = trace.meta.get("baseTimeNanoseconds")
    base = int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0
    ts, end = ev["ts_ns"], ev["end_ns"]
    up = lambda a: -((base - a) // 1000)  # noqa: E731 - ceil to whole µs
    down = lambda a: (a - base) // 1000  # noqa: E731 - floor to whole µs
    n_prof = 0 if trace.meta.get("whole_trace_window") else len(trace.tables.steps)
    sel = launched.copy()
    if n_prof >= 2:
        # HTA keeps the host events that start before the last ProfilerStep event (the GPU
        # timeline's ProfilerStep annotations included) and the GPU ops launched by them
        ps = ev["name"].startswith("ProfilerStep")
        last = up(int(ts[ps].max()))
        lr = rt_rows
        ok = lr >= 0
        ok[ok] = up(ts[lr[ok]]) < last
        sel[np.flatnonzero(launched)[~ok]] = False
    rows = np.flatnonzero(sel)
    if not len(rows):
        return {}
    r = rt_rows[sel[launched]]
    has = r >= 0
    lts = np.full(len(rows), NO_LAUNCH, np.int64)
    lts[has] = up(ts[r[has]])
    s, e = up(ts[rows]), down(end[rows])
    idle = idle_by_stream(ev["stream"][rows], s, e, lts, KERNEL_WAIT_NS // 1000)
    api = has.copy()
    api[has] = ev["name"][r[has]].isin(HTA_LAUNCH_CALLS)
    rr = r[api]
    cs, cd = up(ts[rr]), down(end[rr]) - up(ts[rr])
    gs, gd = s[api], (e - s)[api]
    launch = {"n": int(api.sum()), "sum_cpu_us": int(cd.sum()), "sum_gpu_us": int(gd.sum()),
              # HTA's launch_delay column: gpu start − cpu start − cpu duration, clipped at 0
              "sum_delay_us": int(np.maximum(gs - cs - cd, 0).sum())}
    q_all = has  # HTA's queue: launch calls of its runtime-launch set with an op in the trace
    q = _queue(ev["stream"][rows][q_all], up(ts[r[q_all]]), s[q_all])
    keep = sorted(idle, key=lambda k: -idle[k]["ops"])[:MAX_HTA_STREAMS]
    return {"idle_us": {str(k): {c: idle[k][c] for c in ("host_wait", "kernel_wait", "other")}
                        for k in sorted(keep)},
            "launch": launch, "queue": {str(k): v for k, v in q.items() if k in keep},
            "streams_total": len(idle)}


def _main_stream(ev, rows: np.ndarray, per_stream: dict) -> int:
    """The stream with the most compute time (busy time of ops other than NCCL's, whose
    kernels wait for peers and whose gaps say nothing about the host); any stream else."""
    st = ev["stream"][rows]
    comp = ~ev["name"][rows].mask(lambda n: "nccl" in n.lower())
    s, e = ev["ts_ns"][rows], ev["end_ns"][rows]
    busy = {k: iv.length(iv.union(s[comp & (st == k)], e[comp & (st == k)])) for k in per_stream}
    return max(per_stream, key=lambda k: (busy[k], per_stream[k]["busy"], -k))


def trace_digest(run, rank, trace) -> dict:
    """One rank's trace reduced to what ``analyze`` needs (JSON-able, bounded)."""
    ev = trace.tables.events
    launched = ev["cat"].isin(LAUNCHED)
    host = _host_steps(trace)
    host_rows = [{"step": h["step"], "host_ms": _ms(h["host_ns"]), "data_ms": _ms(h["data_ns"]),
                  "sync_ms": _ms(h["sync_ns"]), "sync_calls": h["sync_calls"],
                  "max_call_ms": _ms(h["max_call_ns"])} for h in host]
    if not launched.any():
        return {"kind": "cpu", "steps": len(host), "per_step": host_rows[:MAX_STEPS]}
    step = ev["step"]
    sel = launched & (step >= 0)
    rows = np.flatnonzero(sel)
    all_rt = launch_calls(ev, np.flatnonzero(launched))
    rt = all_rt[sel[launched]]
    ts, end, dur = ev["ts_ns"], ev["end_ns"], ev["dur_ns"]
    stream = ev["stream"]
    out = {"kind": "gpu", "steps": len(host), "gpu_ops": int(len(rows)),
           "gpu_ops_without_launch_call": int((rt < 0).sum()),
           "hta": _hta_view(trace, launched, all_rt)}
    if not len(rows):
        out["per_step"] = host_rows[:MAX_STEPS]
        return out
    s, e = ts[rows], end[rows]
    has = rt >= 0
    lts = np.full(len(rows), NO_LAUNCH, np.int64)
    lts[has] = ts[rt[has]]
    # -- idle: per stream (HTA's categories) and on the device (no op on any stream)
    per_stream = idle_by_stream(stream[rows], s, e, lts, KERNEL_WAIT_NS)
    queue = _queue(stream[rows][has], ts[rt[has]], s[has])
    for k, q in queue.items():
        per_stream[k]["queue_mean"], per_stream[k]["queue_max"] = q["mean"], q["max"]
    window = int(e.max() - s.min())
    busy = iv.length(iv.union(s, e))
    main = _main_stream(ev, rows, per_stream)
    streams = sorted(per_stream.items(), key=lambda kv: -kv[1]["busy"])
    stream_rows = [{"stream": k, "ops": v["ops"], "busy_ms": _ms(v["busy"]),
                    "host_wait_ms": _ms(v["host_wait"]), "kernel_wait_ms": _ms(v["kernel_wait"]),
                    "other_ms": _ms(v["other"]), "queue_mean": v.get("queue_mean"),
                    "queue_max": v.get("queue_max")} for k, v in streams[:MAX_STREAMS]]
    # -- launches: each op against its runtime call
    is_kernel = ev["cat"][rows].eq("kernel")
    cpu_d = dur[rt[has]]
    gpu_d = dur[rows][has]
    delay = np.maximum(s[has] - end[rt[has]], 0)  # a kernel may start before its call returns
    # the launch APIs by name (a Cat's values are sorted: code order is name order)
    codes, counts = np.unique(ev["name"].codes[rt[has]], return_counts=True)
    names = [ev["name"].values[c] for c in codes.tolist()]
    kd = dur[rows][is_kernel]
    launch = {"launches": int(has.sum()), "launch_delay": _stats_us(delay),
              "launch_call": _stats_us(cpu_d), "gpu_op": _stats_us(gpu_d),
              "shorter_than_launch_call": int((gpu_d < cpu_d).sum()),
              "launch_call_over_50us": int((cpu_d > RUNTIME_OUTLIER_NS).sum()),
              "launch_delay_over_100us": int((delay > LAUNCH_DELAY_OUTLIER_NS).sum()),
              "launch_calls_ms": _ms(cpu_d.sum()),
              "apis": {str(n): int(c) for n, c in sorted(zip(names, counts), key=lambda x: -x[1])[:6]},
              "kernels": int(is_kernel.sum()), "kernel": _stats_us(kd),
              "short_kernels": int((kd < SHORT_KERNEL_NS).sum())}
    # -- per step: ops launched in the step
    rstep = step[rows]
    ops_by_step = {}
    for st in np.unique(rstep, return_counts=True)[0]:
        m = rstep == st
        u = iv.union(s[m], e[m])
        w = int(e[m].max() - s[m].min())
        ops_by_step[int(st)] = {"kernels": int((m & is_kernel).sum()), "gpu_ops": int(m.sum()),
                                "gpu_busy_ms": _ms(iv.length(u)), "gpu_window_ms": _ms(w),
                                "gpu_idle_ms": _ms(w - iv.length(u)),
                                "launch_calls_ms": _ms(cpu_d[m[has]].sum())}
    per_step = [{**h, **ops_by_step.get(h["step"], {"kernels": 0, "gpu_ops": 0})} for h in host_rows]
    out.update({"window_ms": _ms(window), "busy_ms": _ms(busy), "idle_ms": _ms(window - busy),
                "idle_fraction": round((window - busy) / window, 4) if window else 0.0,
                "main_stream": main, "streams": stream_rows, "streams_total": len(per_stream),
                "idle_ms_all_streams": {c: _ms(sum(v[c] for v in per_stream.values()))
                                        for c in ("host_wait", "kernel_wait", "other")},
                "launch": launch, "per_step": per_step[:MAX_STEPS]})
    return out


# --------------------------------------------------------------------------- job
def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _rank_row(rank: int, d: dict) -> dict:
    main = next((s for s in d["streams"] if s["stream"] == d["main_stream"]), d["streams"][0])
    idle = main["host_wait_ms"] + main["kernel_wait_ms"] + main["other_ms"]
    steps = [p for p in d["per_step"] if p.get("host_ms")]
    start_up = estimates.start_up_steps(steps)
    if start_up and len(start_up) < len(steps):  # steady-state steps judged alone
        steps = [p for p in steps if p not in start_up]
    n = max(len(steps), 1)
    host_ms = sum(p["host_ms"] for p in steps)
    la = d["launch"]
    share = lambda k: round(main[k] / idle, 4) if idle > 0 else 0.0  # noqa: E731
    return {
        "rank": rank, "idle_fraction": d["idle_fraction"], "gpu_window_ms": d["window_ms"],
        "main_stream": d["main_stream"], "host_wait_share": share("host_wait_ms"),
        "kernel_wait_share": share("kernel_wait_ms"), "other_share": share("other_ms"),
        "kernels_per_step": round(sum(p.get("kernels", 0) for p in steps) / n, 1),
        "mean_kernel_us": (la.get("kernel") or {}).get("mean_us"),
        "short_kernel_share": round(la["short_kernels"] / la["kernels"], 4) if la["kernels"] else None,
        "host_ms_per_step": round(host_ms / n, 3),
        "gpu_busy_ms_per_step": round(sum(p.get("gpu_busy_ms", 0.0) for p in steps) / n, 3),
        "launch_calls_ms_per_step": round(sum(p.get("launch_calls_ms", 0.0) for p in steps) / n, 3),
        # the host's time in the step outside the window of the GPU ops it launched, and the
        # device's idle share inside those windows (the gaps between steps' windows left out)
        "outside_ms_per_step": round(sum(max(0.0, p["host_ms"] - p["gpu_window_ms"]) for p in steps
                                         if p.get("gpu_window_ms") is not None) / n, 3),
        "step_window_idle_fraction": _ratio(sum(p.get("gpu_idle_ms") or 0.0 for p in steps),
                                            sum(p.get("gpu_window_ms") or 0.0 for p in steps)),
        "data_share": round(sum(p["data_ms"] for p in steps) / host_ms, 4) if host_ms else 0.0,
        "sync_share": round(sum(p["sync_ms"] for p in steps) / host_ms, 4) if host_ms else 0.0,
        "launch_delay_p50_us": (la.get("launch_delay") or {}).get("p50_us"),
        "launch_call_mean_us": (la.get("launch_call") or {}).get("mean_us"),
        **({"start_up_steps": [p["step"] for p in start_up]} if start_up else {}),
        # every profiled step is start-up (context set-up, first-call compilation): not judged
        **({"start_up": True, "longest_call_ms": max(p["max_call_ms"] for p in start_up)}
           if start_up and len(start_up) == len(d["per_step"]) else {}),
    }


def cause(row: dict) -> str | None:
    """Why the device of a rank is starved (None: it is not): 'data_loader', 'synchronization'
    or 'launch'."""
    if row.get("start_up"):  # start-up is not steady state
        return None
    # the data loader: whenever taking it off the critical path saves enough of the step,
    # whatever the device idle (analyzers/estimates.py)
    data = estimates.data_loading_trace(row)
    if data and data["saving_fraction"] >= estimates.MIN_SAVING:
        return "data_loader"
    # host work outside the GPU's window (input preprocessing on the training thread): the
    # window itself is busy, the step is not (a window as idle as the step is launch overhead
    # or synchronizations spread over the step: below)
    host, outside = row.get("host_ms_per_step"), row.get("outside_ms_per_step")
    inside = row.get("step_window_idle_fraction")
    if host and outside and outside >= OUTSIDE_SHARE * host and inside is not None \
            and inside < STARVED_IDLE:
        est = estimates.host_work_moved(row)
        if est and est["saving_fraction"] >= estimates.MIN_SAVING:
            return "host_work"
    if row["idle_fraction"] < STARVED_IDLE or row["host_wait_share"] < HOST_WAIT_SHARE:
        return None
    if row["data_share"] >= DATA_SHARE:
        return "data_loader"
    if row["sync_share"] >= SYNC_SHARE:
        return "synchronization"
    return "launch"


def analyze(run) -> AnalyzerResult:
    digests = run.trace_digests(NAME)
    if not digests:
        return AnalyzerResult()
    gpu = {r: d for r, d in sorted(digests.items()) if d.get("kind") == "gpu" and d.get("streams")}
    if not gpu:
        unlaunched = any(d.get("kind") == "gpu" for d in digests.values())
        return AnalyzerResult(metrics={"job": {
            "trace_kind": "gpu" if unlaunched else "cpu", "ranks": len(digests),
            "note": ("the traces hold GPU ops but none launched inside a profiled step: no "
                     "idle-time or launch analysis" if unlaunched else
                     "no GPU kernels in the traces (CPU-only run): no device to be idle, no "
                     "kernel launches to measure")}})
    per_rank = [_rank_row(r, d) for r, d in gpu.items()]
    for row in per_rank:
        row["starved"] = cause(row)
    streams = [{"rank": r, **s} for r, d in gpu.items() for s in d["streams"]]
    launch = [{"rank": r, **{k: v for k, v in d["launch"].items()}} for r, d in gpu.items()]
    per_step = [{"rank": r, **p} for r, d in gpu.items() for p in d["per_step"]]
    def med(k):
        return round(float(median([x[k] for x in per_rank if x[k] is not None] or [0])), 4)

    job = {"trace_kind": "gpu", "ranks": len(per_rank), "cpu_only_ranks": len(digests) - len(gpu),
           **{k: med(k) for k in ("idle_fraction", "host_wait_share", "kernel_wait_share",
                                  "other_share", "kernels_per_step", "host_ms_per_step")},
           "starved_ranks": [x["rank"] for x in per_rank if x["starved"]]}
    start_up = [x for x in per_rank if x.get("start_up")]
    if start_up:  # said plainly: the window shows start-up, which is no steady state to judge
        job["start_up"] = {"ranks": [x["rank"] for x in start_up],
                           "longest_call_ms": max(x["longest_call_ms"] for x in start_up),
                           "text": start_up_text(start_up)}
    metrics = {"job": job, "per_rank": per_rank, "streams": streams, "launch": launch,
               "per_step": per_step,
               "hta": {str(r): d["hta"] for r, d in gpu.items() if d.get("hta")},
               "thresholds": {"starved_idle": STARVED_IDLE, "host_wait_share": HOST_WAIT_SHARE,
                              "data_share": DATA_SHARE, "sync_share": SYNC_SHARE,
                              "kernel_wait_us": KERNEL_WAIT_NS / 1e3,
                              "short_kernel_us": SHORT_KERNEL_NS / 1e3},
               "definitions": "docs/launch.md"}
    return AnalyzerResult(metrics=metrics, findings=_findings(per_rank, gpu))


def start_up_text(rows: list[dict]) -> str:
    longest = max(x["longest_call_ms"] for x in rows)
    n = len(rows)
    return (f"the profiled steps of {n} rank{'s' * (n != 1)} are start-up, not steady state: a "
            f"runtime call of {longest / 1e3:.2f} s (CUDA context set-up, module loading or "
            f"first-call compilation; ≥ {estimates.START_UP_CALL_MS:g} ms); idle and launch "
            "figures are not diagnosed there — profile later steps (schedule(wait=…, warmup=…))")


_ADVICE = {
    "launch": ("launch-bound: the host cannot enqueue kernels as fast as the GPU runs them — "
               "larger batches, CUDA graphs or torch.compile (fewer, larger kernels)"),
    "data_loader": ("data-loader-bound: the step's host time is spent waiting for the next batch "
                    "— more DataLoader workers, pin_memory, prefetching, or cheaper preprocessing"),
    "synchronization": ("synchronization-bound: the host blocks on the device (.item(), .cpu(), "
                        "synchronize, device-to-host copies) so it cannot run ahead — move those "
                        "reads out of the step or make them less frequent"),
    "host_work": ("bound by host work outside the GPU's window: the host runs the step's other "
                  "work (input preprocessing, Python) before the first kernel or after the "
                  "last — move it into DataLoader workers (dataset transforms) or overlap it "
                  "with the GPU's work"),
}


def _idle(row: dict, why: str) -> float:
    """The device's idle share said in the finding: of the GPU's window, or for host work
    outside that window, of the whole host step."""
    host, busy = row.get("host_ms_per_step"), row.get("gpu_busy_ms_per_step")
    if why == "host_work" and host and busy is not None:
        return max(0.0, 1.0 - busy / host)
    return row["idle_fraction"]


def _findings(per_rank: list[dict], gpu: dict) -> list[Finding]:
    out = []
    for why in ("launch", "data_loader", "synchronization", "host_work"):
        rows = [r for r in per_rank if r["starved"] == why]
        if not rows:
            continue
        w = max(rows, key=lambda r: r["idle_fraction"])
        mean = f"{w['mean_kernel_us']:.1f} µs" if w["mean_kernel_us"] is not None else "?"
        extra = {"data_loader": f", {w['data_share']:.0%} of it in the data loader",
                 "synchronization": f", {w['sync_share']:.0%} of it blocked in synchronizations",
                 "launch": f", {w['launch_calls_ms_per_step']:.1f} ms of it in launch calls",
                 "host_work": f", {w['outside_ms_per_step']:.1f} ms of it outside the GPU's "
                              f"window ({w['gpu_busy_ms_per_step']:.1f} ms of GPU work a step)"}[why]
        ranks = [r["rank"] for r in rows]
        where = f"rank {w['rank']}" + (f" (worst of {len(rows)} ranks)" if len(rows) > 1 else "")
        d = gpu[w["rank"]]
        out.append(Finding(
            kind="device_starved", severity="warning", ranks=ranks,
            message=(f"the GPU waits for the host: idle {_idle(w, why):.1%} of the profiled "
                     f"steps on {where}, {w['kernels_per_step']:g} kernels per step averaging "
                     f"{mean}, CPU time per step {w['host_ms_per_step']:.1f} ms{extra} — "
                     f"{_ADVICE[why]}"),
            evidence={"cause": why, "idle_fraction": {str(r["rank"]): round(_idle(r, why), 4)
                                                      for r in rows},
                      "idle_breakdown_main_stream": {
                          "stream": w["main_stream"], "host_wait": w["host_wait_share"],
                          "kernel_wait": w["kernel_wait_share"], "other": w["other_share"]},
                      "idle_ms_all_streams": d["idle_ms_all_streams"],
                      "kernels_per_step": w["kernels_per_step"], "mean_kernel_us": w["mean_kernel_us"],
                      "host_ms_per_step": w["host_ms_per_step"],
                      "gpu_busy_ms_per_step": w["gpu_busy_ms_per_step"],
                      "data_share": w["data_share"], "sync_share": w["sync_share"],
                      "outside_ms_per_step": w.get("outside_ms_per_step"),
                      "thresholds": {"idle": STARVED_IDLE, "host_wait_share": HOST_WAIT_SHARE}}))
    return out
