"""Comm vs compute: per-rank stacked bars, rank × step heatmaps, per-type and per-mesh-dim tables."""

from __future__ import annotations

from trainprof.reports import kit

TITLE = "Communication vs computation"
_PARTS = (("compute_fraction", "compute", "#2f9e44"), ("overlapped_fraction", "comm hidden under compute", "#74c0fc"),
          ("exposed_comm_fraction", "exposed comm", "#e03131"), ("data_fraction", "data loading", "#f59f00"),
          ("other_fraction", "other (host)", "#868e96"), ("idle_fraction", "idle", "#dee2e6"))


def _bars(per_rank: list) -> str:
    plt = kit.plt()
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(per_rank) + 2), 3))
    xs = [str(r["rank"]) for r in per_rank]
    bottom = [0.0] * len(per_rank)
    for key, label, color in _PARTS:
        vals = [float(r.get(key) or 0) for r in per_rank]
        ax.bar(xs, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("rank")
    ax.set_ylabel("share of profiled steps")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return kit.figure(fig, "Per-rank breakdown of the profiled steps")


def _heatmaps(per_step: list) -> str:
    ranks = sorted({r["rank"] for r in per_step})
    steps = sorted({r["step"] for r in per_step})
    if len(steps) < 1 or len(ranks) < 1:
        return ""
    at = {(r["rank"], r["step"]): r for r in per_step}
    out = []
    for key, title in (("compute_ms", "compute (ms)"), ("exposed_comm_ms", "waiting in communication (ms)")):
        matrix = [[(at.get((r, s)) or {}).get(key) for s in steps] for r in ranks]
        out.append(kit.heatmap(matrix, [str(r) for r in ranks], [str(s) for s in steps],
                               f"{title}, rank × profiled step", cbar_label="ms"))
    return "".join(out)


def render(metrics: dict, summary: dict) -> str:
    job = metrics.get("job") or {}
    per_rank = metrics.get("per_rank") or []
    parts = [kit.kv({"traces": job.get("trace_kind"), "ranks": job.get("ranks"),
                     **{label: kit.fmt_pct(job.get(key)) for key, label, _ in _PARTS}}),
             kit.para("Definitions: docs/comm-compute.md. CPU traces: compute = aten ops on the "
                      "main thread; communication = gloo worker threads and main-thread waits.")]
    if per_rank:
        parts.append(_bars(per_rank))
        parts.append(_heatmaps(metrics.get("per_step") or []))
        rows = []
        for r in per_rank:
            row = {"rank": r["rank"], "coords": " ".join(f"{k}{v}" for k, v in (r.get("coords") or {}).items()),
                   "step_ms": r.get("step_window_ms"), **{k: r.get(k) for k, _, _ in _PARTS}}
            if r.get("hta_view"):
                row["HTA idle/compute/non-compute/overlap %"] = " / ".join(
                    str(r["hta_view"][k]) for k in ("idle_pct", "compute_pct", "non_compute_pct", "overlap_pct"))
            rows.append(row)
        fmt = {k: kit.fmt_pct for k, _, _ in _PARTS}
        fmt["step_ms"] = kit.fmt_ms
        parts.append(kit.table(rows, fmt=fmt))
        types: dict[str, list] = {}
        for r in per_rank:
            for t, v in (r.get("comm_by_type_ms_per_step") or {}).items():
                types.setdefault(t, []).append(v)
        if types:
            parts.append(kit.table([{"collective": t, "ms per step (mean over ranks)": sum(v) / len(v)}
                                    for t, v in sorted(types.items())],
                                   fmt={"ms per step (mean over ranks)": kit.fmt_ms}))
    dims = metrics.get("by_mesh_dim") or []
    if dims:
        agg: dict[str, list] = {}
        for d in dims:
            agg.setdefault(d["mesh_dim"], []).append(d["blocked_ms_per_step"])
        parts.append(kit.para("Time blocked in collectives per mesh dimension (collective log, all steps):"))
        parts.append(kit.table([{"mesh dim": k, "blocked ms/step (mean rank)": sum(v) / len(v),
                                 "worst rank": max(v)} for k, v in sorted(agg.items())],
                               fmt={"blocked ms/step (mean rank)": kit.fmt_ms, "worst rank": kit.fmt_ms}))
    return "".join(parts)
