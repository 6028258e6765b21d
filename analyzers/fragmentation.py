"""Allocator fragmentation: how much reserved device memory is wasted, why, and what to change.

Inputs: the memory probe's per-step allocator statistics (memory.jsonl, CUDA only) and
allocator snapshots (ranks/rank-N/*.pickle, or bare snapshot files given to `trainprof analyze`).

From statistics (at each rank's step with the most reserved memory):
    slack = reserved − allocated; internal waste = allocated − requested (rounding);
    inactive split bytes (free pieces of split segments);
    score = (inactive split + internal waste) / reserved; allocation retries; OOMs.
From a snapshot (exact, per pool — a free block only serves requests of its own device,
stream, size class (small ≤ 1 MiB / large) and memory pool):
    external fragmentation of a pool = 1 − largest free block / total free bytes;
    external waste = Σ_pools (total free − largest free block): free bytes that a request as
    large as the pool's largest hole cannot use; internal waste = Σ (block size − requested);
    inactive split bytes = free blocks inside split segments (whole free segments are cache the
    allocator can release, not fragmentation);
    score = (inactive split + internal waste) / reserved — the same formula as from statistics.
A finding when score ≥ SCORE_WARN and the waste ≥ MIN_WASTE_BYTES, or when allocations were
retried (statistics at each rank's peak, and bare snapshots; a rank's exit snapshot
memory_snapshot.pickle is reported but judged by its statistics, since the state at exit is
not the state at the peak), and for every `oom` trace entry (with an explanation of that OOM).
"""

from __future__ import annotations

from collections import Counter

from trainprof.findings import AnalyzerResult, Finding

NAME = "fragmentation"
SCORE_WARN = 0.25
MIN_WASTE_BYTES = 256 << 20
SMALL_LIMIT = 1 << 20       # the caching allocator's small-pool limit (requests ≤ 1 MiB)
MiB = 1 << 20
EXIT_SNAPSHOT = "memory_snapshot.pickle"   # written by probes/memory.py when the process exits


def _mib(x) -> str:
    return f"{x / MiB:,.0f} MiB" if x >= MiB else f"{x / 1024:,.1f} KiB"


# --------------------------------------------------------------------------- snapshots
def snapshot_metrics(snap) -> dict:
    """Numbers of one snapshot (trainprof.formats.snapshot.Snapshot); see the module docstring."""
    reserved = allocated = requested_known = size_known = free = split_free = 0
    pools: dict[str, dict] = {}
    for seg in snap.segments:
        reserved += seg.total_size
        p = pools.setdefault(seg.pool, {"pool": seg.pool, "segments": 0, "reserved_bytes": 0,
                                        "free_bytes": 0, "largest_free_bytes": 0, "free_blocks": 0})
        p["segments"] += 1
        p["reserved_bytes"] += seg.total_size
        split = len(seg.blocks) > 1
        for b in seg.blocks:
            if b.active:
                allocated += b.size
                if b.requested_size is not None:
                    requested_known += b.requested_size
                    size_known += b.size
            elif b.free:
                free += b.size
                split_free += b.size if split else 0
                p["free_bytes"] += b.size
                p["free_blocks"] += 1
                p["largest_free_bytes"] = max(p["largest_free_bytes"], b.size)
    for p in pools.values():
        p["external_fragmentation"] = (1 - p["largest_free_bytes"] / p["free_bytes"]
                                       if p["free_bytes"] else 0.0)
    external = sum(p["free_bytes"] - p["largest_free_bytes"] for p in pools.values())
    internal = size_known - requested_known
    alloc_sizes = Counter(e.size for es in snap.traces.values() for e in es
                          if e.action == "alloc" and e.size > SMALL_LIMIT)
    return {
        "reserved_bytes": reserved, "allocated_bytes": allocated, "free_bytes": free,
        "reserved_minus_allocated_bytes": reserved - allocated,
        "inactive_split_bytes": split_free,
        "internal_waste_bytes": internal,
        "external_waste_bytes": external,
        "external_fragmentation": external / free if free else 0.0,
        # whole free segments are releasable cache (the allocator returns them to the device
        # before failing); free pieces of split segments are what fragmentation wastes
        "score": (split_free + internal) / reserved if reserved else 0.0,
        "segments": len(snap.segments),
        "expandable_segments": any(s.is_expandable for s in snap.segments),
        "pools": sorted(pools.values(), key=lambda p: -p["reserved_bytes"]),
        "distinct_large_alloc_sizes": len(alloc_sizes),
        "large_allocs_traced": sum(alloc_sizes.values()),
        "segment_allocs_traced": sum(1 for es in snap.traces.values() for e in es
                                     if e.action == "segment_alloc"),
        "segment_frees_traced": sum(1 for es in snap.traces.values() for e in es
                                    if e.action == "segment_free"),
    }


