"""What a fix would buy: the step time with the fix made, from the measured timeline.

Each model takes measured figures (the metrics an analyzer wrote, a finding's evidence) and
returns an estimate::

    {"step_ms_before", "step_ms_after", "saving_ms", "saving_fraction",
     "model": "how it was estimated", "assumptions": [...], "basis": "what the step is"}

or None when the input holds no measure of it. No rule of thumb: every term is a time the run
measured; the assumptions say what the fix is taken to change and what it leaves as it is.
Definitions and the estimates checked against runs with the fix made: docs/estimates.md.
"""

from __future__ import annotations

import math
from statistics import median

MIN_SAVING = 0.05          # a fix worth raising saves at least this share of the step
GRAPH_GAP_US = 2.0         # a CUDA graph replays its kernels about this far apart (launch gap)
START_UP_CALL_MS = 100.0   # one runtime call this long is start-up (context, module load, JIT)


def estimate(before: float | None, after: float | None, model: str, assumptions: list[str],
             basis: str) -> dict | None:
    """The estimate record; None unless both times are positive numbers. ``after`` is clipped
    to [0, before]: a fix never makes the step longer in these models."""
    if not _num(before) or before <= 0 or not _num(after):
        return None
    after = min(max(float(after), 0.0), float(before))
    saving = float(before) - after
    return {"step_ms_before": round(float(before), 3), "step_ms_after": round(after, 3),
            "saving_ms": round(saving, 3), "saving_fraction": round(saving / float(before), 4),
            "model": model, "assumptions": list(assumptions), "basis": basis}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- run directories
def _cols(matrix: dict | None, steps_at: list[int]) -> dict[str, list]:
    return {r: [row[i] if i < len(row) else None for i in steps_at] for r, row in (matrix or {}).items()}


def lockstep_replay(strag: dict, step_ms: float | None, change) -> dict | None:
    """Synchronous data-parallel steps replayed with one rank's time changed.

    Per analysed step s the step is modelled as ``max_r own_r(s) + min_r blocked_r(s)``: every
    rank finishes its own work (compute and input wait), then the collectives complete once
    the last rank arrives; the last rank's own wait (``min blocked``) is the transfer itself.
    ``change(rank, own, busy, data) -> own'`` gives each rank's own time with the fix made. The
    saving is the median over the steps of model(before) − model(after), applied to the job's
    measured median step. From the stragglers analyzer's per-rank, per-step matrices."""
    steps = strag.get("steps") or []
    kept = set(strag.get("steps_analysed") or steps)
    at = [i for i, s in enumerate(steps) if s in kept]
    busy, data = _cols(strag.get("busy_ms_by_rank"), at), _cols(strag.get("data_ms_by_rank"), at)
    wait = _cols(strag.get("wait_ms_by_rank"), at)
    if not busy or not at or not _num(step_ms):
        return None
    savings, modelled = [], []
    for j in range(len(at)):
        own, new, blocked = [], [], []
        for r in busy:
            b = busy[r][j]
            d = (data.get(r) or [0.0] * len(at))[j] or 0.0
            if not _num(b):
                continue
            own.append(b + d)
            new.append(change(int(r), b + d, b, d))
            w = (wait.get(r) or [None] * len(at))[j]
            if _num(w):
                blocked.append(w)
        if not own:
            continue
        tail = min(blocked) if blocked else 0.0
        modelled.append(max(own) + tail)
        savings.append(max(own) - max(new))
    if not savings:
        return None
    return {"saving_ms": float(median(savings)), "modelled_step_ms": float(median(modelled)),
            "steps": len(savings)}


