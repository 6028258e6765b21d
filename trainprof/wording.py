"""Small wording helpers shared by analyzers and reports: counts with the right plural, rank
lists that read as English ("rank 1", "ranks 0, 2"), times and tie-aware labels."""

from __future__ import annotations

from datetime import datetime, timezone

from trainprof.rankranges import rank_list


def plural(n, word: str, many: str | None = None) -> str:
    """'1 rank', '2 ranks', '1,024 ranks'; `many` for irregular plurals ('1 bus', '2 buses')."""
    try:
        one = int(n) == 1 and float(n) == 1
    except (TypeError, ValueError):
        one = False
    num = f"{n:,}" if isinstance(n, int) and not isinstance(n, bool) else str(n)
    return f"{num} {word if one else (many or word + 's')}"


def ranks_phrase(ranks, limit: int = 8) -> str:
    """'rank 3', 'ranks 0, 2', 'ranks 0–7' (consecutive ranks as ranges, at most `limit`
    numbers, then '… and N more'): trainprof.rankranges.rank_list with its noun."""
    ranks = list(ranks or [])
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + rank_list(ranks, limit)


def verb(n: int, one: str, many: str) -> str:
    """'was'/'were', 'has'/'have' ... agreeing with a count."""
    return one if n == 1 else many


def wall_time(ns) -> str | None:
    """A wall-clock time in ns since the epoch as '2026-11-25 13:37:59.123 UTC' (None if not one)."""
    try:
        return datetime.fromtimestamp(int(ns) / 1e9, tz=timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def share_label(size: int, sizes) -> str:
    """'majority', 'minority', 'tied' (several groups share the largest size: a 1:1 split has
    no majority) or 'all ranks' (one group) for a group of `size` among groups of `sizes`."""
    sizes = list(sizes)
    if len(sizes) <= 1:
        return "all ranks"
    top = max(sizes)
    if size == top:
        return "tied" if sizes.count(top) > 1 else "majority"
    return "minority"
