"""Communication vs computation, per rank and profiled step, judged for the job: each rank's trace
is broken down (analyzers/_comm_breakdown.py: compute, communication, the part of communication
hidden under compute, exposed communication, data loading, other, idle — split by collective
type and by mesh dimension — plus host-side stalls); here the ranks' rows are labelled the job's
way and summed per rank (warm-up steps left out), and the exposed communication is judged: less
the time spent waiting for late ranks or for the other ranks to arrive, against the job's steps
outside the profiled window, with the fix for gradients all-reduced by hand. Exact definitions
and the differences from HTA are in docs/comm-compute.md.
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers import _overlap_credit
from trainprof.analyzers._comm_breakdown import is_gpu, rank_breakdown, rank_log
from trainprof.analyzers._peer_waits import late_waits, peer_arrival_waits
from trainprof.analyzers._stats import median
from trainprof.analyzers.estimates import MIN_SAVING, exposed_comm_hidden
from trainprof.analyzers._profiled_window import off_training
from trainprof.analyzers._comm_groups import group_dims, trace_groups
from trainprof.findings import AnalyzerResult, Finding
from trainprof.wording import ranks_phrase

NAME = "comm_compute"
HOST_STALL_FINDING = 0.05     # host blocked in synchronizations ≥ this share of the step
WARMUP_FACTOR = 1.5           # a profiled step this much slower than the others' median is warm-up
UNTYPICAL_WINDOW = 2.0        # profiled steps this much slower than the job's other steps: the
                              # window does not show the job's usual step (the profiler's cost)
CATEGORIES = ("compute_ms", "overlapped_ms", "exposed_comm_ms", "data_ms", "other_ms", "idle_ms")


def trace_digest(run, rank, trace) -> dict:
    """One rank's breakdown per profiled step (rows as rank_breakdown gives them, its groups
    labelled with what this trace and the run's files say) plus what the job needs to label
    them the job's way: the trace's process groups, the label each of its groups got, and
    per row the communication time by group."""
    groups = trace_groups(trace)
    dims = group_dims(run, [groups])
    split, used = [], {}
    rows, hta, kind = rank_breakdown(trace, dims, None if is_gpu(trace) else rank_log(run, rank),
                                     split, used)
    return {"kind": kind, "rows": rows, "hta": hta, "groups": groups, "pg_dims": used,
            "by_pg": split, "whole_trace_window": bool(trace.meta.get("whole_trace_window"))}


def _job_rows(d: dict, dims: dict) -> list[dict]:
    """A digest's rows under the job's group -> dimension labels: as digested when this trace
    alone gave its groups the same labels (the usual case); else each row's by_dim rebuilt from
    its per-group split (groups that share a label summed)."""
    if all(dims.get(p, f"pg {p}") == lab for p, lab in d["pg_dims"].items()):
        return d["rows"]
    out = []
    for row, split in zip(d["rows"], d["by_pg"]):
        acc: dict[str, dict] = {}
        for p, v in split.items():
            a = acc.setdefault(dims.get(p, f"pg {p}") if p else "unknown",
                               {"comm_ms": 0.0, "exposed_ms": 0.0})
            a["comm_ms"] += v["comm_ms"]
            a["exposed_ms"] += v["exposed_ms"]
        out.append(dict(row, by_dim={k: {m: round(x, 4) for m, x in acc[k].items()}
                                     for k in sorted(acc, key=str)}))
    return out


def warmup_steps(rows: list[dict]) -> list[int]:
    """Profiled steps ≥ WARMUP_FACTOR × the median of the other steps (needs ≥ 3 steps)."""
    if len(rows) < 3:
        return []
    w = np.asarray([r["window_ms"] for r in rows], dtype=np.float64)
    others = _medians_of_the_others(w)
    return [r["step"] for r, x, m in zip(rows, w.tolist(), others.tolist()) if x > WARMUP_FACTOR * m]


def _medians_of_the_others(a: np.ndarray) -> np.ndarray:
    """[median(a without a[i]) for every i], from one sort (the median of each copy without one
    value, done one by one, cost steps² at 40,000 profiled steps: 38 s). NaN where a holds one."""
    n = len(a)
    if np.isnan(a).any():
        return np.full(n, np.nan)
    order = np.argsort(a, kind="stable")
    s = a[order]
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)

    def kth(k: int) -> np.ndarray:  # the k-th smallest of the others, for every i
        return np.where(k < pos, s[k], s[min(k + 1, n - 1)])

    m = n - 1
    return kth(m // 2) if m % 2 else (kth(m // 2 - 1) + kth(m // 2)) / 2.0


def _rank_summary(rank, rows, hta, kind, coords) -> dict:
    warm = warmup_steps(rows)
    use = [r for r in rows if r["step"] not in warm] or rows
    tot = {k: sum(r[k] for r in use) for k in ("window_ms", "comm_ms", "sync_ms", "host_step_ms", *CATEGORIES)}
    w = tot["window_ms"] or 1.0
    by_type: dict[str, float] = {}
    by_dim: dict[str, dict] = {}
    for r in use:
        for t, v in r["comm_by_type_ms"].items():
            by_type[t] = by_type.get(t, 0.0) + v
        for d, v in r["by_dim"].items():
            acc = by_dim.setdefault(d, {"comm_ms": 0.0, "exposed_ms": 0.0})
            acc["comm_ms"] += v["comm_ms"]
            acc["exposed_ms"] += v["exposed_ms"]
    n = len(use)
    return {
        "rank": rank, "coords": coords, "kind": kind, "steps": [r["step"] for r in use],
        "warmup_steps": warm, "step_window_ms": round(float(median([r["window_ms"] for r in rows])), 3),
        **{k.replace("_ms", "_fraction"): round(tot[k] / w, 4) for k in CATEGORIES},
        "comm_fraction": round(tot["comm_ms"] / w, 4),
        "tail_exposed_fraction": round(sum(r.get("tail_exposed_ms") or 0.0 for r in use) / w, 4),
        "overlap_of_comm": round(tot["overlapped_ms"] / tot["comm_ms"], 4) if tot["comm_ms"] else 0.0,
        "sync_calls_per_step": round(sum(r["sync_calls"] for r in use) / n, 2),
        "sync_ms_per_step": round(tot["sync_ms"] / n, 3),
        "sync_fraction": round(tot["sync_ms"] / tot["host_step_ms"], 4) if tot["host_step_ms"] else 0.0,
        "d2h_copies_per_step": round(sum(r["d2h_copies"] for r in use) / n, 2),
        "comm_by_type_ms_per_step": {t: round(v / n, 3) for t, v in sorted(by_type.items())},
        "by_dim_ms_per_step": {d: {k: round(v / n, 3) for k, v in acc.items()} for d, acc in sorted(by_dim.items())},
        **({"hta_view": hta} if hta else {}),
    }


def _log_blocked_by_dim(run, dims: dict) -> dict[tuple, float]:
    """(rank, dim) -> ms per step blocked in collectives, from the collective log (steps ≥ 1)."""
    try:
        coll = run.collectives()
    except Exception:  # noqa: BLE001 - the log is optional
        return {}
    if coll.empty or not {"blocked_ms", "pg", "step"} <= set(coll):
        return {}
    coll = coll.loc[coll["step"].ge(1), ["rank", "step", "pg", "blocked_ms"]]
    # the dim of each distinct pg once (millions of records, few groups), grouped by its code
    codes, uniq = pd.factorize(coll["pg"])
    names = [dims.get(str(p), f"pg {p}") for p in uniq]
    na = codes < 0  # records without a pg: named one by one, as before
    extra = [dims.get(str(p), f"pg {p}") for p in coll["pg"].to_numpy(dtype=object)[na]] \
        if na.any() else []
    labels = sorted(set(names) | set(extra))
    at = {d: i for i, d in enumerate(labels)}
    dim = np.array([at[d] for d in names] + [-1], dtype=np.int64)[codes]
    if extra:
        dim[na] = [at[d] for d in extra]
    coll = coll.assign(dim=dim)
    nsteps = coll.groupby("rank")["step"].nunique()
    agg = coll.groupby(["rank", "dim"])["blocked_ms"].sum()
    return {(int(r), labels[d]): round(float(v) / max(int(nsteps[r]), 1), 3)
            for (r, d), v in agg.items()}


def _mesh_dim_table(per_rank: list[dict], blocked: dict) -> list[dict]:
    out, seen = [], set()
    for r in per_rank:
        for d, v in r["by_dim_ms_per_step"].items():
            seen.add((r["rank"], d))
            out.append({"rank": r["rank"], "mesh_dim": d, "comm_ms_per_step": v["comm_ms"],
                        "exposed_ms_per_step": v["exposed_ms"],
                        "blocked_ms_per_step": blocked.get((r["rank"], d))})
    for (rank, d), v in sorted(blocked.items(), key=str):
        if (rank, d) not in seen:
            out.append({"rank": rank, "mesh_dim": d, "comm_ms_per_step": None,
                        "exposed_ms_per_step": None, "blocked_ms_per_step": v})
    return sorted(out, key=lambda x: (x["rank"], str(x["mesh_dim"])))


def analyze(run) -> AnalyzerResult:
    digests = run.trace_digests(NAME)
    if not digests:
        return AnalyzerResult(metrics={}, findings=[])
    dims = group_dims(run, [d["groups"] for _, d in sorted(digests.items())])
    per_step, per_rank, kinds = [], [], set()
    for rank, d in sorted(digests.items()):
        rows, hta, kind = _job_rows(d, dims), d["hta"], d["kind"]
        if not rows:
            continue
        kinds.add(kind)
        summary = _rank_summary(rank, rows, hta, kind, _coords(run, rank))
        if d.get("whole_trace_window"):
            summary["whole_trace_window"] = True
            # no steps: any collective may be the last of its iteration (nothing to hide it)
            summary["tail_exposed_fraction"] = summary["exposed_comm_fraction"]
        per_rank.append(summary)
        run_steps = _run_steps(run, rank, len(rows))
        per_step += [{"rank": rank, **r, "run_step": rs, "warmup": r["step"] in summary["warmup_steps"]}
                     for r, rs in zip(rows, run_steps)]
    if not per_rank:
        return AnalyzerResult(metrics={}, findings=[])
    off = off_training(run, per_rank)
    if off:  # a window of start-up / teardown idle time is no measurement of the training
        run.problems.append(off)
        return AnalyzerResult(metrics={"withheld": off, "per_rank": per_rank}, findings=[])
    med = lambda key: round(float(median([r[key] for r in per_rank])), 4)  # noqa: E731
    job = {"trace_kind": "/".join(sorted(kinds)), "ranks": len(per_rank),
           **{k.replace("_ms", "_fraction"): med(k.replace("_ms", "_fraction")) for k in CATEGORIES},
           "comm_fraction": med("comm_fraction"), "sync_fraction": med("sync_fraction"),
           "warmup_steps": sorted({s for r in per_rank for s in r["warmup_steps"]})}
    metrics = {"job": job, "exposed_comm_fraction": job["exposed_comm_fraction"],
               "per_rank": per_rank, "per_step": per_step,
               "by_mesh_dim": _mesh_dim_table(per_rank, _log_blocked_by_dim(run, dims)),
               "group_dims": dims, "thresholds": {"exposed_comm_saving": MIN_SAVING,
                                                  "host_stall": HOST_STALL_FINDING,
                                                  "warmup_factor": WARMUP_FACTOR},
               "definitions": "docs/comm-compute.md"}
    window = _window_vs_other_steps(run)
    if window:
        metrics["window_vs_other_steps"] = window
    late = late_waits(run, per_rank, NAME)
    if late["wait_ms"]:
        metrics["exposed_comm_fraction_excl_late_ranks"] = late["exposed"]
        metrics["waiting_for_late_ranks"] = {"late": late["late"], "wait_ms_per_step": late["wait_ms"]}
    arrival = peer_arrival_waits(run, per_rank, per_step, NAME)
    if arrival:
        for r in per_rank:
            if r["rank"] in arrival:
                r["peer_arrival_wait_fraction"] = arrival[r["rank"]]
        credit = _overlap_credit.credits(run, per_rank, per_step)  # what overlap removes too
        for r in per_rank:
            r.update(credit.get(r["rank"], {}))
        metrics["exposed_comm_fraction_excl_peer_arrival"] = round(float(median(
            [max(0.0, r["exposed_comm_fraction"] - arrival.get(r["rank"], 0.0)) for r in per_rank])), 4)
    missing = _missing_ranks(run)
    found = _findings(per_rank, job["exposed_comm_fraction"], late, missing, window, arrival)
    for f in found:
        if f.kind == "exposed_comm" and _hand_all_reduce(run, f.evidence):
            f.fix = HAND_ALL_REDUCE_FIX
    return AnalyzerResult(metrics=metrics, findings=found)


HAND_ALL_REDUCE_FIX = (
    "all-reduce the gradients while backward runs, not after it: wrap the model in "
    "DistributedDataParallel (it all-reduces buckets of gradients as they become ready), or "
    "start each gradient's all_reduce(async_op=True) from a hook "
    "(register_post_accumulate_grad_hook) and wait on the works before optimizer.step(); or "
    "communicate less (gradient accumulation, bf16 gradients)")


def _hand_all_reduce(run, evidence: dict) -> bool:
    """The exposed communication is mostly all_reduce in a run directory whose ranks record no
    DDP, FSDP or framework: gradients all-reduced by the job's own code (after backward, as
    nothing else in it would overlap them)."""
    types = evidence.get("comm_by_type_ms_per_step") or {}
    if not types or max(types, key=types.get).replace("_", "") != "allreduce":
        return False
    if getattr(run, "trace_inputs", None):
        return False  # bare traces: what wraps the model is not known
    metas = [run.rank_meta(r) or {} for r in run.ranks]
    return bool(metas) and all(metas) and not any(
        m.get("ddp") or m.get("fsdp") or m.get("framework") or (m.get("run_info") or {}).get("framework")
        or (m.get("run_info") or {}).get("dp_mode") for m in metas)


def _window_vs_other_steps(run) -> dict | None:
    """The profiled steps against the job's other steps (steps.jsonl, steps ≥ 1, medians over
    every rank's steps): {profiled_step_ms, other_step_ms, other_steps, untypical, and
    log_blocked_fraction: the collective log's time blocked in collectives over those other
    steps' time (median over ranks)}. None without step records of both kinds (≥ 3 others)."""
    try:
        st = run.steps()
    except Exception:  # noqa: BLE001 - bare traces have no step records
        return None
    if st is None or st.empty or not {"profiled", "dur_ms", "step", "rank"} <= set(st):
        return None
    st = st.loc[st["step"].ge(1), ["rank", "step", "dur_ms", "profiled"]]
    prof = st["profiled"].eq(True).to_numpy()
    if not prof.any() or (~prof).sum() < 3:
        return None
    p_ms = float(np.median(st["dur_ms"].to_numpy()[prof]))
    other = st.loc[~prof]
    o_ms = float(np.median(other["dur_ms"].to_numpy()))
    out = {"profiled_step_ms": round(p_ms, 3), "other_step_ms": round(o_ms, 3),
           "other_steps": int(other["step"].nunique()),
           "untypical": bool(o_ms > 0 and p_ms >= UNTYPICAL_WINDOW * o_ms),
           "threshold": UNTYPICAL_WINDOW}
    try:
        coll = run.collectives()
    except Exception:  # noqa: BLE001 - the log is optional
        coll = None
    if coll is not None and not coll.empty and {"blocked_ms", "step", "rank"} <= set(coll):
        blocked = coll.groupby(["rank", "step"])["blocked_ms"].sum()
        dur = other.groupby("rank")["dur_ms"].sum()
        shares = []
        for r, total in dur.items():
            steps = other.loc[other["rank"].eq(r), "step"]
            b = blocked.reindex([(r, s) for s in steps]).fillna(0.0).sum()
            if total > 0:
                shares.append(float(b) / float(total))
        if shares:
            out["log_blocked_fraction"] = round(float(np.median(shares)), 4)
    return out