def straggler_removed(strag: dict, step_ms: float | None, evidence: dict) -> dict | None:
    """The job with the straggler running as its peers do: per step, its own time replaced by the
    median of its peers' own time that step (the lockstep replay); without per-step matrices,
    its median excess over its peers removed from the step."""
    k = evidence.get("rank")
    peers = [str(p) for p in evidence.get("peers") or []]
    source = "steps.jsonl and collectives.jsonl, analysed steps"
    if evidence.get("source") == "profiler traces":  # trace_stragglers: the profiled steps
        before = evidence.get("step_window_ms")
        return estimate(before, before - (evidence.get("excess_ms_per_step") or 0.0) if _num(before) else None,
                        "the profiled step minus the straggler's median excess over its peers "
                        "(the others wait for it in collectives)",
                        ["the straggler's extra work is removed; its peers' work is unchanged",
                         "the ranks are in lockstep: the step waits for the slowest rank"],
                        "profiled step window (median)")
    busy = strag.get("busy_ms_by_rank") or {}
    steps = strag.get("steps") or []
    kept = set(strag.get("steps_analysed") or steps)
    at = [i for i, s in enumerate(steps) if s in kept]
    own = {r: [(_v(busy.get(r), i) or 0.0) + (_v((strag.get("data_ms_by_rank") or {}).get(r), i) or 0.0)
               for i in at] for r in busy}
    same_group = peers and all(p in own for p in peers) and len(set(
        (strag.get("peer_groups") or {}).values())) <= 1
    if k is not None and same_group and at:
        excess = float(median([own[str(k)][j] - median([own[p][j] for p in peers])
                               for j in range(len(at))]))
        savings = []
        for j in range(len(at)):
            mine = own[str(k)][j]
            rest = max(own[p][j] for p in own if p != str(k))
            savings.append(max(mine, rest) - max(mine - excess, rest))
        saving = float(median(savings))
        model = ("lockstep replay of the analysed steps: the straggler's own time (step minus "
                 "its collective waits) less its median excess over its peers, each step; the "
                 "step then waits for the slowest rank, its step-to-step variation kept")
    else:
        saving = float(evidence.get("excess_ms") or 0.0)
        model = "the job's median step minus the straggler's median excess over its peers"
    return estimate(step_ms, step_ms - saving if _num(step_ms) else None, model,
                    ["the straggler runs as its peers do (its cause removed: a shared or "
                     "throttled host, extra work, a slow input)",
                     "the ranks are in lockstep: every collective waits for the last rank"],
                    f"job step (slowest rank), median over {source}")


def _v(row, i):
    return row[i] if row and i < len(row) and _num(row[i]) else None


def data_wait_removed(strag: dict, step_ms: float | None, ranks: list[int] | None = None) -> dict | None:
    """The job with its input loaded off the critical path (DataLoader workers prefetching):
    each rank's input wait removed from its own time (the lockstep replay); the step then
    waits for the slowest rank's remaining work."""
    only = {int(r) for r in ranks} if ranks else None
    rep = lockstep_replay(strag, step_ms, lambda r, own, busy, data:
                          busy if only is None or r in only else own)
    if rep is None:
        return None
    return estimate(step_ms, step_ms - rep["saving_ms"],
                    "lockstep replay of the analysed steps without the input wait (data.jsonl): "
                    "per step max over ranks of own time − max over ranks of own time without "
                    "the wait; median over steps",
                    ["the batches are prepared while the step runs (DataLoader num_workers ≥ 1, "
                     "prefetch): the wait disappears as long as the workers together load a "
                     "batch faster than a step computes",
                     "loading in worker processes takes no time from the training thread "
                     "(enough CPU cores for the workers)"],
                    f"job step (slowest rank), median over {rep['steps']} analysed steps")


# --------------------------------------------------------------------------- profiler traces
def host_time_removed(row: dict, part_ms: float, what: str, assumptions: list[str]) -> dict | None:
    """A GPU trace's step without ``part_ms`` of host time, bounded below by the device's busy
    time: the step is ``max(host time, device busy time)`` when the host runs ahead."""
    host, busy = row.get("host_ms_per_step"), row.get("gpu_busy_ms_per_step")
    if not _num(host) or not _num(part_ms):
        return None
    after = max(host - part_ms, busy if _num(busy) else 0.0)
    return estimate(host, after, f"host step time without {what}, bounded below by the device's "
                    "busy time per step (max(host − removed, device busy))",
                    assumptions + ["the device work itself is unchanged"],
                    "host step time per profiled step (rank "
                    f"{row.get('rank')}, launch analyzer)")


def data_loading_trace(row: dict) -> dict | None:
    host = row.get("host_ms_per_step")
    if not _num(host):
        return None
    return host_time_removed(row, host * (row.get("data_share") or 0.0),
                             "the DataLoader wait (enumerate(DataLoader) spans)",
                             ["batches are prepared by DataLoader workers while the step runs"])


