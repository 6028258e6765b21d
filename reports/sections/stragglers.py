"""Stragglers: busy / wait time per rank and step, and the evidence per rank."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk
from trainprof.wording import ranks_phrase

TITLE = "Stragglers and input starvation"


def _ranks(ranks) -> str:
    """'rank 0' / 'ranks 0, 3' / 'none': never a bare number that reads as a count."""
    ranks = list(ranks or [])
    return ranks_phrase(ranks) if ranks else "none"


def _heat(by_rank: dict, steps: list, title: str, alt: str, summary: dict, named: list,
          analysed: list) -> str:
    rows = {int(r): v for r, v in (by_rank or {}).items() if isinstance(v, list)}
    if not rows or not steps:
        return ""
    return rk.rank_heatmap(rows, steps, title, "ms", summary, alt=alt, named=named,
                           scale_cols=[i for i, s in enumerate(steps) if s in analysed])


def render(metrics: dict, summary: dict) -> str:
    steps = metrics.get("steps") or []
    parts = []
    chronic, transient = metrics.get("chronic") or [], metrics.get("transient") or []
    score = {p.get("rank"): p.get("score") for p in metrics.get("per_rank") or [] if isinstance(p, dict)}
    named = sorted((r for r in list(chronic) + list(transient) if isinstance(r, int)),
                   key=lambda r: -(score.get(r) if isinstance(score.get(r), (int, float)) else 0))
    named = named[:rk.OUTLIERS] + rk.named(summary)
    analysed = set(metrics.get("steps_analysed") or [])
    parts.append(kit.kv({
        "chronic stragglers": _ranks(chronic),
        "transient stragglers (in single steps)": _ranks(transient),
        "median step": kit.fmt_ms(metrics.get("median_step_ms")),
        "steps analysed": ", ".join(str(s) for s in metrics.get("steps_analysed") or []),
    }))
    parts.append(rk.bounded_note(metrics))
    parts.append(_heat(metrics.get("busy_ms_by_rank"), steps,
                       "Busy time per rank and step (step − blocked in collectives − data wait)",
                       "Heatmap of busy time by rank and step", summary, named, analysed))
    parts.append(_heat(metrics.get("wait_ms_by_rank"), steps,
                       "Time blocked in collectives per rank and step",
                       "Heatmap of collective wait time by rank and step", summary, named, analysed))
    data = metrics.get("data_ms_by_rank") or {}
    if any(isinstance(x, (int, float)) and x > 10 for v in data.values() for x in (v or [])):
        parts.append(_heat(data, steps, "Data-loader wait per rank and step",
                           "Heatmap of data wait by rank and step", summary, named, analysed))
    rows = []
    for p in metrics.get("per_rank") or []:
        if not isinstance(p, dict):
            continue
        rows.append({**p, "coords": kit.coord_text(p.get("coords") or {})})
    rows.sort(key=lambda p: -(p.get("score") if isinstance(p.get("score"), (int, float)) else -1e9))
    if rows:
        parts.append("<h3>Evidence per rank (medians over analysed steps)</h3>" + rk.rank_table(
            rows, [("rank", "rank"), ("coords", "mesh"), ("host", "host"), ("group", "peers"),
                   ("own_ms", "own time"), ("peer_own_ms", "other peers' median"),
                   ("excess_ms", "excess"), ("score", "score"), ("busy_ms", "busy"),
                   ("blocked_ms", "blocked"), ("p2p_ms", "of it in p2p"),
                   ("data_wait_ms", "data wait"), ("cpu_wait_ms", "CPU wait"),
                   ("late_ms", "lateness vs peers"), ("last_frac", "arrives last"),
                   ("status", "status")],
            fmt={k: kit.fmt_ms for k in ("own_ms", "peer_own_ms", "busy_ms", "excess_ms",
                                        "blocked_ms", "p2p_ms", "data_wait_ms", "cpu_wait_ms",
                                        "late_ms")}
            | {"last_frac": kit.fmt_pct},
            worst=lambda r: r.get("score"), worst_label="score", pinned=named))
    th = metrics.get("thresholds") or {}
    parts.append(kit.para(
        "Own time = step time − time waiting in collectives; busy = own time − data-loader wait. "
        "Peers = ranks of the same pipeline stage. Excess = own time − the median of the other "
        "peers in the same step; score = median excess ÷ one step's noise (from the "
        "step-to-step variation); chronic straggler at score ≥ "
        f"{th.get('score')} with an excess ≥ {100 * th.get('min_excess', 0):.0f} % of the step "
        f"in ≥ {100 * th.get('chronic', 0):.0f} % of steps (the same test on arrival lateness "
        "for async collectives). A whole slow stage is stage imbalance (Pipeline section), not a "
        "straggler.", "note"))
    return "".join(parts)
