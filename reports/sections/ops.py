"""Ops and kernels: the GPU kernels (by group) and the CPU ops that take the profiled steps' time."""

from __future__ import annotations

from trainprof.reports import kit

TITLE = "Ops and kernels"
KERNEL_ROWS = 10      # per kernel group
CPU_ROWS = 20         # per CPU-op ranking
RANK_ROWS = 64
NAME_CHARS = 120
ROLE_TEXT = {
    "compute": "ops on the step's threads (the ProfilerStep thread, autograd threads)",
    "wait": "waits on those threads: collectives, device synchronization (grow when a peer or the device is slow)",
    "communication": "gloo's communication threads (wait for the other ranks)",
    "other": "other threads (data loader workers, ...)",
    "outside": "the step's threads in no op: Python, untraced waits (e.g. DDP's gradient sync)",
}


def _name(x) -> str:
    s = "" if x is None else str(x)
    return s if len(s) <= NAME_CHARS else s[:NAME_CHARS - 1] + "…"


def _us(x) -> str:
    return kit.fmt_ms(x / 1e3) if isinstance(x, (int, float)) else "—"


def _kernels(metrics: dict) -> str:
    rows = metrics.get("kernels") or []
    parts = []
    groups = metrics.get("kernel_groups") or []
    if groups:
        parts.append(kit.table(groups, columns=[
            ("group", "group"), ("count", "kernels"), ("ms_per_step", "time / step"),
            ("busy_ms_per_step", "busy / step"), ("share_of_kernel_time", "share of kernel time"),
            ("share_of_step", "share of step")],
            fmt={"ms_per_step": kit.fmt_ms, "busy_ms_per_step": kit.fmt_ms,
                 "share_of_kernel_time": kit.fmt_pct, "share_of_step": kit.fmt_pct}))
    overlap = metrics.get("kernel_overlap") or []
    if len(overlap) > 1:
        parts.append(kit.para("Kernel time by the groups running at each instant (HTA's kernel-type "
                              "breakdown, all ranks):"))
        parts.append(kit.table(overlap, columns=[("kernel_type", "running"), ("total_ms", "time"),
                                                 ("pct", "%")], fmt={"total_ms": kit.fmt_ms}))
    for g in ("compute", "communication", "memory"):
        top = [dict(r, name=_name(r["name"])) for r in rows if r.get("group") == g][:KERNEL_ROWS]
        if not top:
            continue
        parts.append(kit.para(f"Top {g} kernels by time per step (mean over ranks):"))
        parts.append(kit.table(top, columns=[
            ("name", "kernel"), ("calls_per_step", "calls / step"), ("total_ms_per_step", "time / step"),
            ("per_call_us", "per call"), ("total_share", "share of step"), ("ranks", "ranks"),
            ("max_rank_total_ms_per_step", "slowest rank / step"), ("max_rank", "rank")],
            fmt={"total_ms_per_step": kit.fmt_ms, "per_call_us": _us, "total_share": kit.fmt_pct,
                 "max_rank_total_ms_per_step": kit.fmt_ms}, max_rows=KERNEL_ROWS))
    other = metrics.get("kernels_other") or {}
    if other.get("count"):
        parts.append(kit.para(f"Kernels not in the tables: {other['count']} calls, "
                              f"{kit.fmt_ms(other.get('total_ms'))} in all."))
    return "".join(parts)


def _cpu(metrics: dict) -> str:
    rows = [dict(r, name=_name(r["name"])) for r in metrics.get("cpu_ops") or []]
    if not rows:
        return ""
    cols = [("name", "op"), ("role", "role"), ("cat", "category"), ("calls_per_step", "calls / step"),
            ("self_ms_per_step", "self / step"), ("total_ms_per_step", "total / step"),
            ("self_share", "self, share of step"), ("ranks", "ranks"), ("max_rank", "slowest rank")]
    fmt = {"self_ms_per_step": kit.fmt_ms, "total_ms_per_step": kit.fmt_ms, "self_share": kit.fmt_pct}
    by_total = sorted(rows, key=lambda r: (-(r.get("total_ms") or 0), r["name"]))
    job = metrics.get("job") or {}
    roles = job.get("cpu_self_ms_per_step_by_role") or {}
    split = [{"role": r, "what": ROLE_TEXT[r], "ms": roles[r]} for r in ROLE_TEXT if r in roles]
    if split and job.get("outside_ops_ms_per_step") is not None:
        split.append({"role": "outside ops", "what": ROLE_TEXT["outside"], "ms": job["outside_ops_ms_per_step"]})
    return "".join([
        kit.para("CPU time per step by role (mean over ranks):") if split else "",
        kit.table(split, columns=[("role", "role"), ("ms", "self time / step"), ("what", "")],
                  fmt={"ms": kit.fmt_ms}) if split else "",
        kit.para("Top CPU ops by self time per step (duration minus nested ops; mean over ranks):"),
        kit.table(rows, columns=cols, fmt=fmt, max_rows=CPU_ROWS),
        kit.para("Top CPU ops by total time per step (nested ops included):"),
        kit.table(by_total, columns=cols, fmt=fmt, max_rows=CPU_ROWS)])


def render(metrics: dict, summary: dict) -> str:
    job = metrics.get("job") or {}
    gpu = job.get("kind") == "gpu"
    shown = {"ranks": job.get("ranks"), "profiled steps per rank": job.get("steps_per_rank"),
             "step window": kit.fmt_ms(job.get("step_window_ms")),
             **({"kernel time / step": kit.fmt_ms(job.get("kernel_ms_per_step")),
                 "GPU busy / step": kit.fmt_ms(job.get("kernel_busy_ms_per_step")),
                 "kernels / step": job.get("kernels_per_step")} if gpu else {}),
             "CPU ops / step": job.get("cpu_ops_per_step"),
             "CPU self time / step (all threads)": kit.fmt_ms(job.get("cpu_self_ms_per_step"))}
    parts = [kit.kv({k: v for k, v in shown.items() if v not in (None, "—")})]
    for note in metrics.get("notes") or []:
        parts.append(kit.para(note, "note"))
    parts.append(_kernels(metrics) if gpu else "")
    parts.append(_cpu(metrics))
    per_rank = metrics.get("per_rank") or []
    if len(per_rank) > 1:
        cols = [("rank", "rank"), ("steps", "steps"), ("step_window_ms", "step window")]
        if gpu:
            cols += [("kernel_ms_per_step", "kernels / step"), ("compute_ms_per_step", "compute"),
                     ("communication_ms_per_step", "communication"), ("memory_ms_per_step", "memory")]
        cols += [("compute_self_ms_per_step", "CPU compute / step"), ("wait_self_ms_per_step", "CPU waits / step"),
                 ("outside_ops_ms_per_step", "outside ops / step")]
        rows = [dict(r, top=_name((r.get("top_kernels") or r.get("top_compute_ops_self") or [{}])[0].get("name")))
                for r in per_rank]
        parts.append(kit.para("Per rank (times per profiled step):"))
        parts.append(kit.table(rows, columns=cols + [("top", "top kernel" if gpu else "top compute op (self)")],
                               fmt={k: kit.fmt_ms for k, _ in cols if k.endswith("_ms") or k.endswith("_step")},
                               max_rows=RANK_ROWS))
    parts.append(kit.para("Definitions: docs/ops.md."))
    return "".join(p for p in parts if p)
