"""Replay of one pipeline step with free hand-overs between stages.

Theory's bubble ((p−1)/m) assumes equal micro-batch times and transfers between stages that cost
nothing. A measured bubble above it has two causes, and they call for different fixes:
* uneven or varying compute (a slow stage, jitter): rebalance the layers;
* hand-overs (the p2p transfer, waking the blocked rank, the schedule's own host work): bigger
  micro-batches, fewer stage boundaries, overlapped p2p.
Replaying the step's actions in each rank's own order with their measured durations, but with
every cross-stage dependency satisfied the moment its producer ends, gives the window the step
would have had with free hand-overs. Its bubble minus theory is the uneven-compute part; the
measured bubble minus it is the hand-over part: every idle gap the schedule's dependencies do not
explain, i.e. the transfer and the waits around it, and any host work between two actions (the
schedule's own Python, the last stage's loss, a pause of the process). The replay needs no clock
alignment across ranks (only durations and order), so it holds on GPU device timelines too.

Dependencies (those of every GPipe/1F1B/interleaved/zero-bubble schedule of
torch.distributed.pipelining): F of stage s, micro-batch i needs F of stage s−1, i; B (full or
input-gradient) of stage s needs B of stage s+1, i; B of the last stage needs its own F; W only
follows its rank's order. Real dependencies the replay does not model (TP all-reduces inside a
span) are inside the measured durations, so the replayed window is never longer than the real one.
"""

from __future__ import annotations

from collections import defaultdict


def _needs(stage: int, mb: int, kind: str, last: int) -> tuple | None:
    if kind == "F":
        return (stage - 1, mb, "F") if stage > 0 else None
    if kind == "B":
        return (stage + 1, mb, "B") if stage < last else (stage, mb, "F")
    return None


def replay_window(actions) -> int | None:
    """actions: iterable of (rank, start, stage, microbatch, kind, duration) for one pipeline
    and step, any time unit. Returns the window with free hand-overs (first action at 0), or
    None when the ranks' orders contradict the dependencies (spans that cannot come from one
    schedule, e.g. a pipeline label that merged two pipelines)."""
    per_rank: dict[int, list] = defaultdict(list)
    present = set()
    last = -1
    for rank, start, stage, mb, kind, dur in actions:
        per_rank[rank].append((start, stage, mb, kind, max(dur, 0)))
        present.add((stage, mb, kind))
        last = max(last, stage)
    if not per_rank:
        return None
    queues = {r: sorted(a) for r, a in per_rank.items()}
    pos = dict.fromkeys(queues, 0)
    now = dict.fromkeys(queues, 0)
    ends: dict[tuple, int] = {}
    left = sum(len(q) for q in queues.values())
    while left:
        moved = False
        for r, q in queues.items():
            i = pos[r]
            while i < len(q):
                _, stage, mb, kind, dur = q[i]
                dep = _needs(stage, mb, kind, last)
                if dep is not None and dep in present and dep not in ends:
                    break  # its producer on another rank has not been replayed yet
                t = max(now[r], ends.get(dep, 0)) + dur
                now[r] = ends[(stage, mb, kind)] = t
                i += 1
                left -= 1
                moved = True
            pos[r] = i
        if not moved:
            return None
    return max(now.values())


def idle_share(actions) -> float | None:
    """actions as for replay_window: the idle share of the replayed window over the ranks,
    1 − Σ durations ÷ (ranks × window); None where the orders conflict."""
    acts = list(actions)
    w = replay_window(acts)
    if not w:
        return None
    ranks = {a[0] for a in acts}
    return 1 - sum(max(a[5], 0) for a in acts) / (len(ranks) * w)