def sync_removed_trace(row: dict) -> dict | None:
    host = row.get("host_ms_per_step")
    if not _num(host):
        return None
    return host_time_removed(row, host * (row.get("sync_share") or 0.0),
                             "the blocking synchronizations",
                             ["the values read on the host (.item(), .cpu()) are read less "
                              "often or after the step, so the host no longer waits"])


def host_work_moved(row: dict) -> dict | None:
    """The host's work outside the GPU's window of the step (before its first op, after its
    last: input preprocessing, Python) moved off the training thread or overlapped."""
    out = row.get("outside_ms_per_step")
    if not _num(out):
        return None
    return host_time_removed(row, out, "its work outside the GPU's window (before the first "
                             "kernel, after the last)",
                             ["that work (input preprocessing, bookkeeping) runs in DataLoader "
                              "workers or beside the GPU's work of the step"])


def cuda_graphs(row: dict) -> dict | None:
    """A launch-bound step captured in a CUDA graph: the device runs its kernels back to back
    (GRAPH_GAP_US apart); the data-loader and synchronization time stay on the host."""
    host, busy, k = row.get("host_ms_per_step"), row.get("gpu_busy_ms_per_step"), row.get("kernels_per_step")
    if not (_num(host) and _num(busy)):
        return None
    graph = busy + (k or 0) * GRAPH_GAP_US / 1e3
    rest = host * ((row.get("data_share") or 0.0) + (row.get("sync_share") or 0.0))
    return estimate(host, max(graph, rest),
                    "the step replayed as one CUDA graph: device busy time + kernels × "
                    f"{GRAPH_GAP_US:g} µs, or the host's data-loader and sync time if longer",
                    ["the step is capturable (static shapes, no host synchronization inside)",
                     "the kernels are those of the traced step (torch.compile may fuse more)"],
                    f"host step time per profiled step (rank {row.get('rank')}, launch analyzer)")


def sync_removed_window(row: dict) -> dict | None:
    """comm_compute's rank row: its profiled step window without the blocking syncs, bounded
    below by the device's busy time in the window."""
    win, sync = row.get("step_window_ms"), row.get("sync_ms_per_step")
    if not (_num(win) and _num(sync)):
        return None
    busy = win * (1.0 - (row.get("idle_fraction") or 0.0))
    return estimate(win, max(win - sync, busy),
                    "the profiled step window minus the host's blocking synchronizations, "
                    "bounded below by the device's busy time",
                    ["the values the host reads (.item(), .cpu(), synchronize) are read less "
                     "often or after the step", "the device work itself is unchanged"],
                    f"profiled step window (rank {row.get('rank')}, comm_compute)")


def overlap_hidden(transfer: float, delay: float, compute: float, idle: float) -> float:
    """How much communication overlap hides at most (any unit): ``transfer`` (communication's
    own time, the peers' included) runs under ``compute`` or ``idle`` host time; ``delay`` (the
    host's delay in collectives: cores contended) goes only where the host is idle, since busy
    compute leaves the cores as contended. The largest assignment of the two to the two:
    min(transfer + min(delay, idle), compute + idle)."""
    t, d, c, i = (max(float(x or 0.0), 0.0) for x in (transfer, delay, compute, idle))
    return min(t + min(d, i), c + i)


