"""NaN/Inf origin and loss spikes, from each rank's nan.jsonl (probes/nan_watch.py; docs/nan.md).

nan_origin: the first step S at which any rank saw a non-finite value; among the ranks with
*creation* evidence at S (a module whose inputs were finite and output not, or whose backward
turned finite output-gradients into non-finite input-gradients) the one whose detection came
first on the aligned clock is the origin; the others received it through collectives. The
module and op come from the origin rank's replay records ("op"), else from its first creation
record. Without creation evidence anywhere the earliest detection is reported as such.

loss_spike: judged on the mean loss over the ranks at each step (ranks of a data-parallel job see
different batches: one rank's unlucky batch is noise, a jump of the mean is the model's), each
step against the trailing WINDOW finite values once MIN_HISTORY of them exist:
z = (loss − median) / scale, scale = the largest of the window's 1.4826·MAD, its step-to-step
noise 1.4826·median|Δ|/√2, its upper-tail spread (q90 − median)/1.2816 (per-batch losses are
skewed upwards) and 1e-3·|median|, on log(loss) when the losses are positive; upward
z > Z_THRESHOLD · √(WINDOW / history) is a spike (warning). The same test on each rank's own
series with Z_RANK: a rank's spike at a step where the mean shows none is info. Steps with a
non-finite loss belong to nan_origin, not here (a step enters the mean only when every rank that
reports losses has a finite one).
"""

from __future__ import annotations

import math

from trainprof.findings import AnalyzerResult, Finding
from trainprof.analyzers._clock import offsets
from trainprof.wording import plural, ranks_phrase

NAME = "nan_origin"
STREAM = "nan"
WINDOW = 20
MIN_HISTORY = 10
Z_THRESHOLD = 6.0
Z_RANK = 10.0        # a rank's own series (info only: thousands of series × steps are judged)
MAD_FLOOR_REL = 1e-3
TAIL_Q = 0.9         # upper-tail spread: (q90 − median) / z(0.9)
TAIL_Z = 1.2816
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
    recs = {r: run.stream_once(r, STREAM) for r in run.ranks}  # only this analyzer reads them
    recs = {r: v for r, v in recs.items() if v}
    if not recs:
        return AnalyzerResult()
    try:
        align = offsets(run)
    except Exception as e:  # noqa: BLE001 - alignment is a refinement
        run.problems.append(f"clock alignment unavailable for nan_origin: {e}")
        align = {}
    metrics = {"ranks_watched": sorted(recs), "window": WINDOW, "z_threshold": Z_THRESHOLD,
               "z_rank": Z_RANK}
    findings = []
    origin = find_origin(recs, align)
    metrics["origin"] = origin
    if origin is not None:
        findings.append(origin_finding(origin))
    series = loss_series(recs)
    mean = mean_series(series)
    spikes = detect_spikes({"mean": mean}) if len(series) > 1 else detect_spikes(series)
    rank_spikes = detect_spikes(series, z_thr=Z_RANK) if len(series) > 1 else []
    for sp in spikes:
        sp["rank"] = sp["rank"] if len(series) == 1 else None
        sp["ranks"] = sorted({x["rank"] for x in rank_spikes if x["step"] == sp["step"]}
                             or series)
    seen = {sp["step"] for sp in spikes}
    outliers = [x for x in rank_spikes if x["step"] not in seen]
    metrics["loss"] = {str(r): s[-MAX_SERIES:] for r, s in series.items()}
    if len(series) > 1:
        metrics["mean_loss"] = mean[-MAX_SERIES:]
    metrics["grad_norm"] = {str(r): [[_int(x.get("step")), _num(x.get("grad_norm"))]
                                     for x in v if x.get("kind") == "step"][-MAX_SERIES:]
                            for r, v in recs.items()}
    metrics["spikes"] = spikes
    metrics["rank_spikes"] = outliers[:200]
    metrics["min_history"] = MIN_HISTORY
    if spikes:
        findings.append(spike_finding(spikes, len(series)))
    if outliers:
        findings.append(rank_outlier_finding(outliers))
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
    if _model_input(rec, recs[rank]):
        out["module"] = MODEL  # DDP's attribute name ("module") or the root's "<Class>"
        out["input_batch"] = True
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


MODEL = "<model>"  # the job's model as a whole (a root call)


