"""Fragmentation: waste per rank and per snapshot, pools, OOM explanations, advice."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk

TITLE = "Allocator fragmentation"


def render(metrics: dict, summary: dict) -> str:
    parts = []
    job = metrics.get("job") or {}
    th = metrics.get("thresholds") or {}
    parts.append(kit.kv({"worst score": kit.fmt_pct(job.get("max_score")), "worst": job.get("worst"),
                         "max reserved − allocated": kit.fmt_bytes(job.get("max_reserved_minus_allocated_bytes")),
                         "allocation retries": job.get("alloc_retries"), "OOMs in snapshots": job.get("ooms")}))
    parts.append(kit.para(f"score = (inactive split bytes + internal waste) / reserved; a finding at ≥ "
                          f"{kit.fmt_pct(th.get('score_warn'))} with ≥ {kit.fmt_bytes(th.get('min_waste_bytes'))} "
                          f"wasted, or on allocation retries."))
    b = kit.fmt_bytes
    rows = metrics.get("per_rank") or []
    if rows:
        parts.append(rk.rank_table(rows, worst=lambda r: r.get("score"), worst_label="score",
                                   pinned=rk.named(summary), columns=[
            ("rank", "rank"), ("step", "at step"), ("reserved_bytes", "reserved"),
            ("allocated_bytes", "allocated"), ("reserved_minus_allocated_bytes", "reserved − allocated"),
            ("inactive_split_bytes", "inactive split"), ("internal_waste_bytes", "internal waste"),
            ("score", "score"), ("num_alloc_retries", "retries"), ("num_ooms", "OOMs")],
            fmt={"reserved_bytes": b, "allocated_bytes": b, "reserved_minus_allocated_bytes": b,
                 "inactive_split_bytes": b, "internal_waste_bytes": b, "score": kit.fmt_pct}))
    snaps = metrics.get("snapshots") or []
    if snaps:
        parts.append(rk.rank_table(snaps, what="snapshots", worst=lambda r: r.get("score"),
                                   worst_label="score", columns=[
            ("file", "snapshot"), ("rank", "rank"), ("segments", "segments"), ("reserved_bytes", "reserved"),
            ("allocated_bytes", "allocated"), ("inactive_split_bytes", "inactive split"),
            ("external_waste_bytes", "external waste"), ("external_fragmentation", "1 − largest/free"),
            ("internal_waste_bytes", "internal waste"), ("score", "score")],
            fmt={"reserved_bytes": b, "allocated_bytes": b, "inactive_split_bytes": b,
                 "external_waste_bytes": b, "internal_waste_bytes": b,
                 "external_fragmentation": kit.fmt_pct, "score": kit.fmt_pct}))
        pools = [dict(p, file=s["file"]) for s in snaps for p in s.get("pools", [])]
        if len(pools) > 50:  # capped: the most fragmented pools first
            pools.sort(key=lambda p: -(p.get("external_fragmentation") or 0))
        parts.append(kit.table(pools, columns=[
            ("file", "snapshot"), ("pool", "pool"), ("segments", "segments"), ("reserved_bytes", "reserved"),
            ("free_bytes", "free"), ("largest_free_bytes", "largest free block"),
            ("free_blocks", "free blocks"), ("external_fragmentation", "1 − largest/free")],
            fmt={"reserved_bytes": b, "free_bytes": b, "largest_free_bytes": b,
                 "external_fragmentation": kit.fmt_pct}, max_rows=50))
        ooms = [(s, o) for s in snaps for o in s.get("ooms", [])]
        for s, o in ooms[:rk.OUTLIERS]:
            parts.append(kit.para(f"OOM in {s['file']}: {o['explanation']}"))
            if o.get("top_sites"):
                parts.append(kit.table(o["top_sites"], columns=[("site", "allocation site"), ("bytes", "held")],
                                       fmt={"bytes": b}))
        if len(ooms) > rk.OUTLIERS:
            parts.append(kit.para(f"… {len(ooms) - rk.OUTLIERS:,} more OOM explanations not shown "
                                  f"(of {len(ooms):,}); full data in summary.json.", "note"))
    advice = next((r.get("advice") for r in sorted(rows + snaps, key=lambda r: -r.get("score", 0))
                   if r.get("advice")), None)
    if advice:
        parts.append(kit.para("Advice: " + " · ".join(advice)))
    return "".join(p for p in parts if p)
