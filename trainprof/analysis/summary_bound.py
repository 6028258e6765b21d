"""summary.json stays a few MB at any run length: per-step series in the analyzers' metrics
are downsampled past MAX_POINTS entries.

Within one analyzer's metrics, every list of the same length L is a per-step
series aligned with the others of that length (``steps_analysed``, ``step_ms_by_rank[r]``,
``per_step``, ...), so one choice of indices is applied to all of them, keeping them aligned:
the last RECENT_POINTS entries (the recent steps, every one) and every k-th of the older ones,
MAX_POINTS per list at most and TOTAL_POINTS over the lists of one length (at 1,024 ranks each
rank's series gets fewer points; at least MIN_POINTS).
The analyzer's metrics then say so under ``series_resolution`` ({"length": L, "kept": n,
"every": k, "recent_full": RECENT_POINTS}); figures computed by the analyzers (medians,
findings) come from every step, only the series written out are thinned.
"""

from __future__ import annotations

import math

MAX_POINTS = 3000
RECENT_POINTS = 1000
TOTAL_POINTS = 300_000  # per analyzer, over all its series of one length (1,024 ranks x 7 series)
MIN_POINTS = 50


def bound_metrics(metrics: dict, max_points: int = MAX_POINTS, recent: int = RECENT_POINTS) -> None:
    """Downsample, in place, every analyzer's long per-step lists (see the module doc)."""
    for name, m in metrics.items():
        if not isinstance(m, dict):
            continue
        counts: dict[int, int] = {}
        _lengths(m, MIN_POINTS, counts)
        picks = {}
        for L, c in counts.items():
            limit = max(MIN_POINTS, min(max_points, TOTAL_POINTS // c))
            if L > limit:
                picks[L] = _pick(L, limit, recent)
        if not picks:
            continue
        _apply(m, picks)
        m["series_resolution"] = [{"length": L, "kept": len(p[0]), "every": p[1],
                                   "recent_full": p[2]} for L, p in sorted(picks.items())]


def _lengths(x, limit: int, out: dict) -> None:
    """How many lists of each length > limit (series of one length are aligned)."""
    if isinstance(x, dict):
        for v in x.values():
            _lengths(v, limit, out)
    elif isinstance(x, list) and len(x) > limit:
        out[len(x)] = out.get(len(x), 0) + 1


def _pick(n: int, limit: int, recent: int) -> tuple[list[int], int, int]:
    recent = min(recent, limit // 2)
    old = n - recent
    every = max(1, math.ceil(old / max(1, limit - recent)))
    return list(range(0, old, every)) + list(range(old, n)), every, recent


def _apply(x, picks: dict) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, list) and len(v) in picks:
                x[k] = [v[i] for i in picks[len(v)][0]]
            else:
                _apply(v, picks)


EVIDENCE_POINTS = 1000


def bound_findings(findings: list[dict], limit: int = MAX_POINTS) -> None:
    """A finding's evidence list of more than ``limit`` entries (the steps a chronic straggler
    was slow in, over a run of 100,000s of steps) keeps its first EVIDENCE_POINTS entries and
    says how many there were (``<key>_total``)."""
    for f in findings:
        ev = f.get("evidence")
        if not isinstance(ev, dict):
            continue
        for k, v in list(ev.items()):
            if isinstance(v, list) and len(v) > limit:
                ev[k] = v[:EVIDENCE_POINTS]
                ev[f"{k}_total"] = len(v)