def _model_input(rec: dict, recs: list) -> bool:
    """The replay's verdict says the root call's inputs — the step's input batch — were already
    non-finite: nothing in the model made the value (the root's name is "<Class>", or under DDP
    "module", the attribute DDP keeps the job's model in)."""
    if rec.get("kind") != "origin" or rec.get("role") != "inputs" or rec.get("phase") != "forward":
        return False
    roots = [x for x in recs if x.get("kind") == "root"]
    names = {x.get("module") for x in roots}
    if any(x.get("module_class") == "DistributedDataParallel" for x in roots):
        names.add("module")
    m = rec.get("module")
    return m in names or (isinstance(m, str) and m.startswith("<") and m.endswith(">"))


def _nonfinite_count(inputs) -> str | None:
    """'1 NaN', '3 NaNs and 2 +Inf' over the input tensors' stats."""
    tot = {"NaN": 0, "+Inf": 0, "−Inf": 0}
    for x in inputs or []:
        if isinstance(x, dict):
            for k, key in (("NaN", "nan"), ("+Inf", "posinf"), ("−Inf", "neginf")):
                tot[k] += _int(x.get(key), 0) or 0
    parts = [plural(n, k) for k, n in tot.items() if n]
    return " and ".join(parts) if parts else None


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


def _input_batch_message(o: dict) -> str:
    ev = o["evidence"]
    ins = [x for x in ev.get("inputs") or [] if isinstance(x, dict)]
    count = _nonfinite_count(ins) or f"a {o.get('value') or 'non-finite value'}"
    msg = (f"The input batch of step {o['step']} on rank {o['rank']} already contained {count} "
           f"(before any op): it came with the data, no computation of the model made it")
    if ins and ins[0].get("max_abs") is not None:
        shape = "×".join(map(str, ins[0].get("shape") or [])) or "?"
        msg += (f" (input {ins[0].get('dtype')} [{shape}]; its finite values min "
                f"{ins[0].get('min', 0):.3g}, max |x| {ins[0]['max_abs']:.3g})")
    return msg


def origin_finding(o: dict) -> Finding:
    ev = o["evidence"]
    what = o.get("value") or "non-finite value"
    where = o["module"] or "?"
    batch = bool(o.get("input_batch"))
    if batch:
        msg = _input_batch_message(o)
    else:
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
    if not batch and ins and isinstance(ins[0], dict) and ins[0].get("max_abs") is not None:
        msg += f"; input {ins[0].get('dtype')} min {ins[0].get('min', 0):.3g}, max |x| {ins[0]['max_abs']:.3g}"
    if o.get("received_by"):
        msg += f". {ranks_phrase(o['received_by']).capitalize()} received it"
    msg += "" if msg.endswith(".") else "."
    if batch:
        msg += (" Look at that step's data: a corrupt sample, a division by zero or a log of zero"
                " in preprocessing, a normalisation by a zero spread.")
    if not o["created"] and not batch:
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
                                       "other_ranks", "recovered", "input_batch") if o.get(k) is not None})
    return Finding("nan_origin", sev, [o["rank"]], msg, evidence)


# --------------------------------------------------------------------------- loss spikes


def loss_series(recs: dict) -> dict:
    """rank -> [[step, loss], ...] (loss None when non-finite or absent)."""
    out = {}
    for r, v in recs.items():
        pts = [[_int(x.get("step")), _num(x.get("loss"))] for x in v
               if x.get("kind") == "step" and _int(x.get("step")) is not None]
        if any(p[1] is not None for p in pts):
            out[r] = sorted(pts, key=lambda p: p[0])  # by step: a repeated step may lack a loss
    return out


def mean_series(series: dict) -> list:
    """[[step, mean loss over the ranks], ...] for the steps where every rank that reports
    losses has a finite one (a step some rank did not report or saw non-finite is left out)."""
    by_step: dict[int, list] = {}
    for pts in series.values():
        for step, loss in pts:
            by_step.setdefault(step, []).append(loss)
    n = len(series)
    return [[s, sum(v) / n] for s, v in sorted(by_step.items())
            if len(v) == n and all(x is not None for x in v)]