def _top_sites(snap, n: int = 5) -> list[dict]:
    """The allocation sites (first frame outside torch) holding the most memory."""
    sites: Counter = Counter()
    for _, b in snap.blocks():
        if not b.active:
            continue
        site = "unknown (no frames recorded)"
        for f in b.frames or []:
            fn = str(f.get("filename", "")) if isinstance(f, dict) else ""
            if fn and "/torch/" not in fn and not fn.startswith("??"):
                site = f"{fn}:{f.get('line')} ({f.get('name')})"
                break
        sites[site] += b.size
    return [{"site": s, "bytes": v} for s, v in sites.most_common(n)]


def explain_oom(snap, device: int, entry, m: dict) -> dict:
    """Why an allocation failed: fragmentation (enough memory free in total, no hole large
    enough) or exhaustion (the live tensors fill the device). The snapshot is the allocator's
    state when it was taken — at the OOM when the OOM observer took it."""
    size, dev_free = int(entry.size), int(entry.device_free or 0)
    kind = "small" if size <= SMALL_LIMIT else "large"
    pools = [p for s in snap.segments if s.device == device and s.segment_type == kind
             and s.stream == entry.stream for p in [s.pool]]
    largest = max((p["largest_free_bytes"] for p in m["pools"] if p["pool"] in pools), default=0)
    # Before raising OOM the allocator already released every unsplit cached segment and
    # retried; what is still cached free now sits in split segments it cannot give back.
    cached_free = sum(b.size for s in snap.segments if s.device == device for b in s.blocks if b.free)
    capacity = m["reserved_bytes"] + dev_free
    if largest < size <= cached_free + dev_free:
        cause = "fragmentation"
        text = (f"allocation of {_mib(size)} failed although {_mib(cached_free)} were cached free "
                f"in split segments and {_mib(dev_free)} free on the device: the largest free block was "
                f"{_mib(largest)}. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so "
                f"segments grow instead of splitting (or max_split_size_mb to keep large blocks "
                f"whole), and allocate long-lived tensors before short-lived ones")
    else:
        cause = "exhausted"
        text = (f"allocation of {_mib(size)} failed with {_mib(m['allocated_bytes'])} allocated by "
                f"live tensors of ~{_mib(capacity)} usable ({_mib(dev_free)} free on the device, "
                f"{_mib(cached_free)} cached free): memory is genuinely exhausted — "
                f"reduce the peak (smaller micro-batch, activation checkpointing, more sharding)")
    return {"device": device, "requested_bytes": size, "device_free_bytes": dev_free,
            "largest_free_block_bytes": largest, "cached_free_bytes": cached_free,
            "allocated_bytes": m["allocated_bytes"], "reserved_bytes": m["reserved_bytes"],
            "cause": cause, "explanation": text, "top_sites": _top_sites(snap)}


def advice(m: dict, retries: int = 0, expandable: bool = False) -> list[str]:
    """Concrete changes, most useful first, for the waste measured in ``m``."""
    out = []
    ext = m.get("inactive_split_bytes") or 0
    internal = m.get("internal_waste_bytes", 0) or 0
    if ext >= internal and ext > 0:
        if not expandable:
            out.append("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: segments then grow "
                       "in place instead of being split, which removes most external "
                       "fragmentation from tensors of changing sizes")
        else:
            out.append("expandable segments are already on: the holes come from tensors freed out "
                       "of order; allocate long-lived buffers (optimizer state, caches) early")
        out.append("or cap splitting with PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:<N> so large "
                   "cached blocks are not carved up by smaller requests")
    if m.get("distinct_large_alloc_sizes", 0) > 16:
        out.append(f"{m['distinct_large_alloc_sizes']} distinct large allocation sizes were traced: "
                   "bucket or pad batches to a few fixed shapes (e.g. sequence lengths rounded to "
                   "multiples of 64/128) so freed blocks fit the next request")
    if internal > 0 and internal > ext:
        out.append("blocks are much larger than requested (internal waste): check "
                   "roundup_power2_divisions in PYTORCH_CUDA_ALLOC_CONF and avoid odd tensor sizes")
    if retries:
        out.append(f"the allocator freed its cache and retried cudaMalloc {retries} time(s) (each "
                   "retry synchronizes the device): lower the peak (activation checkpointing, "
                   "smaller micro-batches) or set garbage_collection_threshold:0.8")
    return out


