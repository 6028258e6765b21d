"""The whole run over time: throughput and step time, the per-rank heatmap of own time per step,
and when each finding started (and ended). Renders the whole_run analyzer's downsampled series;
computes nothing."""

from __future__ import annotations

from trainprof.rankranges import rank_list
from trainprof.reports import kit, svg

TITLE = "Whole run over time"
ONSET_COLOUR = "#d9480f"
MAX_MARKED = 12  # onsets drawn on the chart (all are in the table below it)


def _onsets(summary: dict) -> list[dict]:
    out = []
    for f in summary.get("findings") or []:
        o = f.get("onset") if isinstance(f, dict) else None
        if isinstance(o, dict) and isinstance(o.get("step"), int):
            e = f.get("end") if isinstance(f.get("end"), dict) else None
            out.append({"kind": f.get("kind"), "ranks": f.get("ranks") or [], "onset": o,
                        "end": e, "message": f.get("message", "")})
    return sorted(out, key=lambda x: x["onset"]["step"])


def _throughput(bins: list[dict], onsets: list[dict]) -> str:
    pts = [(b["first"], b.get("steps_per_s"), b.get("step_ms")) for b in bins
           if isinstance(b, dict) and isinstance(b.get("first"), int)]
    rates = [p[1] for p in pts if isinstance(p[1], (int, float))]
    if len(pts) < 2 or not rates:
        return ""
    x0, x1 = pts[0][0], max(b["last"] for b in bins if isinstance(b.get("last"), int))
    lo, hi = svg.extent(rates)
    p = svg.Plot((x0, max(x1, x0 + 1)), (lo, hi), title="Throughput over the run",
                 xlabel="step", ylabel="steps / s", height=200)
    p.line([q[0] for q in pts], [q[1] for q in pts], "#1c7ed6",
           tips=[f"steps {b['first']}–{b['last']}: {b.get('steps_per_s')} steps/s, "
                 f"{b.get('step_ms')} ms median step" for b in bins], markers=1.5)
    p.key("steps per second (per bin of steps)", "#1c7ed6", "line")
    if onsets:
        p.key("a finding's onset (dashed) / end (dotted)", ONSET_COLOUR, "dash")
    _mark(p, onsets, hi)  # (after the legend: the labels' room depends on its width)
    return p.render()


def _mark(p, onsets: list[dict], top: float) -> None:
    p.marks(_marks(onsets, lambda step: step), top, ONSET_COLOUR)


def _marks(onsets: list[dict], where) -> list[dict]:
    """Markers of the first MAX_MARKED onsets (a dashed line labelled with the finding's kind)
    and their ends (dotted, unlabelled), at x = where(step); each with its tooltip."""
    out = []
    for o in onsets[:MAX_MARKED]:
        ranks = o["ranks"]
        who = f"rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)}: " if ranks else ""
        msg = o["message"][:200] + ("…" if len(o["message"]) > 200 else "")
        t = o["onset"].get("time")
        out.append({"x": where(o["onset"]["step"]), "label": str(o["kind"]), "dash": "4 3",
                    "tip": f"{o['kind']} from step {o['onset']['step']}"
                           + (f" ({t})" if t else "") + f": {who}{msg}"})
        if o["end"] and isinstance(o["end"].get("step"), int):
            out.append({"x": where(o["end"]["step"]), "label": None, "dash": "1 3", "width": 1,
                        "tip": f"{o['kind']} over at step {o['end']['step']}"})
    return out


def column_of(bins: list, step: int) -> float:
    """Where ``step`` lies on a heatmap whose column j holds steps bins[j] = [first, last]
    (column j spans j − 0.5 .. j + 0.5): inside its bin in proportion, between bins at their
    boundary, before the first / after the last at the edge."""
    j = -1
    for i, (a, _) in enumerate(bins):
        if a <= step:
            j = i
        else:
            break
    if j < 0:
        return -0.5
    a, b = bins[j]
    if step > b:
        return j + 0.5
    return j - 0.5 + (step - a) / max(1, b - a + 1)


def _heat(h: dict, onsets: list[dict]) -> str:
    if not isinstance(h, dict) or not h.get("ms") or not h.get("bins"):
        return ""
    rows = [f"rank {r}" if "–" not in str(r) else f"ranks {r}" for r in h.get("rows") or []]
    bins, ms = _fit(h["bins"], h["ms"], len(rows))
    cols = [f"{a}–{b}" if a != b else str(a) for a, b in bins]
    title = "Own time per step by rank over the run (ms)" + (
        "; each row the worst of its ranks" if (h.get("ranks_per_row") or 1) > 1 else "")
    marks = _marks(onsets, lambda step: column_of(bins, step))
    return svg.heatmap(ms, rows, cols, title, "ms", col_name="steps", row_name="rank",
                       alt="Heatmap of each rank's own time per step over the run (columns: "
                           "bins of steps, each cell the bin's median; merged bins their largest)"
                           + ("; findings marked at their onset (dashed) and end (dotted)"
                              if marks else ""),
                       marks=marks, mark_colour=ONSET_COLOUR)


def _fit(bins: list, ms: list, nrows: int) -> tuple[list, list]:
    """Bins merged k at a time (a cell: the largest of its bins, a spike stays visible) so that
    the heatmap draws them as they are (svg.MAX_COLS columns, about svg.MAX_CELLS cells)."""
    cap = min(svg.MAX_COLS, max(12, svg.MAX_CELLS // max(nrows, 1)))
    k = -(-len(bins) // cap)
    if k <= 1:
        return bins, ms
    out_b = [[bins[i][0], bins[min(i + k, len(bins)) - 1][1]] for i in range(0, len(bins), k)]
    out_m = []
    for row in ms:
        cells = []
        for i in range(0, len(bins), k):
            v = [x for x in row[i:i + k] if isinstance(x, (int, float))]
            cells.append(max(v) if v else None)
        out_m.append(cells)
    return out_b, out_m


def _when_table(onsets: list[dict]) -> str:
    if not onsets:
        return kit.para("No finding with an onset: nothing started or stopped part-way through "
                        "the run.", "note")
    rows = [{"finding": o["kind"], "ranks": ", ".join(map(str, o["ranks"][:8]))
             + (" …" if len(o["ranks"]) > 8 else ""),
             "onset step": o["onset"]["step"], "onset time": o["onset"].get("time") or "",
             "end step": (o["end"] or {}).get("step", "ongoing at the last step"),
             "what": o["message"][:160] + ("…" if len(o["message"]) > 160 else "")}
            for o in onsets]
    return "<h3>When each problem started</h3>" + kit.table(rows)


def render(metrics: dict, summary: dict) -> str:
    if not isinstance(metrics, dict):
        return ""
    onsets = _onsets(summary)
    parts = [kit.para(
        f"Steps {metrics.get('first_step')}–{metrics.get('last_step')} "
        f"({metrics.get('steps')} analysed), shown in {len(metrics.get('bins') or [])} bins; "
        "each marker is a finding's onset.", "note")]
    thr = _throughput(metrics.get("bins") or [], onsets)
    if thr:
        parts.append(svg.figure(thr, alt="Steps per second over the run, findings marked at "
                                         "their onset"))
    parts.append(_heat(metrics.get("heatmap") or {}, onsets))
    parts.append(_when_table(onsets))
    return "".join(parts)