def exposed_comm_hidden(row: dict, exposed_fraction: float | None = None) -> dict | None:
    """Overlap bound: exposed communication hidden under the step's compute, but for the
    exposed part of the step's last collective (it reduces the last gradients: no compute is
    left to hide it), and at most as much compute as is not yet overlapping communication.

    On CPU ranks the row may carry what comm_compute's peer-arrival rule left out of
    ``exposed_fraction`` but overlap removes too (analyzers/_overlap_credit.py): waits chained
    from a peer's previous collective (its transfer: ``chained_transfer_fraction``, its host's
    delay: ``chained_delay_fraction``), the rank's own host delay (``host_delay_fraction``), and
    the host's idle time (``idle_host_fraction``) to hide under (:func:`overlap_hidden`)."""
    win = row.get("step_window_ms")
    if not _num(win):
        return None
    full = row.get("exposed_comm_fraction") or 0.0
    ex = exposed_fraction if _num(exposed_fraction) else full
    tail = row.get("tail_exposed_fraction") or 0.0
    comp = row.get("compute_fraction") or 0.0
    f = lambda k: max(float(row.get(k) or 0.0), 0.0)  # noqa: E731
    base = max(ex - tail, 0.0)
    # the credits are parts of what exposed_fraction left out: never more than that
    room = max(full - tail - base, 0.0)
    chained_t, chained_d, delay = f("chained_transfer_fraction"), f("chained_delay_fraction"), \
        f("host_delay_fraction")
    got = chained_t + chained_d + delay
    scale = min(1.0, room / got) if got > 0 else 0.0
    idle = f("idle_host_fraction")
    hide = win * overlap_hidden(base + chained_t * scale, (chained_d + delay) * scale, comp, idle)
    credited = got > 0 or idle > 0
    return estimate(win, win - hide,
                    "overlap bound: the profiled step window minus its exposed communication "
                    "but the last collective's (min(exposed − last collective's exposed, "
                    "compute not yet overlapping communication))"
                    + ("; on CPU, waits for a peer still in its previous collective count as "
                       "communication, and the host's delay in collectives is hidden too where "
                       "the host is idle (min(transfer + min(host delay, idle), compute + idle))"
                       if credited else ""),
                    ["the collectives are issued early enough to run under independent compute "
                     "(DDP buckets / FSDP prefetch / async TP); the transfers take as long as now",
                     "the step's last collective stays exposed: it waits for the last gradients",
                     "an upper bound on the saving: dependencies may leave part exposed",
                     *(["the host's delay in collectives (cores contended) goes only when they run "
                        "while the host sleeps or waits (idle time measured per step)"]
                       if credited else [])],
                    f"profiled step window (rank {row.get('rank')}, comm_compute)")


def ddp_buckets_merged(ddp: dict, step_ms: float | None) -> dict | None:
    """DDP's gradient buckets merged to a larger ``bucket_cap_mb``: each rank's backward from
    its first bucket launch to its last bucket's completion (the span) replayed with the
    merged buckets (analyzers/_ddp_buckets.py: the backward compute per bucket and each
    bucket's all-reduce time ``alpha + beta × bytes`` as measured). Lockstep replay: a step
    after the fix takes the max over ranks of its step − span + replayed span; the estimate
    is the median over the analysed steps. Rows without their step time: the job's median
    step less the median over steps of the median over ranks of span − replayed span."""
    rows = ddp.get("per_rank_step") or []
    if not rows or not _num(step_ms) or all(r["buckets_after"] >= r["buckets"] for r in rows):
        return None  # nothing to merge: the job's buckets are as large as the cap makes them
    by_step: dict = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    if all(_num(r.get("step_ms")) for r in rows):
        after = float(median([max(r["step_ms"] - r["span_ms"] + r["span_ms_after"] for r in v)
                              for v in by_step.values()]))
    else:
        after = step_ms - float(median([median([r["span_ms"] - r["span_ms_after"] for r in v])
                                        for v in by_step.values()]))
    cap = ddp.get("target_cap_bytes") or 0
    return estimate(step_ms, after,
                    f"backward replayed with DDP's buckets merged to {cap / 2 ** 20:g} MB "
                    f"({ddp.get('buckets_per_step'):g} → {ddp.get('buckets_after')} per step): "
                    "launched as their last gradient is ready (the measured median "
                    f"{ddp.get('gap_ms', 0):.3f} ms per bucket of backward), each all-reduce "
                    f"{ddp.get('alpha_ms', 0):.3f} ms + {ddp.get('beta_ms_per_mb', 0):.3f} ms/MB "
                    "(fitted to the measured buckets), one after the other; each step the max "
                    "over ranks of step − span + replayed span (span: first launch → last "
                    "completion), median over steps",
                    ["an all-reduce costs what the measured ones cost for its size (fixed "
                     "latency + bytes)", "the backward compute between gradients is unchanged; "
                     "the per-bucket hook and launch costs go with the buckets"],
                    f"job step (slowest rank), median over {len(by_step)} analysed steps")


