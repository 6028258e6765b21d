"""What to change, and what it would buy: a ``fix`` and an ``estimate`` on every finding, and the
list of actions ranked by estimated saving ("What to change first").

Runs after the analyzers, on their metrics and findings (never on the fault-injection ground
truth). A finding whose analyzer set neither gets them here: ``fix`` from its kind and evidence,
``estimate`` from the matching model of analyzers/estimates.py (null for findings that are not
about speed: a NaN, a hang, a desync). Findings whose fix would save less than
``estimates.MIN_SAVING`` of the step become ``info``; the others are ``actions``, after the
findings that stopped the job or made it compute wrong values (``actions``). docs/estimates.md
has the models and the estimates checked against runs with the fix.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainprof.analyzers import estimates as est
from trainprof.devices import lookup

# what to change, per kind (a finding's own ``fix`` wins; device_starved by its cause)
FIXES = {
    "straggler": "find out why this rank is slower (its cause below: another process on the host, "
                 "a throttled or slower device, extra work on that rank) and remove it, or move "
                 "the rank to a healthy host",
    "data_starvation": "load input off the training thread: DataLoader(num_workers=N ≥ 2, "
                       "pin_memory=True, prefetch_factor=2, persistent_workers=True), or make the "
                       "dataset's __getitem__ cheaper",
    "exposed_comm": "overlap communication with compute: larger DDP buckets (bucket_cap_mb) issued "
                    "during backward, FSDP prefetch (forward/backward_prefetch), async tensor "
                    "parallel; or communicate less (gradient accumulation with no_sync, bf16 "
                    "gradients)",
    "host_stall": "take host reads of device values (.item(), .cpu(), .tolist(), print of a tensor, "
                  "torch.cuda.synchronize) out of the step, or do them every N steps",
    "pipeline_bubble": "use more micro-batches per step (same global batch) or an interleaved / "
                       "zero-bubble schedule (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)",
    "stage_imbalance": "move layers from the slow stage to the others so that each stage's compute "
                       "per micro-batch is about equal",
    "roofline": "run the matmuls in bf16/fp16 (torch.autocast) or allow TF32; fuse small "
                "memory-bound ops (torch.compile), use fused optimizers (fused=True)",
    "slow_steps": "find what the slow steps do that the others do not (checkpoint, evaluation, "
                  "garbage collection, logging) and move it off the training loop or make it "
                  "asynchronous",
    "uneven_steps": "make every rank run the same number of steps (drop_last=True, a "
                    "DistributedSampler, the same stopping condition on every rank)",
    "process_group_not_destroyed": "call torch.distributed.destroy_process_group() on every rank "
                                   "once training is done (after the last collective)",
    "no_communication": "check that the ranks really train together (DDP/FSDP wraps the model, "
                        "the process group is initialized with the world size)",
    "nan_origin": "fix the first operation that produced the non-finite value (its module and "
                  "op are named): lower the learning rate, clip gradients, use a stable formula "
                  "(log_softmax, eps), or bf16 instead of fp16",
    "loss_spike": "lower the learning rate or add warm-up, clip gradients, look for bad batches "
                  "at those steps",
    "hang": "look at the stack and in-flight collective of the rank named: a rank that did not "
            "reach the collective the others wait in (a branch on rank, an exception, a deadlock)",
    "rank_failure": "read the failed rank's error and stack: fix it there; the others ended "
                    "because it did",
    "desync": "make every rank issue the same collectives in the same order (no collective "
              "inside a rank-dependent branch; the same shapes and dtypes)",
    "memory": "reduce the peak: activation checkpointing, a smaller micro-batch, FSDP/ZeRO "
              "sharding, or freeing the tensors named before the peak",
    "fragmentation": "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or allocate the "
                     "large buffers once and reuse them",
    "expert_imbalance": "even out the experts' load: an auxiliary load-balancing loss, a capacity "
                        "factor, or expert placement that spreads the busy experts",
    "throughput_drop": "look at what changed at the onset step: the stragglers named here, a node "
                       "or a shared file system slowing down, a data phase, a memory leak pushing "
                       "the allocator",
    "memory_growth": "find what keeps growing from the onset step (tensors kept across steps: "
                     "losses not .detach()ed, caches, lists of outputs) and free it",
}
_STARVED = {
    "launch": "capture the step in a CUDA graph (torch.compile(mode=\"reduce-overhead\") or "
              "torch.cuda.graphs), or make kernels larger (bigger batch, fused ops)",
    "data_loader": FIXES["data_starvation"],
    "synchronization": FIXES["host_stall"],
    "host_work": "move the step's host work outside the GPU's window (input decoding and "
                 "preprocessing, Python bookkeeping) into DataLoader workers (the dataset's "
                 "transforms, num_workers ≥ 2) or overlap it with the GPU (prepare the next batch "
                 "while the current one runs)",
}


def advise(metrics: Mapping, findings: list[dict]) -> list[dict]:
    """Fill in ``fix`` and ``estimate`` on every finding (dicts, in place); findings that would
    save less than MIN_SAVING become ``info``; a fix no analyzer names but the measurements
    price at ≥ MIN_SAVING (AMP for fp32 tensor-core work) is added as a finding. Returns the
    actions, largest saving first."""
    findings.extend(extra_findings(metrics, findings))
    for f in findings:
        if not f.get("fix"):
            f["fix"] = _fix(f)
        if f.get("estimate") is None:
            try:
                f["estimate"] = _estimate(f, metrics)
            except Exception as e:  # noqa: BLE001 - a model's bug must not lose the finding
                f["estimate"] = None
                f.setdefault("evidence", {})["estimate_error"] = f"{type(e).__name__}: {e}"
        e = f.get("estimate")
        if e and e["saving_fraction"] < est.MIN_SAVING and f.get("severity") == "warning":
            f["severity"] = "info"
    return actions(findings)


def saving(f: Mapping) -> float:
    e = f.get("estimate")
    return float(e["saving_fraction"]) if isinstance(e, Mapping) and e.get("saving_fraction") is not None else -1.0


SEVERITY_RANK = {"critical": 0, "error": 1, "warning": 2, "info": 3}
BLOCKING = ("critical", "error")  # the job did not finish, or what it computes is wrong
# why a blocking finding leads, per kind (others: BLOCKED_DEFAULT)
BLOCKED = {"rank_failure": "the job did not finish", "hang": "the job hung",
           "desync": "the ranks issued different collectives",
           "memory": "a rank ran out of memory", "fragmentation": "a rank ran out of memory",
           "nan_origin": "the training computes non-finite values"}
BLOCKED_DEFAULT = "the job failed or computes wrong values"


def actions(findings: list[dict]) -> list[dict]:
    """"What to change first": the findings that stop the job or make it compute wrong values
    (severity critical or error: a rank failure, a hang, a desync, a NaN, an out-of-memory)
    first, most severe first, with ``blocked`` saying why and no saving; then the findings
    whose fix saves ≥ MIN_SAVING of the step, warnings before info (a shared host's contention
    never leads), largest saving first. Each with a one-sentence evidence and the report
    section it comes from. ``finding`` is the index in ``findings`` (sorted as summary.json has
    them)."""
    out = []
    for i, f in enumerate(findings):
        sev = f.get("severity")
        e = f.get("estimate")
        worth = isinstance(e, Mapping) and (e.get("saving_fraction") or 0) >= est.MIN_SAVING
        if sev not in BLOCKING and not worth:
            continue
        a = {"finding": i, "kind": f.get("kind"), "severity": sev, "fix": f.get("fix"),
             "saving_ms": None, "saving_fraction": None, "step_ms_before": None,
             "step_ms_after": None, "evidence": sentence(f.get("message") or ""),
             "section": f"s-{f.get('analyzer') or f.get('kind')}"}
        if sev in BLOCKING:
            a["blocked"] = BLOCKED.get(f.get("kind"), BLOCKED_DEFAULT)
        if worth:
            a.update({k: e[k] for k in ("saving_ms", "saving_fraction", "step_ms_before",
                                         "step_ms_after")})
        out.append(a)
    out.sort(key=lambda a: (SEVERITY_RANK.get(a["severity"], 9), -(a["saving_fraction"] or 0.0)))
    return out


def sentence(msg: str, limit: int = 240) -> str:
    """A finding's message cut to its first clause (before '; ' or ' — '), at most ``limit``."""
    cut = len(msg)
    for sep in ("; ", " — "):
        i = msg.find(sep)
        if 0 < i < cut:
            cut = i
    s = msg[:cut].rstrip(" ,:")
    return s if len(s) <= limit else s[:limit - 1].rstrip() + "…"


