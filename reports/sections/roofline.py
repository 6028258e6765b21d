"""Roofline: MFU/HFU per step, op classes against the device's roofline (log-log plot)."""

from __future__ import annotations

from trainprof.reports import kit

TITLE = "Roofline and MFU"


def _plot(plot: dict) -> str:
    pts = [p for p in plot.get("points") or [] if p.get("ai") and p.get("flops_per_s")]
    if not pts:
        return ""
    peak_f, peak_b, ridge = plot["peak_flops_per_s"], plot["peak_bytes_per_s"], plot["ridge_ai"]
    plt = kit.plt()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    lo = min([p["ai"] for p in pts] + [ridge]) / 4
    hi = max([p["ai"] for p in pts] + [ridge]) * 4
    xs = [lo, ridge, hi]
    ax.plot(xs, [min(peak_f, x * peak_b) for x in xs], color="#343a40", linewidth=1.5, label="roofline")
    ax.axvline(ridge, color="#adb5bd", linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, peak_f), textcoords="offset points", xytext=(4, -12),
                fontsize=7)
    tmax = max(p["time_ms"] for p in pts) or 1
    for p in pts:
        ax.scatter(p["ai"], p["flops_per_s"], s=20 + 280 * p["time_ms"] / tmax, alpha=0.7)
        ax.annotate(p["label"], (p["ai"], p["flops_per_s"]), textcoords="offset points", xytext=(5, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import LogFormatter

    for axis in (ax.xaxis, ax.yaxis):  # plain "1e+12" labels: mathtext costs ~0.7 s to set up
        axis.set_major_formatter(LogFormatter(labelOnlyBase=True))
        axis.set_minor_formatter(LogFormatter(labelOnlyBase=True))
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title("Op classes against the roofline (marker area ∝ time)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    return kit.figure(fig, alt="Roofline plot: arithmetic intensity against achieved FLOP/s per op class")


def render(metrics: dict, summary: dict) -> str:
    parts = []
    job = metrics.get("job") or {}
    peak = metrics.get("peak") or {}
    shown = {"MFU": kit.fmt_pct(job.get("mfu")), "HFU": kit.fmt_pct(job.get("hfu")),
             "MFU (causal attention halved)": kit.fmt_pct(job.get("mfu_causal")),
             "model FLOPs / step": job.get("model_flops_per_step"),
             "trace FLOPs / model FLOPs": job.get("trace_over_model"),
             "step time": kit.fmt_ms(job.get("step_ms")), "devices": job.get("devices"),
             "peak per device": peak.get("basis"), "missing": job.get("missing")}
    parts.append(kit.kv({k: v for k, v in shown.items() if v not in (None, "—")}))
    if job.get("formula"):
        parts.append(kit.para(job["formula"]))
    if metrics.get("plot"):
        parts.append(_plot(metrics["plot"]))
    classes = metrics.get("classes") or []
    if classes:
        g = lambda x: "—" if x is None else f"{x:.3g}"  # noqa: E731
        parts.append(kit.table(classes, columns=[
            ("op_class", "op class"), ("count", "ops"), ("time_ms", "time"), ("time_share", "share"),
            ("ai", "FLOP/B"), ("achieved_flops_per_s", "FLOP/s"), ("achieved_bytes_per_s", "B/s"),
            ("bound", "bound"), ("pct_of_bound", "% of bound")],
            fmt={"time_ms": kit.fmt_ms, "time_share": kit.fmt_pct, "ai": g, "achieved_flops_per_s": g,
                 "achieved_bytes_per_s": g, "pct_of_bound": kit.fmt_pct}))
        timing = ", ".join(metrics.get("timing") or [])
        parts.append(kit.para(f"Times are {timing}, summed over ranks and profiled steps. "
                              + " ".join(metrics.get("notes") or [])))
    steps = job.get("per_step") or []
    if steps:
        parts.append(kit.table(steps, columns=[("step", "step"), ("ms", "step time"), ("mfu", "MFU")],
                               fmt={"ms": kit.fmt_ms, "mfu": kit.fmt_pct}, max_rows=50))
    return "".join(p for p in parts if p)
