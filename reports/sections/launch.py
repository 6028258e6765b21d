"""Device idle and kernel launches: HTA's idle-time breakdown per stream, launch statistics."""

from __future__ import annotations

from trainprof.reports import kit

TITLE = "Device idle time and kernel launches"
MAX_RANKS, MAX_STREAMS = 64, 48


def _us(x) -> str:
    """µs value: "12.3 µs" below a millisecond, else as fmt_ms does."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x:
        return "—"
    return f"{x:.1f} µs" if abs(x) < 1000 else kit.fmt_ms(x / 1e3)


def _share(x) -> str:
    return kit.fmt_pct(x)


def render(metrics: dict, summary: dict) -> str:
    job = metrics.get("job") or {}
    if job.get("note") and not metrics.get("per_rank"):
        return kit.para(job["note"])
    per_rank = metrics.get("per_rank") or []
    parts = [kit.kv({
        "ranks with GPU traces": job.get("ranks"),
        "device idle (median rank)": _share(job.get("idle_fraction")),
        "idle that is host wait": _share(job.get("host_wait_share")),
        "idle that is kernel wait": _share(job.get("kernel_wait_share")),
        "idle for other reasons": _share(job.get("other_share")),
        "kernels per step": job.get("kernels_per_step"),
        "host time per step": kit.fmt_ms(job.get("host_ms_per_step")),
        "starved ranks": ", ".join(map(str, job.get("starved_ranks") or [])) or "none",
    }), kit.para(
        "Device idle: time in the profiled steps' GPU window with no kernel, memcpy or memset "
        "running. Its breakdown is HTA's, on the rank's main compute stream: host wait = the "
        "next op's launch call started after the previous op ended (the host was late); kernel "
        "wait = a shorter gap (< 30 µs) between queued ops; other = queued but waiting (e.g. on "
        "another stream). Definitions: docs/launch.md.")]
    if per_rank:
        parts.append(kit.table(
            [{k: r.get(k) for k in (
                "rank", "idle_fraction", "main_stream", "host_wait_share", "kernel_wait_share",
                "other_share", "kernels_per_step", "mean_kernel_us", "short_kernel_share",
                "host_ms_per_step", "gpu_busy_ms_per_step", "launch_calls_ms_per_step",
                "data_share", "sync_share", "starved")} for r in per_rank],
            columns=[("rank", "rank"), ("idle_fraction", "device idle"), ("main_stream", "main stream"),
                     ("host_wait_share", "host wait"), ("kernel_wait_share", "kernel wait"),
                     ("other_share", "other"), ("kernels_per_step", "kernels/step"),
                     ("mean_kernel_us", "mean kernel"), ("short_kernel_share", "kernels < 10 µs"),
                     ("host_ms_per_step", "host/step"), ("gpu_busy_ms_per_step", "GPU busy/step"),
                     ("launch_calls_ms_per_step", "launch calls/step"),
                     ("data_share", "data loader"), ("sync_share", "blocked in sync"),
                     ("starved", "starved (cause)")],
            fmt={"idle_fraction": _share, "host_wait_share": _share, "kernel_wait_share": _share,
                 "other_share": _share, "mean_kernel_us": _us, "short_kernel_share": _share,
                 "host_ms_per_step": kit.fmt_ms, "gpu_busy_ms_per_step": kit.fmt_ms,
                 "launch_calls_ms_per_step": kit.fmt_ms, "data_share": _share, "sync_share": _share},
            max_rows=MAX_RANKS))
    streams = metrics.get("streams") or []
    if streams:
        parts.append(kit.para("Idle time per CUDA stream (HTA's categories) and queue length "
                              "(ops launched but not started)."))
        parts.append(kit.table(
            streams, columns=[("rank", "rank"), ("stream", "stream"), ("ops", "ops"),
                              ("busy_ms", "busy"), ("host_wait_ms", "host wait"),
                              ("kernel_wait_ms", "kernel wait"), ("other_ms", "other"),
                              ("queue_mean", "queue mean"), ("queue_max", "queue max")],
            fmt={c: kit.fmt_ms for c in ("busy_ms", "host_wait_ms", "kernel_wait_ms", "other_ms")},
            max_rows=MAX_STREAMS))
    launch = metrics.get("launch") or []
    if launch:
        rows = []
        for la in launch:
            d, c, g = (la.get(k) or {} for k in ("launch_delay", "launch_call", "gpu_op"))
            rows.append({"rank": la.get("rank"), "launches": la.get("launches"),
                         "delay p50": d.get("p50_us"), "delay p95": d.get("p95_us"),
                         "call mean": c.get("mean_us"), "GPU op mean": g.get("mean_us"),
                         "op shorter than its call": la.get("shorter_than_launch_call"),
                         "calls > 50 µs": la.get("launch_call_over_50us"),
                         "delay > 100 µs": la.get("launch_delay_over_100us"),
                         "launch APIs": la.get("apis")})
        parts.append(kit.para("Kernel launches: launch delay = GPU op start − end of its runtime "
                              "launch call (0 when the op starts before the call returns)."))
        parts.append(kit.table(rows, fmt={k: _us for k in ("delay p50", "delay p95", "call mean",
                                                            "GPU op mean")}, max_rows=MAX_RANKS))
    return "".join(parts)
