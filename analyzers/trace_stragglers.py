"""Stragglers from profiler traces alone (no run directory's collective log): a rank that spends
longer outside communication than its peers in every profiled step — computing longer, in host
code, or with no op recorded (sleeping, waiting, or Python the trace does not record) — while its
peers wait for it in collectives.

Reads only the comm_compute digests (``run.trace_digests("comm_compute")``: per rank and
profiled step, the window and its compute / exposed communication / idle parts). It runs only
when the input holds no collective log (bare traces): with one, the ``stragglers`` analyzer
judges from every step, and this one stays silent so that a straggler is reported once. Traces
without ProfilerStep (one window over each rank's whole trace) are judged over that window with
a stricter floor. The finding names the part of the step that holds the excess (compute, host
code outside torch ops — with the host events in it, a sleep named as one —, data loading, no
op recorded), and the net excess with each part when other parts offset it.
Definitions and thresholds: docs/stragglers-pipeline.md ("Stragglers from traces alone").
"""

from __future__ import annotations

import re

import numpy as np

from trainprof.analyzers._stats import median
from trainprof.findings import AnalyzerResult, Finding

NAME = "trace_stragglers"
SOURCE = "comm_compute"
MIN_STEPS = 2          # profiled steps common to every rank
MIN_EXCESS = 0.20      # the late rank's excess ≥ 20 % of the median step window ...
MIN_EXCESS_MS = 5.0    # ... and ≥ 5 ms per step (clean 2-rank CPU jobs: ≤ 2 ms)
CHRONIC = 2 / 3        # ... in at least this share of the common steps
WAITER_SHARE = 0.5     # a peer waits for it: collective wait ≥ half its excess (median)
WHOLE_EXCESS = 0.40    # one whole-trace window per rank (no ProfilerStep): excess ≥ 40 % of it
_PARTS = {  # how the message says where the excess lies: (verb phrase, what it is)
    "compute_ms": ("computes {} longer than its peers", " (its torch ops run longer)"),
    "other_ms": ("spends {} more than its peers in host code outside torch ops", ""),
    "data_ms": ("spends {} more than its peers loading data", " (enumerate(DataLoader))"),
    "idle_ms": ("spends {} more than its peers with no op recorded in the trace",
                " (sleeping, waiting, or Python/host code the trace does not record — record "
                "with with_stack=True to see which)")}
_LABELS = {"compute_ms": "torch ops", "other_ms": "host code", "data_ms": "data loading",
           "idle_ms": "no op recorded"}  # the parts, in the breakdown of a net excess
OFFSET = 0.10          # a part against the excess ≥ 10 % of it (and 0.5 ms): the message says so
_SLEEP = re.compile(r"(?<![a-z0-9_])sleep(?![a-z0-9_])", re.IGNORECASE)  # time.sleep & co.
_P2P = frozenset({"send", "recv", "send_recv"})  # pipeline waits are not a late peer's


def has_collective_log(run) -> bool:
    """Whether the input holds a run directory's collective log (the stragglers analyzer's)."""
    try:
        coll = run.collectives()
    except Exception:  # noqa: BLE001 - unreadable: the stragglers analyzer reports it
        return True
    return not coll.empty


def _rows(run) -> tuple[dict[int, dict[int, dict]], bool]:
    """(rank -> step -> comm_compute row, whether every rank's trace is one whole-trace window
    (no ProfilerStep)). Warm-up steps stay: each step is judged across ranks, and a slow first
    step slows every rank alike."""
    out, whole = {}, True
    for rank, d in sorted(run.trace_digests(SOURCE).items()):
        kept = {int(r["step"]): r for r in d.get("rows") or [] if isinstance(r, dict)}
        if kept:
            out[int(rank)] = kept
            whole = whole and bool(d.get("whole_trace_window"))
    return out, whole and bool(out)


def _coll_wait(row: dict) -> float:
    """The row's exposed communication in collectives (send/recv left out, pro rata)."""
    types = row.get("comm_by_type_ms") or {}
    total = sum(types.values())
    if total <= 0:
        return 0.0
    share = sum(v for t, v in types.items() if t not in _P2P) / total
    return float(row["exposed_comm_ms"]) * share


def _own(row: dict) -> float:
    """Time in the step not blocked in communication."""
    return float(row["window_ms"]) - float(row["exposed_comm_ms"])


def analyze(run) -> AnalyzerResult:
    """Once per run (comm_compute asks for the waits too: no second pass, no repeated problem
    lines)."""
    cache = getattr(run, "_cache", None)
    if cache is None:
        return _analyze(run)
    key = "analyzers.trace_stragglers.result"
    if key not in cache:
        cache[key] = _analyze(run)
    return cache[key]