def amp(classes: list[dict], peaks: dict | None, row: dict | None, steps: int) -> dict | None:
    """Tensor-core-eligible fp32 work (matmul, conv, attention) run in bf16/fp16: each class's
    measured time scaled by the peak ratio fp32 → tensor-core dtype at its measured share of
    peak, but never below half its time (its bytes halve); the step is max(host, device busy −
    saving) per profiled step."""
    if not peaks or not row or steps <= 0:
        return None
    fl = peaks.get("flops_per_s") or {}
    tc = fl.get("bf16") or fl.get("fp16")
    f32 = fl.get("fp32")
    if not (tc and f32):
        return None
    eligible = [c for c in classes if str(c.get("op_class", "")).lower() in ("matmul", "conv", "attention", "sdpa")]
    t = sum(c.get("time_ms") or 0.0 for c in eligible) / steps
    if t <= 0:
        return None
    after_ops = t * max(f32 / tc, 0.5)
    host, busy = row.get("host_ms_per_step"), row.get("gpu_busy_ms_per_step")
    if not (_num(host) and _num(busy)):
        return None
    before = max(host, busy)
    return estimate(before, max(host, busy - (t - after_ops)),
                    "tensor-core-eligible fp32 op time (roofline classes) scaled by the device's "
                    f"fp32 ÷ bf16 peak ({f32 / tc:.3f}, at least 0.5: the bytes halve); the step "
                    "is max(host time, device busy time)",
                    ["autocast to bf16/fp16 keeps each op at its measured share of peak",
                     "the loss scale/precision is acceptable for the model"],
                    f"profiled step (rank {row.get('rank')}, launch and roofline analyzers)")


def amp_overview(job: dict, peaks: dict | None, host_ms: float | None) -> dict | None:
    """AMP from the GPU overview (metrics.gpu_overview.job): kernel time per step launched by
    tensor-core-eligible ops on fp32 inputs, scaled by the fp32 ÷ bf16 peak ratio (at least
    0.5); the step is max(host time, device step − saving)."""
    fl = (peaks or {}).get("flops_per_s") or {}
    tc, f32 = fl.get("bf16") or fl.get("fp16"), fl.get("fp32")
    step, kern, share = job.get("step_ms"), job.get("kernel_ms"), job.get("tc_eligible_fp32_share")
    if not (tc and f32 and _num(step) and _num(kern) and _num(share)) or share <= 0:
        return None
    t = kern * share
    saving = t - t * max(f32 / tc, 0.5)
    after = max(step - saving, host_ms if _num(host_ms) else 0.0)
    return estimate(step, after,
                    f"kernel time of tensor-core-eligible ops on fp32 inputs ({share:.0%} of "
                    f"kernel time) × (1 − max(fp32 ÷ bf16 peak = {f32 / tc:.3f}, 0.5)); the step "
                    "is max(host time, device step − saving)",
                    ["autocast to bf16/fp16 keeps each op at its measured share of peak",
                     "the model trains as well in mixed precision (fp32 master weights kept)"],
                    "device step per profiled step (gpu_overview, mean over ranks)")


