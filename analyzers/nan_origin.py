"""NaN/Inf origin and loss spikes, from each rank's nan.jsonl (probes/nan_watch.py; docs/nan.md).

nan_origin: the first step S at which any rank saw a non-finite value; among the ranks with
*creation* evidence at S (a module whose inputs were finite and output not, or whose backward
turned finite output-gradients into non-finite input-gradients) the one whose detection came
first on the aligned clock is the origin; the others received it through collectives. The
module and op come from the origin rank's replay records ("op"), else from its first creation
record. Without creation evidence anywhere the earliest detection is reported as such.

loss_spike: per rank, each step's loss against the median of the trailing WINDOW finite losses;
z = (loss - median) / (1.4826 * MAD), MAD floored at 1e-3 x |median| so a flat series does not
turn noise into spikes; upward z > Z_THRESHOLD is a spike. Steps with non-finite loss belong to
nan_origin, not here.
"""

from __future__ import annotations

import math
import statistics

from trainprof.findings import AnalyzerResult, Finding

NAME = "nan_origin"
STREAM = "nan"
WINDOW = 20
MIN_HISTORY = 5
Z_THRESHOLD = 6.0
MAD_FLOOR_REL = 1e-3
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
MAX_SERIES = 5000


def clean_path(path):
    if not isinstance(path, str):
        return path
    for p in WRAPPER_PREFIXES:
        path = path.replace(p, "")
    return path


def _int(x, default=None):
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


