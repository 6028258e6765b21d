"""Critical path across ranks: per step, the path's time stacked by kind; the ranks it runs
through; the profiled steps' single-rank paths."""

from __future__ import annotations

from trainprof.reports import kit, svg

TITLE = "Critical path across ranks"
COLOURS = {"compute": "#2f9e44", "host": "#868e96", "data": "#f59f00",
           "communication": "#e03131", "idle": "#dee2e6"}


def _steps_chart(per_step: list) -> str:
    rows = [r for r in per_step if isinstance(r, dict) and isinstance(r.get("length_ms"), (int, float))]
    if not rows:
        return ""
    steps = [int(r["step"]) for r in rows]
    top = max(max(r["length_ms"], r.get("wall_ms") or 0) for r in rows)
    kept = [max(r["length_ms"], r.get("wall_ms") or 0) for r in rows if r.get("analysed")]
    title = "Critical path per step by kind (line: the step's wall time, first start to last end)"
    if kept and top > 3 * max(kept):  # set-up and profiler steps: keep the axis on the others
        title += f"\nsteps not analysed (·) run off the scale, up to {kit.fmt_ms(top)}"
        top = 1.5 * max(kept)
    p = svg.Plot((steps[0] - 0.5, steps[-1] + 0.5), (0, top * 1.05 or 1), width=860, height=260,
                 title=title, xlabel="step", ylabel="ms", grid="y")
    for r in rows:
        s, y = int(r["step"]), 0.0
        for kind, colour in COLOURS.items():
            v = float((r.get("by_kind_ms") or {}).get(kind) or 0.0)
            if v > 0:
                hi = min(y + v, top * 1.05)
                if hi > y:
                    p.rect(s - 0.4, s + 0.4, y, hi, colour, f"step {s} — {kind}: {kit.fmt_ms(v)}")
                y += v
        if not r.get("analysed"):
            p.text(s, min(y, top), "·", anchor="middle")
    walls = [(int(r["step"]), min(r["wall_ms"], top * 1.05)) for r in rows
             if isinstance(r.get("wall_ms"), (int, float))]
    if walls:
        p.line([s for s, _ in walls], [w for _, w in walls], "#1c7ed6", tip="wall time of the step")
    for kind, colour in COLOURS.items():
        p.key(kind, colour)
    return svg.figure(p.render(), "Critical path per step, stacked by kind of work")


def _by_rank(job: dict) -> str:
    rows = [r for r in job.get("by_rank") or [] if isinstance(r, dict)][:16]
    if not rows:
        return ""
    p = svg.Plot((-0.5, len(rows) - 0.5), (0, 1), width=min(900, 60 * len(rows) + 300), height=220,
                 title="Share of the path on each rank's own work (analysed steps)",
                 xlabel="rank", ylabel="share", xticks=[(i, str(r["rank"])) for i, r in enumerate(rows)],
                 yfmt=lambda v: f"{100 * v:.0f} %")
    for i, r in enumerate(rows):
        p.rect(i - 0.4, i + 0.4, 0, float(r.get("share") or 0), "#1c7ed6",
               f"rank {r['rank']}: {kit.fmt_pct(r.get('share') or 0)} ({kit.fmt_ms(r.get('ms'))} per step)")
    return svg.figure(p.render(), "Share of the critical path per rank")


def render(metrics: dict, summary: dict) -> str:
    parts = []
    job = metrics.get("job") or {}
    if job:
        kinds = job.get("by_kind") or {}
        parts.append(kit.kv({
            "steps analysed": job.get("steps"),
            "path length (mean per step)": kit.fmt_ms(job.get("length_ms")),
            **{f"{k}": kit.fmt_pct(v) for k, v in kinds.items() if v},
        }))
    parts.append(_steps_chart(metrics.get("per_step") or []))
    parts.append(_by_rank(job))
    prof = metrics.get("profiled") or {}
    if prof.get("ranks"):
        rows = []
        for r in prof["ranks"]:
            for s in r.get("steps") or []:
                kinds = ", ".join(f"{k} {kit.fmt_ms(v)}" for k, v in (s.get("by_kind_ms") or {}).items())
                top = "; ".join(f"{t['name']} {kit.fmt_ms(t['ms'])}" for t in (s.get("top") or [])[:3])
                rows.append(f"<tr><td>{r['rank']}</td><td>{s['step']}</td><td>{kit.fmt_ms(s['length_ms'])}</td>"
                            f"<td>{kit.esc(kinds)}</td><td>{kit.esc(top)}</td></tr>")
        parts.append("<h3>Profiled steps, each rank on its own (ops, kernels, launches)</h3>"
                     "<table><tr><th>rank</th><th>ProfilerStep</th><th>path</th><th>by kind</th>"
                     "<th>longest on the path</th></tr>" + "".join(rows[:64]) + "</table>")
    parts.append(kit.para(
        "The longest chain of dependent work through a step: each rank's work between its "
        "collectives, a collective joining its group at its last member's arrival. See the path "
        "in the timeline's 'critical path' track: trainprof timeline RUN --out t.json.", "note"))
    return "".join(p for p in parts if p)