# --------------------------------------------------------------------------- pipeline
def more_micro_batches(pipe: dict, step_ms: float | None, factor: int = 2) -> dict | None:
    """The pipeline with ``factor``× the micro-batches (same global batch). A micro-batch's time
    at 1/factor the size is ``ratio`` × its time now: from the per-op split of the profiled
    window (pipe["micro_batch_cost"], analyzers/_mb_cost.py; factor 2 only) when there is one,
    else 1/factor (compute per sample unchanged). Busy time becomes busy × factor × ratio; the
    schedule's fill/drain idle (measured bubble − hand-overs, from the replay with free
    hand-overs, analyzers/_pipeline_replay.py) is (p − 1) micro-batches long: × ratio; the
    hand-over idle grows as m (one transfer per micro-batch and stage boundary): × factor.
    A prediction longer than the step now is kept as ``step_ms_predicted``."""
    d = pipe.get("decomposition") or {}
    cfg = pipe.get("config") or {}
    ps = pipe.get("per_stage") or []
    b = pipe.get("bubble_fraction")
    if not (_num(step_ms) and _num(b) and ps and cfg.get("micro_batches")):
        return None
    window = median([s["window_ms"] for s in ps if _num(s.get("window_ms"))] or [0.0])
    if window <= 0:
        return None
    mbc = pipe.get("micro_batch_cost") or {}
    per_op = factor == 2 and _num(mbc.get("ratio")) and mbc["ratio"] > 0
    ratio = float(mbc["ratio"]) if per_op else 1.0 / factor
    busy = window * (1 - b)
    hand = d.get("handovers") if _num(d.get("handovers")) else 0.0
    sched = b - hand  # theory + uneven: the fill/drain of the schedule
    after_window = busy * factor * ratio + window * (sched * ratio + hand * factor)
    m = cfg["micro_batches"]
    after = step_ms - (window - after_window)
    if per_op:
        single = mbc.get("single_size_share")
        how = (f"a micro-batch of half the size takes {ratio:.2f}× its time now: per op kind of "
               "the profiled window a fitted time = fixed + per-unit × work (FLOPs from shapes, "
               "else the numel of the inputs), the ops' batch dimension halved")
        cost = ["each op kind costs a fixed time plus a time per unit of work, as fitted over "
                "the sizes it ran at in the profiled window; a kind seen at one size only is "
                "taken as proportional to its work"
                + (f" ({single:.0%} of the ops' time)" if _num(single) else ""),
                "the time between ops (dispatch, Python, the schedule) is kept per micro-batch; "
                "the profiler's own overhead per op counts as fixed cost"]
    else:
        how = f"a micro-batch of 1/{factor} the size takes 1/{factor} of its time now"
        cost = ["compute per sample is the same at the smaller micro-batch (no profiled window "
                "of the pipeline's F/B spans to split a micro-batch's fixed cost from its "
                "per-sample cost)"]
    rec = estimate(step_ms, after,
                   f"pipeline window with {factor * m} micro-batches instead of {m}: {how}; busy "
                   f"time × {factor} × {ratio:.2f}, the schedule's fill/drain idle (measured "
                   f"bubble − hand-overs, from the replay with free hand-overs) × {ratio:.2f}, the "
                   f"hand-over idle × {factor}",
                   ["the global batch is unchanged (micro-batches of 1/factor the size)", *cost,
                    "each hand-over costs what it costs now"],
                   "job step (slowest rank), median over analysed steps")
    if rec is not None and after > step_ms:
        rec["step_ms_predicted"] = round(after, 3)
    return rec


def stage_rebalanced(pipe: dict, step_ms: float | None, evidence: dict) -> dict | None:
    """The slow stage brought to the median stage's compute per micro-batch: the pipeline runs
    at its slowest stage's pace, so the step loses (slow − median) per micro-batch per pass."""
    stages = pipe.get("stages") or []
    cfg = pipe.get("config") or {}
    vals = [s.get("compute_ms_per_mb") for s in stages if _num(s.get("compute_ms_per_mb"))]
    slow = evidence.get("compute_ms_per_mb")
    m = cfg.get("micro_batches")
    if not (_num(step_ms) and _num(slow) and vals and m):
        return None
    target = median(vals)
    return estimate(step_ms, step_ms - (slow - target) * m,
                    "the slow stage's compute per micro-batch brought to the median stage's: the "
                    "pipeline advances at its slowest stage, m micro-batches per step",
                    ["layers can be moved so that the stages' compute evens out"],
                    "job step (slowest rank), median over analysed steps")


def slow_steps_removed(evidence: dict, job: dict) -> dict | None:
    """The mean step without the slow steps (run at the median): what a periodic stall
    (checkpoint, evaluation, GC) costs the job's throughput."""
    mean, med = job.get("mean_ms"), job.get("median_ms")
    if not (_num(mean) and _num(med)):
        return None
    return estimate(mean, med, "the mean step with the slow steps run at the median step",
                    ["the slow steps' extra work (checkpoint, evaluation, GC, a stall) is "
                     "removed or moved off the training loop"],
                    "job step, mean over analysed steps")


def start_up_steps(per_step: list[dict]) -> list[dict]:
    """Profiled steps that are start-up, not steady state: one runtime call ≥ START_UP_CALL_MS
    (CUDA context set-up, module loading, first-call compilation)."""
    return [p for p in per_step if _num(p.get("max_call_ms")) and p["max_call_ms"] >= START_UP_CALL_MS]