def _analyze(run) -> AnalyzerResult:
    if not run.trace_inputs and has_collective_log(run):
        return AnalyzerResult()  # the stragglers analyzer judges from the collective log
    try:
        rows, whole = _rows(run)
    except Exception as e:  # noqa: BLE001 - comm_compute reports an unreadable trace
        run.problems.append(f"{NAME}: no trace breakdown ({type(e).__name__}: {e})")
        return AnalyzerResult()
    if len(rows) < 2:
        return AnalyzerResult()
    ranks = sorted(rows)
    steps = sorted(set.intersection(*(set(rows[r]) for r in ranks)))
    base = {"ranks": len(ranks), "steps": steps,
            "thresholds": {"min_steps": MIN_STEPS, "min_excess": MIN_EXCESS,
                           "min_excess_ms": MIN_EXCESS_MS, "chronic": CHRONIC,
                           "waiter_share": WAITER_SHARE},
            "definitions": "docs/stragglers-pipeline.md"}
    whole = whole and len(steps) == 1  # one window over each rank's whole trace
    if whole:
        base["whole_trace_window"] = True
        base["thresholds"]["whole_trace_excess"] = WHOLE_EXCESS
    if len(steps) < MIN_STEPS and not whole:
        run.problems.append(
            f"{NAME}: stragglers not judged from the traces: {len(steps)} profiled step(s) common "
            f"to every rank (needs {MIN_STEPS}; profile more steps)")
        return AnalyzerResult(metrics=base)
    own = np.array([[_own(rows[r][s]) for s in steps] for r in ranks])        # rank × step
    wait = np.array([[_coll_wait(rows[r][s]) for s in steps] for r in ranks])
    step_ms = float(median([[rows[r][s]["window_ms"] for s in steps] for r in ranks]))
    floor = max((WHOLE_EXCESS if whole else MIN_EXCESS) * step_ms, MIN_EXCESS_MS)
    excess = np.array([own[i] - median(np.delete(own, i, axis=0), axis=0)
                       for i in range(len(ranks))])
    per_rank = [{"rank": r, "own_ms_per_step": round(float(median(own[i])), 3),
                 "excess_ms_per_step": round(float(median(excess[i])), 3),
                 "collective_wait_ms_per_step": round(float(median(wait[i])), 3)}
                for i, r in enumerate(ranks)]
    late = [i for i in range(len(ranks))
            if median(excess[i]) >= floor and np.mean(excess[i] >= floor) >= CHRONIC]
    findings, waits = [], {}
    for i in late:
        e = float(median(excess[i]))
        peers = [j for j in range(len(ranks)) if j not in late]
        waiting = [j for j in peers if median(wait[j]) >= WAITER_SHARE * e]
        if not peers or len(waiting) * 2 < len(peers):  # a late rank the others wait for
            continue
        findings.append(_finding(ranks, rows, steps, i, e, step_ms, waiting, wait, whole))
        for j in waiting:
            waits[ranks[j]] = waits.get(ranks[j], 0.0) + round(float(median(wait[j])), 3)
    metrics = {**base, "step_window_ms": round(step_ms, 3), "floor_ms": round(floor, 3),
               "per_rank": per_rank,
               **({"late": [f.ranks[0] for f in findings],
                   "waits_ms_per_step": {str(k): v for k, v in waits.items()}} if findings else {})}
    return AnalyzerResult(metrics=metrics, findings=findings)