def _fix(f: Mapping) -> str:
    kind = f.get("kind")
    ev = f.get("evidence") or {}
    if kind == "device_starved":
        return _STARVED.get(ev.get("cause"), _STARVED["launch"])
    if kind == "straggler" and ev.get("cause") == "input":
        return FIXES["data_starvation"]
    return FIXES.get(kind, "")


def _job_step(metrics: Mapping) -> float | None:
    job = (metrics.get("step_time") or {}).get("job") or {}
    return job.get("median_ms")


def _row(rows, rank) -> dict | None:
    return next((r for r in rows or [] if r.get("rank") == rank), None)


def _estimate(f: Mapping, metrics: Mapping) -> dict | None:
    kind, ev = f.get("kind"), f.get("evidence") or {}
    strag = metrics.get("stragglers") or {}
    step = _job_step(metrics)
    if kind == "straggler":
        return est.straggler_removed(strag, step, ev)
    if kind == "data_starvation":
        return est.data_wait_removed(strag, step, [int(r) for r in (ev.get("ranks") or {})] or f.get("ranks"))
    launch = metrics.get("launch") or {}
    if kind == "device_starved":
        rows = [r for r in launch.get("per_rank") or [] if r.get("rank") in set(f.get("ranks") or [])]
        model = {"data_loader": est.data_loading_trace, "synchronization": est.sync_removed_trace,
                 "launch": est.cuda_graphs, "host_work": est.host_work_moved}.get(
                     ev.get("cause"), est.cuda_graphs)
        return _worst([model(r) for r in rows])
    cc = metrics.get("comm_compute") or {}
    if kind == "host_stall":
        rows = [r for r in cc.get("per_rank") or [] if r.get("rank") in set(f.get("ranks") or [])]
        return _worst([est.sync_removed_window(r) for r in rows])
    if kind == "exposed_comm":
        per = {str(k): v for k, v in (ev.get("per_rank") or {}).items()}
        rows = cc.get("per_rank") or []
        return _median_est([est.exposed_comm_hidden(r, per.get(str(r.get("rank")))) for r in rows])
    pipe = metrics.get("pipeline") or {}
    if kind == "pipeline_bubble":
        return est.more_micro_batches(pipe, step)
    if kind == "stage_imbalance":
        return est.stage_rebalanced(pipe, step, ev)
    if kind == "slow_steps":
        return est.slow_steps_removed(ev, (metrics.get("step_time") or {}).get("job") or {})
    if kind == "roofline":
        return _amp(metrics)
    return None


