"""Which ranks and steps a timeline shows by default, when showing all of them would not open.

Ranks (above ``ALL_RANKS_UP_TO``): rank 0, every rank a finding names (the culprits), their
peers (the other members of the culprits' process groups, at most ``PEERS_PER_GROUP`` per
group), and one rank per host; at most ``MAX_RANKS``. Steps (above ``ALL_STEPS_UP_TO``): the
steps around each finding's step (its onset where known: ± ``AROUND``), around the anomalies
the detail windows were kept for (their collectives are there in detail), the profiled steps,
and the first analysed step; at most ``MAX_STEPS``.
"""

from __future__ import annotations

ALL_RANKS_UP_TO = 64
MAX_RANKS = 96
PEERS_PER_GROUP = 8
ALL_STEPS_UP_TO = 40
MAX_STEPS = 24
AROUND = 2


def finding_step(f: dict) -> int | None:
    """The step a finding is pinned to: its onset where the analysis knows it, else a step its
    evidence names."""
    for src in (f, f.get("evidence") or {}):
        onset = src.get("onset")
        if isinstance(onset, dict) and isinstance(onset.get("step"), int):
            return onset["step"]
        for k in ("onset_step", "step", "first_step"):
            if isinstance(src.get(k), int) and not isinstance(src.get(k), bool):
                return src[k]
        steps = src.get("steps")
        if isinstance(steps, list) and steps and isinstance(steps[0], int):
            return steps[0]
    return None


def _groups_of(run, rank: int) -> list[list[int]]:
    out = []
    for g in run.stream(rank, "groups"):
        m = g.get("ranks")
        if isinstance(m, list) and len(m) > 1:
            out.append([int(x) for x in m if isinstance(x, int)])
    return out


def select_ranks(run, findings: list[dict]) -> tuple[list[int], str]:
    ranks = list(run.ranks)
    if len(ranks) <= ALL_RANKS_UP_TO:
        return ranks, f"all {len(ranks)} ranks"
    have = set(ranks)
    culprits = sorted({int(r) for f in findings for r in (f.get("ranks") or [])
                       if isinstance(r, int) and r in have and len(f.get("ranks") or []) <= 16})
    chosen = {ranks[0]} | set(culprits)
    peers: set[int] = set()
    for c in culprits:
        for members in _groups_of(run, c):
            near = sorted(members, key=lambda m: abs(m - c))
            peers.update(m for m in near[:PEERS_PER_GROUP + 1] if m in have)
    per_host: dict = {}
    for r in ranks:
        h = run.rank_meta(r).get("host")
        per_host.setdefault(h, r)
    ordered = sorted(chosen) + sorted(peers - chosen) + sorted(set(per_host.values()) - chosen - peers)
    picked = sorted(dict.fromkeys(ordered[:MAX_RANKS]))
    why = (f"{len(picked)} of {len(ranks)} ranks: rank 0, the ranks findings name "
           f"({len(culprits)}), their peers in the same process groups ({len(peers - chosen)}), "
           f"one rank per host ({len(per_host)} hosts)"
           + (f", cut to {MAX_RANKS}" if len(ordered) > MAX_RANKS else "")
           + "; choose others with --ranks")
    return picked, why


def select_steps(steps: list[int], findings: list[dict], profiled: list[int],
                 analysed: list[int], anomalies: list[int] = ()) -> tuple[list[int], str]:
    """``anomalies``: the steps the detail windows were kept around (run.resolution), after the
    findings' steps."""
    steps = sorted(steps)
    if len(steps) <= ALL_STEPS_UP_TO:
        return steps, f"all {len(steps)} steps"
    have = set(steps)
    want: list[int] = []
    for f in findings:
        s = finding_step(f)
        if s is not None:
            want.extend(range(s - AROUND, s + AROUND + 1))
    for s in anomalies:
        want.extend(range(s - AROUND, s + AROUND + 1))
    want.extend(profiled)
    if analysed:
        want.append(analysed[0])
    picked = sorted(s for s in dict.fromkeys(want) if s in have)[:MAX_STEPS]
    if not picked:
        picked = steps[:MAX_STEPS]
    return picked, (f"{len(picked)} of {len(steps)} steps: around the findings' steps "
                    f"(±{AROUND})" + (" and the detail windows' anomalies" if anomalies else "")
                    + ", the profiled steps and the first analysed step; choose "
                    f"others with --steps")
