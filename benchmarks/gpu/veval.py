"""The validation suite's pass criteria over a run directory and its summary.json.

Pure functions: evaluate(v, run, summary, cuda) records each criterion in the Verdict v. They
read only what trainprof wrote (and, for the fault checks, the ground truth the reference job
wrote in injected.json: a check compares findings with it, as the tests do). validate.py calls
them on the runs it just made; tests/unit/trainprof/test_gpu_validated_fixtures.py calls them
again on the committed fixtures (re-analyzed on CPU), with the same cuda flag the fixture was
made with.
"""

from __future__ import annotations

import json
from pathlib import Path

from vcore import Verdict, read_jsonl

# finding kinds that name a fault: a clean run has none
FAULT_KINDS = {"nan_origin", "loss_spike", "hang", "straggler", "fragmentation", "data_starvation"}
SCORE_MIN = 0.25  # the fragmentation finding's own threshold (analyzers/fragmentation.py)


def rank_dir(run: Path, r: int = 0) -> Path:
    return run / "ranks" / f"rank-{r:05d}"


def meta(run: Path, r: int = 0) -> dict:
    p = rank_dir(run, r) / "meta.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def injected(run: Path) -> list[dict]:
    p = run / "injected.json"
    return json.loads(p.read_text())["injections"] if p.is_file() else []


def findings(summary: dict, kind: str) -> list[dict]:
    return [f for f in summary.get("findings", []) if f["kind"] == kind]


def _common(v: Verdict, summary: dict, world: int, backend: str | None) -> None:
    run = summary.get("run", {})
    v.need(f"job exit 0 (got {run.get('exit_code')})", run.get("exit_code") == 0)
    v.need(f"world size {world} (got {run.get('world_size')})", run.get("world_size") == world)
    if backend:
        v.need(f"backend {backend} (got {run.get('backend')})", run.get("backend") == backend)
    errs = summary.get("errors") or []
    v.need("no analyzer errors" + (f" (got {errs[0]})" if errs else ""), not errs)


def _device(v: Verdict, run: Path, ranks, cuda: bool) -> str:
    names = {meta(run, r).get("device_name") for r in ranks}
    devs = {str(meta(run, r).get("device")) for r in ranks}
    if cuda:
        v.need(f"every rank on cuda:0 (got {sorted(devs)})", devs == {"cuda:0"})
        v.need(f"device name recorded (got {sorted(map(str, names))})", None not in names)
    else:
        v.need(f"every rank on cpu (got {sorted(devs)})", devs == {"cpu"})
    return ", ".join(sorted(map(str, names)))


def eval_reference(v: Verdict, run: Path, summary: dict, cuda: bool, steps: int) -> None:
    """The clean reference job, one rank: analysed without problems, the trace of the
    device's kind, every step recorded, no fault finding."""
    _common(v, summary, 1, "nccl" if cuda else "gloo")
    _device(v, run, [0], cuda)
    probs = summary.get("problems") or []
    v.need("no problems" + (f" (got {probs[0]})" if probs else ""), not probs)
    m = summary.get("metrics", {})
    kind = m.get("comm_compute", {}).get("job", {}).get("trace_kind")
    want = "gpu" if cuda else "cpu"
    v.need(f"profiler trace of kind {want} (got {kind})", kind == want)
    st = m.get("step_time", {}).get("job", {})
    v.need(f"{steps} steps recorded (got {st.get('steps_recorded')})", st.get("steps_recorded") == steps)
    ops = m.get("ops", {}).get("job", {})
    kps = ops.get("kernels_per_step") or 0
    if cuda:
        v.need(f"GPU kernels in the profiled steps (got {kps})", kps > 0)
    else:
        v.need(f"no GPU kernels on CPU (got {kps})", kps == 0)
    bad = sorted({f["kind"] for f in summary.get("findings", []) if f["kind"] in FAULT_KINDS})
    v.need(f"clean run: no fault finding (got {bad})", not bad)
    v.number = f"{st.get('median_ms') or 0:.1f} ms/step, {kps:.0f} kernels/step"


