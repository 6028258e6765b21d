"""Rank lists as compact ranges: [0, 1, 2, 5, 8, 9] -> "0-2,5,8-9".

Standard library only: the probes (meta.json ``hosts``), the launcher and the run-directory
reader all write or read this form.
"""

from __future__ import annotations


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