# --------------------------------------------------------------------------- statistics
def stats_metrics(recs: list[dict]) -> dict | None:
    """From memory.jsonl records carrying CUDA allocator statistics (None on CPU runs)."""
    samples = [r for r in recs if r.get("event") is None and isinstance(r.get("reserved_bytes"), int)
               and isinstance(r.get("allocated_bytes"), int)]
    if not samples:
        return None
    at = max(samples, key=lambda r: r["reserved_bytes"])
    reserved, allocated = at["reserved_bytes"], at["allocated_bytes"]
    requested = at.get("requested_bytes")
    internal = max(allocated - requested, 0) if isinstance(requested, int) else 0
    split = int(at.get("inactive_split_bytes") or 0)
    return {
        "step": at.get("step"), "reserved_bytes": reserved, "allocated_bytes": allocated,
        "reserved_minus_allocated_bytes": reserved - allocated,
        "max_reserved_minus_allocated_bytes": max(r["reserved_bytes"] - r["allocated_bytes"]
                                                  for r in samples),
        "inactive_split_bytes": split, "internal_waste_bytes": internal,
        "score": (split + internal) / reserved if reserved else 0.0,
        "num_alloc_retries": int(max(r.get("num_alloc_retries") or 0 for r in samples)),
        "num_ooms": int(max(r.get("num_ooms") or 0 for r in samples)),
    }


# --------------------------------------------------------------------------- analyzer
def _finding(label: str, ranks: list[int], m: dict, adv: list[str], retries: int) -> Finding | None:
    waste = (m.get("inactive_split_bytes") or 0) + (m.get("internal_waste_bytes") or 0)
    bad = m["score"] >= SCORE_WARN and waste >= MIN_WASTE_BYTES
    if not bad and not retries:
        return None
    parts = [f"{m['score']:.0%} of {_mib(m['reserved_bytes'])} reserved is fragmented "
             f"({_mib(waste)} wasted)"]
    if retries:
        parts.append(f"{retries} allocation retries")
    return Finding(kind="fragmentation", severity="warning", ranks=ranks,
                   message=f"{label}: " + "; ".join(parts) + (f" — {adv[0]}" if adv else ""),
                   evidence={"metrics": {k: v for k, v in m.items() if k != "pools"},
                             "advice": adv, "score_warn": SCORE_WARN,
                             "min_waste_bytes": MIN_WASTE_BYTES})


def analyze(run) -> AnalyzerResult:
    findings: list[Finding] = []
    per_rank, snapshots = [], []
    for rank in run.ranks:
        m = stats_metrics(run.stream(rank, "memory"))
        if m is None:
            continue
        m["rank"] = rank
        m["advice"] = advice(m, m["num_alloc_retries"])
        per_rank.append(m)
    for rank, path in run.snapshot_files():
        snap = run.snapshot(path)
        if snap is None:
            continue
        m = snapshot_metrics(snap)
        label = f"rank {rank} ({path.name})" if rank is not None else path.name
        row = {"file": path.name, "rank": rank, **m,
               "advice": advice(m, expandable=m["expandable_segments"])}
        # The snapshot shows the allocator after the last OOM of each device (the OOM observer
        # dumps it then); earlier OOMs in the trace happened in states we no longer see.
        last = {dev: e for dev, e in snap.ooms()}
        row["ooms"] = [explain_oom(snap, dev, e, m) for dev, e in sorted(last.items())]
        row["earlier_ooms"] = len(snap.ooms()) - len(last)
        snapshots.append(row)
        ranks = [rank] if rank is not None else []
        for o in row["ooms"]:
            findings.append(Finding(
                kind="fragmentation" if o["cause"] == "fragmentation" else "memory",
                severity="error", ranks=ranks,
                message=f"{label}: out of memory on cuda:{o['device']}: {o['explanation']}",
                evidence={"file": str(path), **o}))
        judged_by_stats = path.name == EXIT_SNAPSHOT and any(m_["rank"] == rank for m_ in per_rank)
        if not row["ooms"] and not judged_by_stats:
            f = _finding(label, ranks, m, row["advice"], 0)
            if f:
                findings.append(f)
    for m in per_rank:
        f = _finding(f"rank {m['rank']}", [m["rank"]], m, m["advice"], m["num_alloc_retries"])
        if f:
            findings.append(f)
    if not per_rank and not snapshots:
        return AnalyzerResult()
    worst = max(per_rank + snapshots, key=lambda m: m["score"])
    return AnalyzerResult(metrics={
        "job": {"max_score": worst["score"], "worst": worst.get("file") or f"rank {worst['rank']}",
                "max_reserved_minus_allocated_bytes": max(m["reserved_minus_allocated_bytes"]
                                                          for m in per_rank + snapshots),
                "alloc_retries": sum(m.get("num_alloc_retries", 0) for m in per_rank),
                "ooms": sum(len(s["ooms"]) for s in snapshots)},
        "per_rank": per_rank, "snapshots": snapshots,
        "thresholds": {"score_warn": SCORE_WARN, "min_waste_bytes": MIN_WASTE_BYTES},
    }, findings=findings)
