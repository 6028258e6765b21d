"""NaN/Inf origin and loss spikes: where the first non-finite value was created, and the loss curve."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk, svg

TITLE = "NaN/Inf origin and loss"


def _loss_plot(loss: dict, spikes: list) -> str:
    series = {r: [p for p in pts if isinstance(p, list) and len(p) == 2 and p[1] is not None]
              for r, pts in (loss or {}).items()}
    series = {r: p for r, p in series.items() if len(p) >= 2}
    if not series:
        return ""
    shown = sorted(series.items(), key=lambda kv: int(kv[0]))[:8]
    sp = [s for s in spikes or [] if isinstance(s, dict)]
    xs = [p[0] for _, pts in shown for p in pts] + [s.get("step") for s in sp]
    ys = [p[1] for _, pts in shown for p in pts] + [s.get("loss") for s in sp]
    p = svg.Plot(svg.extent(xs, zero=False, pad=0.03), svg.extent(ys, zero=False), width=860, height=200,
                 xlabel="step", ylabel="loss (mean of backward roots)", grid="both")
    for i, (r, pts) in enumerate(shown):
        colour = svg.PALETTE[i % len(svg.PALETTE)]
        p.line([q[0] for q in pts], [q[1] for q in pts], colour, 1.3, tip=f"rank {r}",
               markers=2 if len(pts) <= 200 else 0,
               tips=[f"rank {r}, step {q[0]}: loss {kit.fmt_value(q[1])}" for q in pts])
        p.key(f"rank {r}", colour, "line")
    if sp:
        p.dots([s.get("step") for s in sp], [s.get("loss") for s in sp], "#e03131", 4.5,
               [f"spike at step {s.get('step')}: loss {kit.fmt_value(s.get('loss'))}" for s in sp])
        p.key("spike", "#e03131", "dot")
    return svg.figure(p.render(), "Per-step loss per rank with detected spikes")


def render(metrics: dict, summary: dict) -> str:
    parts = []
    o = metrics.get("origin")
    if o:
        ev = o.get("evidence") or {}
        parts.append(kit.kv({
            "rank": o.get("rank"), "step": o.get("step"), "phase": o.get("phase"),
            "module": o.get("module"), "op": o.get("op") or "— (no replay reproduced it)",
            "value": o.get("value"), "created here": o.get("created"),
            "hidden by": ev.get("hidden_by"), "overflow": ev.get("overflow"),
            "received by ranks": rk.rank_list(o.get("received_by") or []) or "—",
            "recovered later": o.get("recovered"),
        }))
        ins = ev.get("op_inputs") or ev.get("inputs") or []
        if ins:
            parts.append(kit.para("Inputs of the creating " + ("op" if ev.get("op_inputs") else "module")))
            parts.append(kit.table([i for i in ins if isinstance(i, dict)],
                                   [("dtype", "dtype"), ("shape", "shape"), ("max_abs", "max |x|"),
                                    ("min", "min"), ("zeros", "zeros"), ("nan", "NaN"),
                                    ("posinf", "+inf"), ("neginf", "−inf")]))
        if o.get("replays"):
            parts.append(kit.para("Replays of candidate modules (op-level check, innermost first)"))
            parts.append(kit.table(o["replays"], [("module", "module"), ("op", "creating op"),
                                                  ("note", "note")]))
        if o.get("other_ranks"):
            parts.append(kit.para("Where the other ranks first saw a non-finite value"))
            parts.append(rk.rank_table(o["other_ranks"], [("rank", "rank"), ("step", "step"), ("phase", "phase"),
                                                          ("module", "module"), ("role", "where"),
                                                          ("created", "created")]))
    else:
        parts.append(kit.para("No non-finite loss, gradient, parameter or module value was seen."))
    spikes = metrics.get("spikes") or []
    parts.append(_loss_plot(metrics.get("loss") or {}, spikes))
    if spikes:
        rows = [{**x, "ranks": rk.rank_list(x.get("ranks") or [x.get("rank")])}
                for x in spikes if isinstance(x, dict)]
        parts.append(kit.table(rows, [("step", "step"), ("ranks", "ranks with a spike"),
                                      ("loss", "loss (mean over ranks)"),
                                      ("median", "trailing median"), ("z", "z")]))
    return "".join(parts)