def eval_two_ranks(v: Verdict, run: Path, summary: dict, cuda: bool, rank: int) -> None:
    """Two ranks sharing one GPU over gloo, one of them fed slowly (slow_data: its DataLoader
    sleeps): found as data starvation of that rank alone, and not as a straggler. (A GPU-side
    straggler would slow both ranks on one GPU: their kernels share it.)"""
    _common(v, summary, 2, "gloo")
    _device(v, run, [0, 1], cuda)
    inj = [i for i in injected(run) if i["kind"] == "slow_data"]
    v.need("slow_data injected and performed", inj and inj[0]["performed"])
    f = findings(summary, "data_starvation")
    ranks = sorted({r for x in f for r in x["ranks"]})
    v.need(f"data_starvation finding names rank {rank} alone (got {ranks})", ranks == [rank])
    other = sorted({x["kind"] for x in summary.get("findings", [])
                    if x["kind"] in FAULT_KINDS - {"data_starvation"}})
    v.need(f"no other fault finding (got {other})", not other)
    per = {p["rank"]: p for p in summary.get("metrics", {}).get("stragglers", {}).get("per_rank", [])}
    wait = {r: per.get(r, {}).get("data_wait_ms") for r in (0, 1)}
    if None not in wait.values():
        v.number = f"rank {rank} waits {wait[rank]:.0f} ms/step for data (rank {1 - rank}: {wait[1 - rank]:.1f})"
    else:
        v.number = f"data starvation ranks {ranks}"


def eval_nan(v: Verdict, run: Path, summary: dict, cuda: bool) -> None:
    """The injected NaN/Inf found on its rank, step, phase, module and creating op."""
    _common(v, summary, 1, "nccl" if cuda else "gloo")
    (inj,) = [i for i in injected(run) if i["kind"] == "nan"] or [None]
    if not v.need("nan injected (injected.json)", inj):
        return
    p = inj["params"]
    want_op = "aten::log" if p["value"] == "nan" else "aten::mul"  # reference/faults.py _corrupt
    f = findings(summary, "nan_origin")
    if not v.need(f"one nan_origin finding (got {len(f)})", len(f) == 1):
        return
    ev = f[0]["evidence"]
    got = (f[0]["ranks"], ev.get("step"), ev.get("phase"), ev.get("module"), ev.get("op"))
    want = ([p["rank"]], p["step"], p["phase"], p["module"], want_op)
    v.need(f"rank/step/phase/module/op {want} (got {got})", got == want)
    v.need(f"{p['value']} in the finding's value (got {ev.get('value')})",
           p["value"] in str(ev.get("value", "")).split("+"))
    v.number = f"{ev.get('module')} {ev.get('op')} step {ev.get('step')} ({ev.get('method')})"


def eval_fragmentation(v: Verdict, run: Path, summary: dict, cuda: bool) -> None:
    """CUDA: the fragment fault makes a fragmentation finding on its rank and the exit
    snapshot shows the split segments. CPU: the fault is not performed and nothing is found."""
    _common(v, summary, 1, "nccl" if cuda else "gloo")
    inj = [i for i in injected(run) if i["kind"] == "fragment"]
    if not v.need("fragment injected (injected.json)", inj):
        return
    snap = rank_dir(run) / "memory_snapshot.pickle"
    f = findings(summary, "fragmentation")
    if not cuda:
        v.need("not performed on CPU, with a reason", not inj[0]["performed"] and inj[0].get("reason"))
        v.need(f"no fragmentation finding on CPU (got {len(f)})", not f)
        v.need("no allocator snapshot on CPU", not snap.exists())
        v.number = "not performed (CPU)"
        return
    v.need("fragment performed", inj[0]["performed"])
    v.need(f"fragmentation finding on rank 0 (got {[x['ranks'] for x in f]})",
           any(x["ranks"] == [0] for x in f))
    job = summary.get("metrics", {}).get("fragmentation", {}).get("job", {})
    score = job.get("max_score") or 0.0
    v.need(f"fragmentation score >= {SCORE_MIN} (got {score:.2f})", score >= SCORE_MIN)
    if not v.need("allocator snapshot written (TRAINPROF_MEMORY_HISTORY=1)", snap.is_file()):
        v.number = f"score {score:.2f}"
        return
    split = snapshot_split_share(snap)
    v.need(f"snapshot by hand: inactive split blocks >= {SCORE_MIN} of reserved (got {split:.2f})",
           split >= SCORE_MIN)
    v.number = f"score {score:.2f}; snapshot split {split:.2f}"


