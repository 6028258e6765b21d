"""Rank lists as compact ranges: [0, 1, 2, 5, 8, 9] -> "0-2,5,8-9", and the rank specs that
`--profile-ranks` / TRAINPROF_PROFILE_RANKS take (keywords or such ranges; what each keyword
selects is decided in each rank by probes/profile_ranks.py).

Standard library only: the probes (meta.json ``hosts``), the launcher and the run-directory
reader all write or read this form.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def ranges(ranks, dash: str = "-", sep: str = ",") -> str:
    """[0, 1, 2, 5, 8, 9] -> "0-2,5,8-9" (duplicates dropped, sorted)."""
    out, run = [], []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}{dash}{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}{dash}{run[-1]}")
    return sep.join(out)



# Rank lists in messages and reports: one spelling everywhere ("ranks 0–2, 5 … and 1,021 more").
def _runs(ranks: Sequence) -> list[tuple[Any, Any]]:
    """Consecutive integers collapsed, in the given order: [0,1,2,5] -> [(0,2),(5,5)]."""
    out: list[list] = []
    for r in ranks:
        if (out and isinstance(r, int) and not isinstance(r, bool) and isinstance(out[-1][1], int)
                and r == out[-1][1] + 1):
            out[-1][1] = r
        else:
            out.append([r, r])
    return [(a, b) for a, b in out]


def _run_text(a, b) -> str:
    if a == b:
        return str(a)
    return f"{a}, {b}" if b == a + 1 else f"{a}–{b}"


def rank_list(ranks: Iterable, limit: int = 8) -> str:
    """'3, 7, 9–12 … and 1,021 more': consecutive ranks as ranges, at most `limit` numbers."""
    runs = _runs(list(ranks or []))
    shown, used = [], 0
    for a, b in runs:
        cost = 1 if a == b else 2
        if used + cost > limit:
            break
        shown.append(_run_text(a, b))
        used += cost
    rest = sum((b - a + 1) if isinstance(a, int) and isinstance(b, int) else 1
               for a, b in runs[len(shown):])
    return ", ".join(shown) + (f" … and {rest:,} more" if rest else "")

ENV = "TRAINPROF_PROFILE_RANKS"
AUTO_ALL_MAX = 64
KEYWORDS = ("auto", "all", "none", "per-node", "per-coord")
MAX_RANK = 1 << 24


class RankList:
    """The ranks of a list spec as merged intervals: ``rank in it`` by bisection, so that a spec
    such as ``0-9999999`` costs nothing in the job's processes (a set of its ranks would take
    gigabytes and tens of seconds in every rank)."""

    def __init__(self, intervals):
        merged: list[list[int]] = []
        for lo, hi in sorted(intervals):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.intervals = tuple((lo, hi) for lo, hi in merged)
        self._starts = [lo for lo, _ in self.intervals]

    def __contains__(self, rank) -> bool:
        import bisect

        i = bisect.bisect_right(self._starts, rank) - 1
        return i >= 0 and rank <= self.intervals[i][1]

    def __eq__(self, other) -> bool:
        if isinstance(other, RankList):
            return self.intervals == other.intervals
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.intervals)

    def text(self) -> str:
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.intervals)


def parse(spec: str | None) -> str | RankList:
    """A keyword (canonical spelling) or the RankList of listed ranks; ValueError with the
    reason otherwise. Unset or empty: ``auto``."""
    s = (spec or "").strip().lower().replace("_", "-")
    if not s:
        return "auto"
    if s in KEYWORDS:
        return s
    spans: list[tuple[int, int]] = []
    for part in s.split(","):
        part = part.strip()
        a, sep, b = part.partition("-")
        if not a.strip().isdigit() or (sep and not b.strip().isdigit()):
            raise ValueError(f"{part!r} is not a rank or a range FIRST-LAST")
        lo, hi = int(a), int(b) if sep else int(a)
        if hi < lo or hi >= MAX_RANK:
            raise ValueError(f"{part!r}: expected FIRST-LAST with FIRST <= LAST < {MAX_RANK}")
        spans.append((lo, hi))
    return RankList(spans)


def canonical(spec: str | None) -> str:
    """The spelling passed to the ranks (and recorded in meta.json): a keyword or compact
    ranges."""
    p = parse(spec)
    return p if isinstance(p, str) else p.text()
