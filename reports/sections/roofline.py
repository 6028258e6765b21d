"""Roofline: MFU/HFU per step, op classes against the device's roofline (log-log plot)."""

from __future__ import annotations

import math

from trainprof.reports import kit, svg

TITLE = "Roofline and MFU"


def _plot(plot: dict) -> str:
    pts = [p for p in plot.get("points") or [] if p.get("ai") and p.get("flops_per_s")]
    if not pts:
        return ""
    peak_f, peak_b, ridge = plot["peak_flops_per_s"], plot["peak_bytes_per_s"], plot["ridge_ai"]
    lo = min([p["ai"] for p in pts] + [ridge]) / 4
    hi = max([p["ai"] for p in pts] + [ridge]) * 4
    ys = [p["flops_per_s"] for p in pts] + [peak_f, lo * peak_b]
    ylo, yhi = min(ys) / 2, max(ys) * 2
    plot = svg.Plot((lo, hi), (ylo, yhi), xlog=True, ylog=True, width=680, height=300, grid="both",
                    title="Op classes against the roofline (marker area ∝ time)",
                    xlabel="arithmetic intensity (FLOP / byte)", ylabel="achieved FLOP/s")
    xs = [lo, ridge, hi]
    plot.line(xs, [min(peak_f, x * peak_b) for x in xs], "#343a40", 1.8,
              tip=f"roofline: {peak_b:.3g} B/s × intensity up to {peak_f:.3g} FLOP/s")
    plot.vline(ridge, "#868e96", 1, dash="2 3")
    plot.text(ridge, peak_f, f"ridge {ridge:.3g} FLOP/B", size=10, dx=5, dy=14)
    tmax = max(p["time_ms"] for p in pts) or 1
    for i, p in enumerate(pts):
        colour = svg.PALETTE[i % len(svg.PALETTE)]
        r = math.sqrt((20 + 280 * p["time_ms"] / tmax) / math.pi) * 1.25  # area ∝ time
        plot.dots([p["ai"]], [p["flops_per_s"]], colour, r, opacity=0.75, tips=[
            f"{p['label']}: {p['ai']:.3g} FLOP/B, {p['flops_per_s']:.3g} FLOP/s, "
            f"{kit.fmt_ms(p['time_ms'])}"])
        plot.text(p["ai"], p["flops_per_s"], p["label"], size=10, dx=r + 3, dy=-3)
    return svg.figure(plot.render(), alt="Roofline plot: arithmetic intensity against achieved FLOP/s per op class")


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