def snapshot_split_share(path: Path) -> float:
    """Inactive blocks inside segments that also hold live blocks, over all reserved bytes:
    computed from torch.cuda.memory._snapshot()'s segments directly (not trainprof's reader).
    Unpickled by trainprof's restricted unpickler (plain containers only), read raw."""
    from trainprof.formats.snapshot import safe_load

    snap = safe_load(path.read_bytes(), str(path))
    reserved = split = 0
    for seg in snap.get("segments", []):
        reserved += seg["total_size"]
        blocks = seg.get("blocks", [])
        if any(b["state"] == "active_allocated" for b in blocks):
            split += sum(b["size"] for b in blocks if b["state"] == "inactive")
    return split / reserved if reserved else 0.0


def eval_telemetry(v: Verdict, run: Path, summary: dict, cuda: bool) -> None:
    """CUDA: NVML samples carry a step that the step records have, real clocks and power, and
    the analysis joins them to the analysed steps. CPU: the probe says why it is off."""
    tel = read_jsonl(rank_dir(run) / "telemetry.jsonl")
    m = meta(run).get("telemetry") or {}
    per = summary.get("metrics", {}).get("stragglers", {}).get("per_rank", [])
    joined = (per[0].get("telemetry") if per else None) or {}
    if not cuda:
        v.need(f"telemetry off on CPU with a reason (got {m})", m.get("enabled") is False and m.get("reason"))
        v.need(f"no samples on CPU (got {len(tel)})", not tel)
        v.need("nothing joined to steps on CPU", not joined)
        v.number = "off (CPU): " + str(m.get("reason"))
        return
    steps = {r.get("step") for r in read_jsonl(rank_dir(run) / "steps.jsonl")}
    v.need(f"telemetry enabled (got {m})", m.get("enabled") is True)
    v.need(f">= 3 samples (got {len(tel)})", len(tel) >= 3)
    # a sample carries the step in progress: after the last step boundary (teardown) that is
    # one past the last recorded step; any other step without a record is a wrong join
    last = max((x for x in steps if isinstance(x, int)), default=-1)
    orphan = [t.get("step") for t in tel if t.get("step") not in steps and t.get("step") != last + 1]
    v.need(f"every sample's step is a recorded step (not: {orphan[:5]})", not orphan)
    covered = {t.get("step") for t in tel}
    v.need(f"samples over >= 2 steps (got {len(covered)})", len(covered) >= 2)
    v.need("SM clock and power limit read (> 0)",
           tel and all((t.get("sm_clock_mhz") or 0) > 0 and (t.get("power_limit_w") or 0) > 0 for t in tel))
    v.need(f"analysis joins samples to the analysed steps (stragglers per_rank telemetry: {joined})",
           (joined.get("sm_clock_mhz") or 0) > 0)
    v.number = (f"{len(tel)} samples over {len(covered)} steps, SM {joined.get('sm_clock_mhz', 0):.0f} MHz, "
                f"{joined.get('power_w', 0):.0f} W")