def extra_findings(metrics: Mapping, findings: list[dict]) -> list[dict]:
    """AMP: fp32 work on tensor-core-eligible ops whose move to bf16 saves ≥ MIN_SAVING."""
    if any(f.get("kind") == "roofline" for f in findings):
        return []  # the roofline finding carries the AMP estimate itself
    e = _amp(metrics)
    if not e or e["saving_fraction"] < est.MIN_SAVING:
        return []
    share = ((metrics.get("gpu_overview") or {}).get("job") or {}).get("tc_eligible_fp32_share")
    what = (f"{share:.0%} of kernel time is in tensor-core-eligible ops on fp32 inputs"
            if isinstance(share, (int, float)) else "matmul/conv/attention ops run in fp32")
    return [{"kind": "roofline", "severity": "warning", "ranks": [],
             "message": f"{what}: in bf16/fp16 on tensor cores they would take "
                        f"{e['saving_ms']:.3g} ms less per step",
             "evidence": {"tc_eligible_fp32_share": share, "compute_dtype": "fp32"},
             "analyzer": "roofline", "fix": "enable automatic mixed precision: torch.autocast("
             "device_type=\"cuda\", dtype=torch.bfloat16) around forward and loss (fp32 master "
             "weights stay), or torch.backends.cuda.matmul.allow_tf32 = True", "estimate": e}]


def _peaks_of(metrics: Mapping) -> dict | None:
    devs = ((metrics.get("gpu_overview") or {}).get("job") or {}).get("devices") or []
    basis = ((metrics.get("roofline") or {}).get("peak") or {}).get("basis") or ""
    for name in list(devs) + [basis.replace("datasheet ", "")]:
        p = lookup(name)
        if p:
            return p
    return None


def _amp(metrics: Mapping) -> dict | None:
    roof = metrics.get("roofline") or {}
    go = (metrics.get("gpu_overview") or {}).get("job") or {}
    rows = (metrics.get("launch") or {}).get("per_rank") or []
    host = max((r.get("host_ms_per_step") or 0.0 for r in rows), default=None)
    if go.get("tc_eligible_fp32_share") is not None:
        return est.amp_overview(go, _peaks_of(metrics), host)
    return _amp_roofline(metrics)


def _amp_roofline(metrics: Mapping) -> dict | None:
    roof = metrics.get("roofline") or {}
    if roof.get("compute_dtype") not in ("fp32", None):
        return None
    peaks = _peaks_of(metrics)
    rows = (metrics.get("launch") or {}).get("per_rank") or []
    steps = len({(p.get("rank"), p.get("step")) for p in (metrics.get("launch") or {}).get("per_step") or []})
    # the classes' times are summed over every rank's profiled steps: per rank-step
    return est.amp(roof.get("classes") or [], peaks, rows[0] if rows else None, max(steps, 1)) \
        if rows else None


def _worst(ests: list) -> dict | None:
    """The estimate of the rank whose fix saves most (the job runs at its slowest rank)."""
    ests = [e for e in ests if e]
    return max(ests, key=lambda e: e["saving_ms"]) if ests else None


def _median_est(ests: list) -> dict | None:
    ests = sorted((e for e in ests if e), key=lambda e: e["saving_fraction"])
    return ests[(len(ests) - 1) // 2] if ests else None  # the lower of two middle ones