def _num(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def analyze(run) -> AnalyzerResult:
    recs = {r: run.stream(r, STREAM) for r in run.ranks}
    recs = {r: v for r, v in recs.items() if v}
    if not recs:
        return AnalyzerResult()
    try:
        from trainprof.analyzers._clock import offsets
        align = offsets(run)
    except Exception as e:  # noqa: BLE001 - alignment is a refinement
        run.problems.append(f"clock alignment unavailable for nan_origin: {e}")
        align = {}
    metrics = {"ranks_watched": sorted(recs), "window": WINDOW, "z_threshold": Z_THRESHOLD}
    findings = []
    origin = find_origin(recs, align)
    metrics["origin"] = origin
    if origin is not None:
        findings.append(origin_finding(origin))
    series = loss_series(recs)
    spikes = detect_spikes(series)
    metrics["loss"] = {str(r): s[-MAX_SERIES:] for r, s in series.items()}
    metrics["grad_norm"] = {str(r): [[_int(x.get("step")), _num(x.get("grad_norm"))]
                                     for x in v if x.get("kind") == "step"][-MAX_SERIES:]
                            for r, v in recs.items()}
    metrics["spikes"] = spikes
    if spikes:
        findings.append(spike_finding(spikes))
    return AnalyzerResult(metrics=metrics, findings=findings)


# --------------------------------------------------------------------------- origin


DETECTIONS = ("nonfinite", "origin")
EVIDENCE_KEYS = ("evidence", "inputs", "output", "grad", "grad_output_finite", "first_params",
                 "params_nonfinite", "op_phase", "op_module", "op_inputs", "op_output", "op_value",
                 "overflow", "hidden_by", "backward_op", "backward_value", "ops_checked", "detected_by",
                 "notes", "replay_ms", "replayed", "root_calls", "at", "param", "origin_steps")


def find_origin(recs: dict, align: dict) -> dict | None:
    det = [(r, i, x) for r, v in recs.items() for i, x in enumerate(v)
           if x.get("kind") in DETECTIONS and _int(x.get("step")) is not None]
    if not det:
        return None
    s0 = min(_int(x["step"]) for _, _, x in det)
    at = [(r, i, x) for r, i, x in det if _int(x["step"]) == s0]

    def t(r, x):
        ns = _int(x.get("t_ns"))
        if ns is None:
            return None
        f = align.get(r)
        return f(ns) if f else ns

    # a rank's detection time at s0: its earliest record (the replay's "origin" carries the time
    # of the detection that triggered it)
    t_rank = {}
    for r, _, x in at:
        tx = t(r, x)
        if tx is not None:
            t_rank[r] = min(t_rank.get(r, tx), tx)
    created = [(r, i, x) for r, i, x in at if x.get("created")]
    pool = created or at
    ranks = sorted({r for r, _, _ in pool})
    rank = min(ranks, key=lambda r: (t_rank.get(r, float("inf")), r))
    mine = [(i, x) for r, i, x in pool if r == rank]
    # the replay verdict if there is one, else the first record in execution order
    rec = next((x for _, x in mine if x.get("kind") == "origin"), min(mine, key=lambda e: e[0])[1])
    ops = [x for x in recs[rank] if x.get("kind") == "op" and _int(x.get("step")) == s0]  # flags mode
    op = next((x for x in ops if x.get("op")), None)
    if op is not None and rec.get("kind") != "origin":
        rec = next((x for x in recs[rank] if x.get("kind") == "nonfinite" and x.get("created")
                    and _int(x.get("step")) == s0 and x.get("module") == op.get("module")), rec)
    src = op if (op is not None and rec.get("kind") != "origin") else rec
    out = {
        "rank": rank, "step": s0, "phase": src.get("phase") or rec.get("phase"),
        "module": clean_path(src.get("module")), "module_class": rec.get("module_class"),
        "op": src.get("op"), "value": rec.get("value"), "created": bool(rec.get("created")),
        "role": rec.get("role"), "method": "replay" if rec.get("kind") == "origin" else "module flags",
        "evidence": {k: rec.get(k) for k in EVIDENCE_KEYS if rec.get(k) not in (None, [], "")},
    }
    if src is op:
        out["evidence"].update({k: op.get(k) for k in EVIDENCE_KEYS if op.get(k) is not None})
    if out["evidence"].get("op_module"):
        out["evidence"]["op_module"] = clean_path(out["evidence"]["op_module"])
    out["replays"] = [{"module": clean_path(x.get("module")), "op": x.get("op"), "note": x.get("note")}
                      for x in ops]
    # every other rank: its first detection (and its replay's verdict: received how)
    others = {}
    for r, i, x in sorted(det, key=lambda e: (e[0], _int(e[2]["step"]), e[2].get("kind") != "origin", e[1])):
        if r != rank and r not in others:
            others[r] = x
    out["received_by"] = sorted(others)
    out["other_ranks"] = [{"rank": r, "step": _int(x.get("step")), "phase": x.get("phase"),
                           "module": clean_path(x.get("module")), "created": bool(x.get("created")),
                           "role": x.get("role"), "detected_ns": t(r, x)} for r, x in sorted(others.items())]
    out["creating_ranks"] = sorted({r for r, _, _ in created})
    out["recovered"] = _recovered(recs, s0)
    return out


def _recovered(recs: dict, s0: int) -> bool:
    """Did every rank's later steps come back finite (e.g. AMP loss scaling skipping a step)?"""
    last = {}
    for r, v in recs.items():
        steps = [x for x in v if x.get("kind") == "step" and (_int(x.get("step")) or 0) > s0]
        if steps:
            last[r] = steps[-1]
    if not last:
        return False
    return all(x.get("loss_finite") is not False and x.get("grad_finite") is not False
               and x.get("params_finite") is not False and x.get("modules_finite") is not False
               for x in last.values())


def origin_finding(o: dict) -> Finding:
    ev = o["evidence"]
    what = o.get("value") or "non-finite value"
    where = o["module"] or "?"
    msg = (f"First {what} on rank {o['rank']} at step {o['step']}, {o['phase']} phase, "
           f"{'created' if o['created'] else 'first seen'} in {where}")
    if o.get("op"):
        msg += f" by {o['op']}"
        if ev.get("hidden_by"):
            msg += f" (its {ev.get('op_value') or 'non-finite'} output hidden by {ev['hidden_by']} " \
                   f"in the forward; the backward's {ev.get('backward_op') or 'op'} made " \
                   f"{ev.get('backward_value') or 'NaN'})"
    if ev.get("overflow"):
        msg += f"; {ev['overflow']}"
    if ev.get("origin_steps") and isinstance(ev.get("evidence"), str):  # found stale in parameters
        msg += f": {ev['evidence']}"
    ins = ev.get("op_inputs") or ev.get("inputs") or []
    if ins and isinstance(ins[0], dict) and ins[0].get("max_abs") is not None:
        msg += f"; input {ins[0].get('dtype')} min {ins[0].get('min', 0):.3g}, max |x| {ins[0]['max_abs']:.3g}"
    if o.get("received_by"):
        msg += f". Ranks {', '.join(map(str, o['received_by']))} received it."
    if not o["created"]:
        msg += " No rank showed it being created from finite values (the replay was refused or" \
               " did not reproduce it, or it was created on a rank without probes)."
        if ev.get("notes"):
            msg += " " + "; ".join(map(str, ev["notes"][:2])) + "."
        if o["module"] in ("<loss>", "<parameters>", None):
            # the default watch could not replay the step: on CUDA it keeps no inputs unless a
            # flag read per step is allowed; some modules refuse a replay (FSDP1, ...)
            msg += (" To name the module and op, rerun with TRAINPROF_NAN_SYNC=1 (CUDA: one flag"
                    " read per step, then the step is replayed) or TRAINPROF_NAN_MODULES=all"
                    " (module-level flags on every call; also where a replay is refused).")
    if o.get("recovered"):
        msg += " Later steps were finite again (transient)."
    sev = "warning" if o.get("recovered") else "critical"
    evidence = dict(ev)
    evidence.update({k: o[k] for k in ("step", "phase", "module", "module_class", "op", "value", "role",
                                       "created", "method", "received_by", "creating_ranks", "replays",
                                       "other_ranks", "recovered") if o.get(k) is not None})
    return Finding("nan_origin", sev, [o["rank"]], msg, evidence)


# --------------------------------------------------------------------------- loss spikes


def loss_series(recs: dict) -> dict:
    """rank -> [[step, loss], ...] (loss None when non-finite or absent)."""
    out = {}
    for r, v in recs.items():
        pts = [[_int(x.get("step")), _num(x.get("loss"))] for x in v
               if x.get("kind") == "step" and _int(x.get("step")) is not None]
        if any(p[1] is not None for p in pts):
            out[r] = sorted(pts)
    return out


def detect_spikes(series: dict, window: int = WINDOW, z_thr: float = Z_THRESHOLD,
                  min_history: int = MIN_HISTORY) -> list[dict]:
    spikes = []
    for r, pts in series.items():
        hist: list[float] = []
        for step, loss in pts:
            if loss is None:
                continue
            if len(hist) >= min_history:
                w = hist[-window:]
                med = statistics.median(w)
                mad = statistics.median(abs(x - med) for x in w)
                scale = max(1.4826 * mad, MAD_FLOOR_REL * abs(med), 1e-12)
                z = (loss - med) / scale
                if z > z_thr:
                    spikes.append({"rank": r, "step": step, "loss": loss, "median": med,
                                   "mad": mad, "z": z})
            hist.append(loss)
    return sorted(spikes, key=lambda s: (s["step"], s["rank"]))


def spike_finding(spikes: list[dict]) -> Finding:
    steps = sorted({s["step"] for s in spikes})
    ranks = sorted({s["rank"] for s in spikes})
    top = max(spikes, key=lambda s: s["z"])
    msg = (f"Loss spike{'s' if len(steps) > 1 else ''} at step{'s' if len(steps) > 1 else ''} "
           f"{', '.join(map(str, steps[:10]))}{' ...' if len(steps) > 10 else ''} on rank"
           f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: worst step {top['step']} "
           f"loss {top['loss']:.4g} vs trailing median {top['median']:.4g} (robust z {top['z']:.1f} "
           f"> {Z_THRESHOLD:g}, window {WINDOW})")
    return Finding("loss_spike", "warning", ranks, msg,
                   {"steps": steps, "spikes": spikes[:50], "z_threshold": Z_THRESHOLD,
                    "window": WINDOW, "method": "median/MAD robust z over trailing window"})