def eval_mfu(v: Verdict, run: Path, summary: dict, cuda: bool) -> None:
    """MFU = (6·N + 12·L·H·Q·T) · tokens / (median step · peak), recomputed here from the job's
    declared run_info, with the peak of the device's datasheet (CUDA; bf16) or the calibration
    (CPU)."""
    import trainprof.devices as devices

    roof = summary.get("metrics", {}).get("roofline", {}).get("job", {})
    info = summary.get("run", {}).get("run_info") or {}
    if not v.need(f"MFU computed (missing: {roof.get('missing') or roof.get('withheld')})", "mfu" in roof):
        return
    L, H, T, hid = info["layers"], info["heads"], info["seq_len"], info["hidden"]
    flops = (6 * info["n_params_non_embedding"] + 12 * L * H * (hid // H) * T) * info["tokens_per_step"]
    med = summary["metrics"]["step_time"]["job"]["median_ms"]
    name = meta(run).get("device_name")
    if cuda:
        entry = devices.lookup(name)
        peak = (entry or {}).get("flops_per_s", {}).get(info.get("dtype"))
        if not v.need(f"{name} in the device table with a {info.get('dtype')} peak", peak):
            return
        v.need(f"peak = datasheet {peak / 1e12:.0f} TFLOP/s (got {roof['peak_flops_per_s_total'] / 1e12:.1f})",
               roof["peak_flops_per_s_total"] == peak)
    else:
        peak = roof.get("peak_flops_per_s_total") or 0
        c = meta(run).get("calibration") or {}
        v.need("CPU peak from the calibration probe", peak > 0 and c)
    mfu = flops / (med / 1e3 * peak) if peak else None
    v.need(f"MFU = hand-computed {mfu} (got {roof['mfu']})",
           mfu is not None and abs(roof["mfu"] - mfu) <= 1e-9 * max(mfu, 1e-12))
    v.need(f"0 < MFU < 1 (got {roof['mfu']:.4f})", 0 < roof["mfu"] < 1)
    v.number = f"MFU {100 * roof['mfu']:.2f} % of {peak / 1e12:.3g} TFLOP/s ({name or 'cpu'})"


def eval_job_trace(v: Verdict, trace: Path, cuda: bool, syncs: int = 4, d2h: int = 3) -> None:
    """make_trace.py's own profiler trace (4 active steps): per step its 3 x .item() and 1 x
    synchronize() are the host syncs (trainprof, wrapped around the job, adds none: its NaN
    watch copies to pinned memory without waiting), the .item() ones device-to-host copies
    (at least: the NaN watch's own copies are in the job's trace too). On CPU: none."""
    from trainprof.analyzers import _comm_breakdown
    from trainprof.trace import load_trace

    rows, _, kind = _comm_breakdown.rank_breakdown(load_trace(trace))
    v.need(f"4 profiled steps in the job's trace (got {len(rows)})", len(rows) == 4)
    got = sorted({(r["sync_calls"], r.get("d2h_copies", 0)) for r in rows})
    want_syncs, want_d2h = (syncs, d2h) if cuda else (0, 0)
    v.need(f"{want_syncs} host syncs per step (got {[g[0] for g in got]})",
           got and all(g[0] == want_syncs for g in got))
    v.need(f"device-to-host copies per step {'>= ' if cuda else ''}{want_d2h} (got {[g[1] for g in got]})",
           got and all(g[1] >= want_d2h if cuda else g[1] == 0 for g in got))
    v.need(f"trace kind {'gpu' if cuda else 'cpu'} (got {kind})", kind == ("gpu" if cuda else "cpu"))
    v.number = f"{len(rows)} steps, {got[0][0] if got else '?'} host syncs/step ({kind})"


EVALUATORS = {"ref_1rank": eval_reference, "ref_2rank_gloo": eval_two_ranks, "nan": eval_nan,
              "nan_sync": eval_nan, "fragmentation": eval_fragmentation, "telemetry": eval_telemetry,
              "mfu": eval_mfu}
TRACE_EVALUATORS = {"job_profiler": eval_job_trace}