def _finding(ranks, rows, steps, i, e, step_ms, waiting, wait, whole=False) -> Finding:
    r = ranks[i]
    others = [q for q in ranks if q != r]
    med = lambda q, k: float(median([rows[q][s][k] for s in steps]))  # noqa: E731
    part = {k: med(r, k) - float(median([med(q, k) for q in others])) for k in _PARTS}
    unit = "ms" if whole else "ms/step"
    top = max(_PARTS, key=lambda k: part[k])  # the part that holds most of the excess
    verb, note = _PARTS[top]
    what = verb.format(f"{part[top]:.1f} {unit}") + note
    named = _named_excess(rows, steps, r, others, part[top]) if top == "other_ms" else {}
    sleep = next(iter(named), None)  # the top host event, when it is a sleep
    if sleep is not None and _SLEEP.search(sleep):
        what = (f"is sleeping {named[sleep]:.1f} {unit} longer than its peers (in {sleep}; "
                f"{part[top]:.1f} {unit} more in host code outside torch ops")
        rest = {n: v for n, v in named.items() if n != sleep}
        what += ("; also " + ", ".join(f"{n} (+{v:.1f} {unit})" for n, v in rest.items())
                 if rest else "") + ")"
    elif named:
        what += " — most in " + ", ".join(f"{n} (+{v:.1f} {unit})" for n, v in named.items())
    elif top == "other_ms":
        what += " (Python, annotations; record with with_stack=True to see the functions)"
    types: dict[str, float] = {}
    for j in waiting:
        for s in steps:
            for t, v in (rows[ranks[j]][s].get("comm_by_type_ms") or {}).items():
                types[t] = types.get(t, 0.0) + v
    kind = max(types, key=types.get) if types else "collectives"
    wait_ms = {str(ranks[j]): round(float(median(wait[j])), 3) for j in waiting}
    who = (f"ranks {', '.join(str(ranks[j]) for j in waiting)} wait" if len(waiting) > 1
           else f"rank {ranks[waiting[0]]} waits")
    net, parts = _net(e, part, top, unit)
    where = (f"{e / step_ms:.0%} of the {step_ms:.1f} ms traced window{parts})" if whole else
             f"{e / step_ms:.0%} of the {step_ms:.1f} ms step{parts}) in {len(steps)} profiled steps")
    msg = (f"straggler (from the profiler traces{', one window over the whole trace' if whole else ''}): "
           f"rank {r} {what} ({net}, {where}; {who} "
           f"{float(median(list(wait_ms.values()))):.1f} {unit} in {kind} for rank {r}")
    return Finding("straggler", "warning", [r], msg, evidence={
        "rank": r, "source": "profiler traces", "excess_ms_per_step": round(e, 3),
        "step_window_ms": round(step_ms, 3), "profiled_steps": steps,
        **({"whole_trace_window": True} if whole else {}),
        "excess_in": top.replace("_ms", ""),
        "excess_by_part_ms_per_step": {k: round(v, 3) for k, v in part.items()},
        **({"excess_other_by_name_ms_per_step": named} if named else {}),
        "waits_caused_ms": wait_ms, "waited_in": kind})


def _net(e: float, part: dict[str, float], top: str, unit: str) -> tuple[str, str]:
    """('12.0 ms/step more outside communication', ''), or when other parts offset the one
    named, the net excess and each part: ('net 25.2 ms/step more outside communication',
    ': no op recorded +40.0, torch ops -4.7, host code -7.6 ms/step, each a median')."""
    least = max(0.5, OFFSET * abs(e))
    shown = [k for k in sorted(part, key=lambda k: -part[k]) if k == top or abs(part[k]) >= least]
    if not any(part[k] < 0 for k in shown if k != top) and part[top] <= e + least:
        return f"{e:.1f} {unit} more outside communication", ""
    return (f"net {e:.1f} {unit} more outside communication",
            ": " + ", ".join(f"{_LABELS[k]} {part[k]:+.1f}" for k in shown)
            + f" {unit}, each a median")


def _named_excess(rows, steps, r, others, total: float, top: int = 3) -> dict[str, float]:
    """The host events (comm_compute's other_by_name_ms: their self time outside torch ops)
    that the rank spends longer in than its peers: name -> median excess per step, the ``top``
    largest of at least 10 % of ``total`` (the rank's excess in other time) and 0.1 ms."""
    names = {n for s in steps for n in (rows[r][s].get("other_by_name_ms") or {})}
    val = lambda q, n: float(median([(rows[q][s].get("other_by_name_ms") or {}).get(n, 0.0)  # noqa: E731
                                     for s in steps]))
    ex = {n: val(r, n) - float(median([val(q, n) for q in others])) for n in names}
    least = max(0.1, 0.1 * total)
    keep = sorted(((n, v) for n, v in ex.items() if v >= least), key=lambda kv: -kv[1])[:top]
    return {n: round(v, 3) for n, v in keep}


def waits(run) -> dict:
    """Like stragglers.waits_for_stragglers, from the traces: ``{"late": [ranks], "wait_ms":
    {rank: ms per profiled step it waits in collectives for them}}`` (empty when none)."""
    res = analyze(run)
    late, wait = set(), {}
    for f in res.findings:
        late.update(f.ranks)
        for q, v in (f.evidence.get("waits_caused_ms") or {}).items():
            wait[int(q)] = wait.get(int(q), 0.0) + float(v)
    return {"late": sorted(late), "wait_ms": wait}