def spike_scale(w: list[float], log: bool = False) -> tuple[float, float, float]:
    """(median, MAD, scale) of a trailing window: scale = the largest of 1.4826·MAD, the
    step-to-step noise 1.4826·median|Δ|/√2, the upper-tail spread (q90 − median)/1.2816 and
    MAD_FLOOR_REL·|median| (MAD_FLOOR_REL itself for a window of log losses: 0.1 %)."""
    import statistics  # (imported where losses are scored: a traces-only run never is)

    med = statistics.median(w)
    mad = statistics.median(abs(x - med) for x in w)
    steps = [abs(b - a) for a, b in zip(w, w[1:])]
    diff = 1.4826 * statistics.median(steps) / math.sqrt(2) if steps else 0.0
    srt = sorted(w)
    pos = TAIL_Q * (len(srt) - 1)
    lo = int(math.floor(pos))
    q = srt[lo] + (srt[min(lo + 1, len(srt) - 1)] - srt[lo]) * (pos - lo)
    tail = max(q - med, 0.0) / TAIL_Z
    floor = MAD_FLOOR_REL if log else MAD_FLOOR_REL * abs(med)
    return med, mad, max(1.4826 * mad, diff, tail, floor, 1e-12)


def detect_spikes(series: dict, window: int = WINDOW, z_thr: float = Z_THRESHOLD,
                  min_history: int = MIN_HISTORY) -> list[dict]:
    """Upward jumps of each series (key -> [[step, loss]]) against its trailing window."""
    import statistics

    spikes = []
    for r, pts in series.items():
        hist: list[float] = []
        for step, loss in pts:
            if loss is None:
                continue
            if len(hist) >= min_history:
                w = hist[-window:]
                log = loss > 0 and min(w) > 0  # losses are skewed upwards: judge log(loss)
                med, _, scale = spike_scale([math.log(x) for x in w] if log else w, log)
                z = ((math.log(loss) if log else loss) - med) / scale
                # a short history estimates the scale poorly: it needs a larger jump
                if z > z_thr * math.sqrt(window / len(w)):
                    spikes.append({"rank": r, "step": step, "loss": loss,
                                   "median": statistics.median(w), "scale": scale, "log": log,
                                   "z": z})
            hist.append(loss)
    return sorted(spikes, key=lambda s: (s["step"], str(s["rank"])))


def spike_finding(spikes: list[dict], nranks: int) -> Finding:
    steps = sorted({s["step"] for s in spikes})
    ranks = sorted({r for s in spikes for r in s["ranks"]})
    top = max(spikes, key=lambda s: s["z"])
    what = "loss" if nranks == 1 else f"mean loss over {nranks} ranks"
    msg = (f"Loss spike{'s' if len(steps) > 1 else ''} at step{'s' if len(steps) > 1 else ''} "
           f"{', '.join(map(str, steps[:10]))}{' ...' if len(steps) > 10 else ''}: worst step "
           f"{top['step']} {what} {top['loss']:.4g} vs trailing median {top['median']:.4g} "
           f"(z {top['z']:.1f} > {Z_THRESHOLD:g} in units of its own step-to-step variation "
           f"{top['scale']:.3g}, window {WINDOW})"
           + (f"; carried by rank{'s' if len(top['ranks']) > 1 else ''} "
              f"{', '.join(map(str, top['ranks']))}" if nranks > 1 and len(top["ranks"]) < nranks else ""))
    return Finding("loss_spike", "warning", ranks, msg,
                   {"steps": steps, "spikes": spikes[:50], "z_threshold": Z_THRESHOLD,
                    "window": WINDOW, "min_history": MIN_HISTORY,
                    "series": "loss" if nranks == 1 else "mean over ranks",
                    "method": "z over trailing window; scale = max(MAD, step-to-step, upper tail)"})


def rank_outlier_finding(outliers: list[dict]) -> Finding:
    steps = sorted({s["step"] for s in outliers})
    ranks = sorted({s["rank"] for s in outliers})
    top = max(outliers, key=lambda s: s["z"])
    return Finding(
        "loss_spike", "info", ranks,
        f"rank-local loss outlier{'s' if len(outliers) > 1 else ''} not seen in the mean loss "
        f"over the ranks: step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps[:10]))}"
        f"{' ...' if len(steps) > 10 else ''}; worst rank {top['rank']} step {top['step']} loss "
        f"{top['loss']:.4g} vs its trailing median {top['median']:.4g} (z {top['z']:.1f}): one "
        "rank's batch, not the model",
        {"steps": steps, "spikes": outliers[:50], "z_threshold": Z_RANK, "window": WINDOW,
         "series": "per rank"})