def _missing_ranks(run) -> list[int]:
    """Ranks of the job with no data at all (a partial run: a trace unreadable, a rank lost):
    time the others spend waiting for them looks like exposed communication."""
    try:
        p = run.partial()
    except Exception:  # noqa: BLE001
        return []
    return list((p or {}).get("missing_ranks") or [])


def _run_steps(run, rank, n: int) -> list:
    """The training-step index of each profiled step (meta.json profile_steps), when known:
    ProfilerStep#N counts profiler.step() calls, not the job's steps."""
    try:
        ps = list((run.rank_meta(rank) or {}).get("profile_steps") or [])
    except Exception:  # noqa: BLE001
        ps = []
    return ps if len(ps) == n else [None] * n


def _coords(run, rank) -> dict:
    try:
        return run.coords(rank) or {}
    except Exception:  # noqa: BLE001 - traces without a run directory's meta
        return {}


def _findings(per_rank: list[dict], exposed: float, late: dict | None = None,
              missing: list[int] | None = None, window: dict | None = None,
              arrival: dict | None = None) -> list[Finding]:
    out = []
    # waits for a late rank are that rank's finding (stragglers analyzer), not communication;
    # on CPU traces so is any wait for another rank to arrive (peer_arrival_waits), which
    # holds the late ranks' share: the larger of the two is left out, never both
    adjusted = (late or {}).get("adjusted") or {}
    arrival = arrival or {}
    own = {r["rank"]: min(adjusted.get(r["rank"], r["exposed_comm_fraction"]),
                          max(0.0, r["exposed_comm_fraction"] - arrival.get(r["rank"], 0.0)))
           for r in per_rank}
    judged = round(float(median(list(own.values()))), 4) if (adjusted or arrival) else exposed
    # raised when hiding it is worth it: the overlap bound (estimates.exposed_comm_hidden) of
    # the median rank saves ≥ MIN_SAVING of the step; of an even number of ranks the lower
    # median (in lockstep a rank's saving shortens the step only if its peers' do too)
    ests = {r["rank"]: exposed_comm_hidden(r, own[r["rank"]]) for r in per_rank}
    ranked = sorted((e for e in ests.values() if e), key=lambda e: e["saving_fraction"])
    est = ranked[(len(ranked) - 1) // 2] if ranked else None
    if est and est["saving_fraction"] >= MIN_SAVING:
        worst = sorted(per_rank, key=lambda r: -own[r["rank"]])
        dims: dict[str, float] = {}
        for r in per_rank:
            for d, v in r["by_dim_ms_per_step"].items():
                dims[d] = dims.get(d, 0.0) + v["exposed_ms"] / len(per_rank)
        types: dict[str, float] = {}
        for r in per_rank:
            for t, v in r["comm_by_type_ms_per_step"].items():
                types[t] = types.get(t, 0.0) + v / len(per_rank)
        top_dims = sorted(dims.items(), key=lambda kv: -kv[1])[:3]
        top = sorted(types.items(), key=lambda kv: -kv[1])[:3]
        # a trace without ProfilerStep is one window: its "step" is the whole traced window
        whole = all(r.get("whole_trace_window") for r in per_rank)
        unit, of = ("ms", "traced window (whole trace, no ProfilerStep; ") if whole \
            else ("ms/step", "profiled steps (")
        where = ("; exposed most in " + ", ".join(f"{d} {v:.1f} {unit}" for d, v in top_dims)) if top_dims else ""
        note = ""
        peer = round(float(median([arrival.get(r["rank"], 0.0) for r in per_rank])), 4)
        if adjusted:
            lr = late["late"]
            note = (f" (not counting the time spent waiting for late {ranks_phrase(sorted(lr))}: "
                    f"{exposed:.0%} with it; see that rank's finding)")
        elif arrival and peer > 0:
            note = (f" (not counting the time spent waiting for the other ranks to reach each "
                    f"collective or, in a pipeline, for the upstream stage to send, {peer:.0%} of "
                    f"the step: {exposed:.0%} with it)")
        if missing:  # a rank without data may be the one the others wait for
            note += (f"; {ranks_phrase(sorted(missing))} of the job "
                     f"{'have' if len(missing) > 1 else 'has'} no data here: part of this may be "
                     f"time spent waiting for {'them' if len(missing) > 1 else 'it'}, which cannot "
                     f"be told apart")
        severity = "warning"
        if window and window["untypical"] and not whole:
            # the profiler's own cost (starting it, recording) on small steps: the share is of
            # steps unlike the job's others, and the collective log covers those others
            note += (f"; but the profiled steps took {window['profiled_step_ms']:.1f} ms (median) "
                     f"against {window['other_step_ms']:.1f} ms for the job's other steps: the "
                     "profiler's own cost weighs on this share")
            lb = window.get("log_blocked_fraction")
            if lb is not None:
                note += (f"; over the other steps the collective log puts the time blocked in "
                         f"collectives at {lb:.0%} of the step")
                # the share hideable scaled to the other steps' blocked time
                if judged > 0 and est["saving_fraction"] * lb / judged < MIN_SAVING:
                    severity = "info"
            else:
                note += "; profile steps further into the run (--profile-steps) to check"
        out.append(Finding(
            kind="exposed_comm", severity=severity,  # every rank whose fix is worth it
            ranks=[r["rank"] for r in worst if ests[r["rank"]]
                   and ests[r["rank"]]["saving_fraction"] >= MIN_SAVING],
            message=(f"communication not hidden by compute takes {judged:.0%} of the {of}"
                     f"median rank); hidden under compute, all but the last collective's, it "
                     f"would save up to {est['saving_fraction']:.0%} of the step; largest: "
                     + ", ".join(f"{t} {v:.1f} {unit}" for t, v in top) + where + note),
            estimate=est,
            evidence={"exposed_comm_fraction": judged, "min_saving": MIN_SAVING,
                      "tail_exposed_fraction": {str(r["rank"]): r.get("tail_exposed_fraction")
                                                for r in per_rank},
                      **({"exposed_comm_fraction_with_waits": exposed,
                          "waiting_for_late_ranks_ms": late["wait_ms"], "late_ranks": late["late"]}
                         if adjusted else {}),
                      **({"exposed_comm_fraction_with_waits": exposed,
                          "peer_arrival_wait_fraction": {str(k): v for k, v in sorted(arrival.items())}}
                         if arrival else {}),
                      "per_rank": {str(r["rank"]): own[r["rank"]] for r in per_rank},
                      **({"ranks_without_data": missing} if missing else {}),
                      **({"window_vs_other_steps": window} if window and window["untypical"] else {}),
                      "comm_by_type_ms_per_step": {t: round(v, 2) for t, v in top},
                      "exposed_by_dim_ms_per_step": {d: round(v, 2) for d, v in top_dims}}))
    stalls = [r for r in per_rank if r["sync_fraction"] >= HOST_STALL_FINDING]
    if stalls:
        out.append(Finding(
            kind="host_stall", severity="warning", ranks=[r["rank"] for r in stalls],
            message=(f"the host waits on the GPU (synchronize calls, blocking device-to-host "
                     f"copies from .item()/.cpu()) for up to {max(r['sync_fraction'] for r in stalls):.0%} "
                     f"of the step on {len(stalls)} rank(s) (threshold {HOST_STALL_FINDING:.0%})"),
            evidence={"sync_fraction": {str(r["rank"]): r["sync_fraction"] for r in stalls},
                      "sync_calls_per_step": {str(r["rank"]): r["sync_calls_per_step"] for r in stalls},
                      "sync_ms_per_step": {str(r["rank"]): r["sync_ms_per_step"] for r in stalls},
                      "threshold": HOST_STALL_FINDING}))
    return out
