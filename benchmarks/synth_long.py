"""Synthesize a long run directory in the bounded format (probes/compact.py) from a real run,
for the whole-run analysis benchmark (bench_long_run.py) and tests.

    python benchmarks/synth_long.py OUT --ranks N --steps S [--budget-mb B] [--source RUN]
                                    [--straggler R --delay-ms D --from-step K] [--seed 0]

The source is a real run directory of either format (default: tests/fixtures/rundir_v1, a
2-rank ``--dp 2`` reference run of 40 steps, captured with trainprof). Its steady steps (step 1
on) are the pattern: synthesized step k of rank r copies source step 1 + k mod (steps − 1) of
source rank r mod (source ranks) — its duration (± 3 % jitter), on-CPU time, input wait, memory
and every collective (per (group, kind) sums for the compact table; the records themselves for
the detail ring) — with step numbers, sequence numbers, ranks and timestamps rewritten; every
rank is a member of the source's groups scaled to the world. What the probes would have kept
under the budget is written directly (numpy, not step by step): the newest steps at full
resolution up to the compact share of the budget, the older ones folded into blocks of 2^k
steps (the blocks within their share), the newest steps' JSONL detail in the ring's files up to
the ring's share. ``--straggler R`` adds ``--delay-ms`` of own work to rank R from step
``--from-step``: the others wait that long in their first collective of the step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainprof.rundir import compact as fmt  # noqa: E402
from trainprof.probes import compact  # noqa: E402

DEFAULT_SOURCE = ROOT / "tests" / "fixtures" / "rundir_v1"


def _jsonl(p: Path) -> list[dict]:
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


class Pattern:
    """A source rank's steady steps: per step its duration, cpu, input wait, rss, and its
    collective records (relative times)."""

    def __init__(self, rank_dir: Path):
        steps = [s for s in _jsonl(rank_dir / "steps.jsonl") if s.get("step", 0) >= 1]
        self.steps = steps
        self.n = len(steps)
        idx = {s["step"]: i for i, s in enumerate(steps)}
        self.dur = np.array([s["dur_ms"] for s in steps])
        self.cpu = np.array([s.get("cpu_ms", np.nan) for s in steps], dtype=float)
        data = {d["step"]: d.get("wait_ms", 0.0) for d in _jsonl(rank_dir / "data.jsonl")}
        self.data = np.array([data.get(s["step"], 0.0) for s in steps])
        mem = {m["step"]: m.get("rss_bytes", -1) for m in _jsonl(rank_dir / "memory.jsonl")
               if "step" in m and "event" not in m}
        self.rss = np.array([mem.get(s["step"], -1) for s in steps], dtype=np.int64)
        self.colls: list[list[dict]] = [[] for _ in steps]
        for c in _jsonl(rank_dir / "collectives.jsonl"):
            i = idx.get(c.get("step"))
            if i is None:
                continue
            start = steps[i]["start_ns"]
            c = dict(c, enqueue_ns=c["enqueue_ns"] - start,
                     end_ns=(c["end_ns"] - start) if isinstance(c.get("end_ns"), int) else None)
            self.colls[i].append(c)
        self.keys = sorted({(str(c["pg"]), c["op"]) for cs in self.colls for c in cs})


def synthesize(out, ranks: int, steps: int, budget_mb: float = 256.0, source=None,
               straggler: int | None = None, delay_ms: float = 0.0, from_step: int = 0,
               seed: int = 0) -> Path:
    out = Path(out)
    src = Path(source or DEFAULT_SOURCE)
    if out.exists():
        shutil.rmtree(out)
    (out / "ranks").mkdir(parents=True)
    src_ranks = sorted(int(p.name.split("-")[1]) for p in (src / "ranks").glob("rank-*"))
    pats = {r: Pattern(src / "ranks" / f"rank-{r:05d}") for r in src_ranks}
    man = json.loads((src / "manifest.json").read_text())
    man.update(schema_version=2, world_size=ranks, ranks_seen=ranks, ranks=[], files=[],
               mesh=None, status="ok", exit_code=0, node=None)
    (out / "manifest.json").write_text(json.dumps(man))
    budget = int(budget_mb * 2**20)
    rng = np.random.default_rng(seed)
    pat0 = pats[src_ranks[0]]
    # one timeline for the job: step k starts at t[k] on every rank (a synchronous job)
    k = np.arange(steps)
    base_dur = pat0.dur[k % pat0.n] * (1 + 0.03 * rng.uniform(-1, 1, steps))
    extra = np.zeros(steps)
    if straggler is not None:
        extra[from_step:] = delay_ms
    dur = base_dur + extra
    t0 = 1_800_000_000_000_000_000
    start = t0 + np.concatenate([[0], np.cumsum(dur[:-1] * 1e6)]).astype(np.int64)
    done: dict = {}  # ranks of one source rank (and straggler or not) write the same files
    meta = json.loads((src / "ranks" / "rank-00000" / "meta.json").read_text())
    for r in range(ranks):
        d = out / "ranks" / f"rank-{r:05d}"
        (d / fmt.COMPACT_DIR).mkdir(parents=True)
        m = dict(meta, rank=r, world_size=ranks, local_rank=r % 8, host=f"node{r // 8:03d}",
                 pid=1000 + r, coords={"dp": r, "pp": 0, "tp": 0})
        for drop in ("mesh", "hosts", "pipeline", "profiled", "profile_steps"):
            m.pop(drop, None)
        (d / "meta.json").write_text(json.dumps(m))
        key = (src_ranks[r % len(src_ranks)], straggler is not None and r == straggler)
        if key in done:
            for rel, p in done[key].items():
                shutil.copyfile(p, d / rel)
            continue
        _rank(d, r, ranks, pats[key[0]], k, dur, start, budget, straggler, extra)
        done[key] = {str(p.relative_to(d)): p for p in d.rglob("*")
                     if p.is_file() and p.name != "meta.json"}
    return out


def _rank(d, r, ranks, pat, k, dur, start, budget, straggler, extra):
    (d / "groups.jsonl").write_text(json.dumps({"pg": "0", "ranks": list(range(ranks)),
                                                "mesh_dim": "dp", "backend": "gloo",
                                                "size": ranks}) + "\n")
    (d / "clock.jsonl").write_text("".join(json.dumps(
        {"phase": ph, "ref_rank": 0, "offset_ns": 0, "uncertainty_ns": 100_000,
         "t_ns": int(start[0]), "rounds": 8}) + "\n" for ph in ("start", "end")))
    n = len(k)
    i = k % pat.n
    slow = straggler is not None and r == straggler
    # --- compact rows of every step, then what the budget keeps
    rows = np.zeros(n, fmt._dtype(fmt.STEPS.fields))
    rows["step"], rows["start_ns"] = k, start
    rows["end_ns"] = start + (dur * 1e6).astype(np.int64)
    rows["cpu_ms"] = pat.cpu[i] + (extra if slow else 0)
    rows["cpu_wait_ms"], rows["probe_overhead_ms"] = 0.0, 0.01
    rows["nvcsw"] = rows["nivcsw"] = -1
    rows["flags"] = fmt.F_OPTIMIZER
    data = np.zeros(n, fmt._dtype(fmt.DATA.fields))
    data["step"], data["wait_ms"], data["batches"] = k, pat.data[i], 1
    mem = np.zeros(n, fmt._dtype(fmt.MEMORY.fields))
    mem["step"], mem["rss_bytes"] = k, pat.rss[i]
    mem["peak_rss_bytes"] = mem["allocated_bytes"] = mem["reserved_bytes"] = -1
    mem["peak_allocated_bytes"] = -1
    coll = _coll_rows(pat, k, start, i, slow, extra, straggler)
    keys = {key: j for j, key in enumerate(pat.keys)}
    with open(d / fmt.COMPACT_DIR / fmt.KEYS, "w") as f:
        for (pg, op), j in keys.items():
            f.write(json.dumps({"key": j, "pg": pg, "op": op}) + "\n")
    per_step = fmt.STEPS.size + fmt.DATA.size + fmt.MEMORY.size + fmt.COLLECTIVES.size * len(coll) / n
    keep = int(min(n, budget * compact.COMPACT_SHARE / per_step))
    cut = int(k[n - keep]) if keep < n else 0
    spb = compact.FIRST_BLOCK_STEPS
    tables = {"steps": (fmt.STEPS, rows), "data": (fmt.DATA, data), "memory": (fmt.MEMORY, mem),
              "collectives": (fmt.COLLECTIVES, coll)}
    while cut:  # blocks as coarse as their share needs
        nb = (cut // spb + 1) * (3 * fmt.STEPS.block_struct.size + len(keys) * fmt.COLLECTIVES.block_struct.size)
        if nb <= budget * compact.BLOCKS_SHARE:
            break
        spb *= 2
    for name, (f, arr) in tables.items():
        full = arr[arr["step"] >= cut]
        fmt.new_table_file(fmt.table_path(d, name), f, body=full.tobytes())
        if cut:
            old = arr[arr["step"] < cut]
            fmt.new_table_file(fmt.table_path(d, name, blocks=True), f, blocks=True,
                               body=fmt.fold(f, old, spb).tobytes())
    (d / fmt.COMPACT_DIR / compact.STATE).write_text(json.dumps(
        {"budget_bytes": budget, "steps_per_block": spb, "synthesized": True}))
    _ring(d, pat, k, start, i, slow, extra, straggler, r, ranks, budget, dur)


def _coll_rows(pat, k, start, i, slow, extra, straggler):
    keys = {key: j for j, key in enumerate(pat.keys)}
    # per source step: per key (count, bytes, blocked, blocked_max, wall, wall_max, enq_first, mean_off, seq_first)
    per = []
    seq_per_step = [len(cs) for cs in pat.colls]
    for cs in pat.colls:
        acc = {}
        for c in cs:
            j = keys[(str(c["pg"]), c["op"])]
            w = ((c["end_ns"] - c["enqueue_ns"]) / 1e6) if c.get("end_ns") is not None else 0.0
            a = acc.setdefault(j, [0, 0, 0.0, 0.0, 0.0, 0.0, c["enqueue_ns"], 0.0, c.get("seq", 0)])
            a[0] += 1
            a[1] += c.get("bytes", 0)
            a[2] += c.get("blocked_ms", 0.0)
            a[3] = max(a[3], c.get("blocked_ms", 0.0))
            a[4] += w
            a[5] = max(a[5], w)
            a[7] += (c["enqueue_ns"] - a[6]) / 1e6
        per.append(acc)
    nk = max(1, len(keys))
    ns = pat.n
    # per (source step, key): the sums, as arrays a step index gathers from
    F = {f: np.zeros((ns, nk)) for f in ("cnt", "bytes", "blk", "bmax", "wall", "wmax", "enq",
                                           "off", "seq")}
    has = np.zeros((ns, nk), bool)
    first = np.zeros((ns, nk), bool)
    for x, acc in enumerate(per):
        if not acc:
            continue
        e0 = min(v[6] for v in acc.values())
        s0 = min(v[8] for v in acc.values())
        for j, v in acc.items():
            has[x, j] = True
            first[x, j] = v[6] == e0
            for f, val in zip(("cnt", "bytes", "blk", "bmax", "wall", "wmax", "enq", "off", "seq"),
                              (v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7] / v[0], v[8] - s0)):
                F[f][x, j] = val
    out = np.zeros(len(k) * nk, fmt._dtype(fmt.COLLECTIVES.fields))
    m = 0
    seq_base = np.concatenate([[0], np.cumsum(np.array(seq_per_step)[k % ns])[:-1]])
    for j in range(nk):
        sel = has[k % ns, j]
        kk = k[sel]
        x = kk % ns
        cnt = F["cnt"][x, j]
        blocked = F["blk"][x, j].copy()
        if straggler is not None and not slow:
            blocked += extra[kk] * first[x, j]
        sl = slice(m, m + len(kk))
        out["step"][sl], out["key"][sl], out["count"][sl] = kk, j, cnt
        out["seq_first"][sl] = seq_base[sel] + F["seq"][x, j]
        out["bytes"][sl] = F["bytes"][x, j]
        out["blocked_ms"][sl] = blocked
        out["blocked_max_ms"][sl] = np.maximum(F["bmax"][x, j], blocked - F["blk"][x, j])
        out["wall_ms"][sl] = F["wall"][x, j] + (blocked - F["blk"][x, j])
        out["wall_max_ms"][sl] = F["wmax"][x, j]
        out["device_ms"][sl] = np.nan
        shift = (extra[kk] * 1e6).astype(np.int64) if slow else 0
        out["enqueue_first_ns"][sl] = start[sel] + F["enq"][x, j].astype(np.int64) + shift
        out["enqueue_mean_ms"][sl] = F["off"][x, j]
        m += len(kk)
    out = out[:m]
    return out[np.lexsort((out["key"], out["step"]))]


def _ring(d, pat, k, start, i, slow, extra, straggler, r, ranks, budget, dur):
    cap = budget * compact.RING_SHARE * compact.RING_WEIGHTS["collectives"] / 2
    per_step = max(1, sum(len(json.dumps(c)) + 1 for c in pat.colls[0]))
    nsteps = int(min(len(k), 2 * cap // per_step))
    lines = []
    seq = int(sum(len(pat.colls[x % pat.n]) for x in range(max(0, len(k) - nsteps)))) \
        if len(k) - nsteps < 50_000 else (len(k) - nsteps) * len(pat.colls[0])
    for s in range(len(k) - nsteps, len(k)):
        cs = pat.colls[s % pat.n]
        first = min((c["enqueue_ns"] for c in cs), default=0)
        for c in cs:
            rec = dict(c, step=int(s), seq=seq)
            seq += 1
            late = int(extra[s] * 1e6) if slow else 0
            rec["enqueue_ns"] = int(start[s]) + c["enqueue_ns"] + late
            if c.get("end_ns") is not None:
                rec["end_ns"] = int(start[s]) + c["end_ns"] + int(extra[s] * 1e6)
            if straggler is not None and not slow and c["enqueue_ns"] == first:
                rec["blocked_ms"] = c.get("blocked_ms", 0.0) + float(extra[s])
            lines.append(json.dumps(rec))
    half = len(lines) // 2
    (d / "collectives.prev.jsonl").write_text("\n".join(lines[:half]) + "\n" if half else "")
    (d / "collectives.jsonl").write_text("\n".join(lines[half:]) + "\n")
    tail = [{"step": int(s), "start_ns": int(start[s]), "end_ns": int(start[s] + dur[s] * 1e6),
             "dur_ms": float(dur[s]), "source": "optimizer"} for s in range(max(0, len(k) - 50), len(k))]
    (d / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in tail))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--budget-mb", type=float, default=256.0)
    ap.add_argument("--source", default=None)
    ap.add_argument("--straggler", type=int, default=None)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--from-step", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    synthesize(a.out, a.ranks, a.steps, a.budget_mb, a.source, a.straggler, a.delay_ms,
               a.from_step, a.seed)
    size = sum(p.stat().st_size for p in a.out.rglob("*") if p.is_file())
    print(f"{a.out}: {a.ranks} ranks x {a.steps} steps, {size / 2**20:.1f} MB, "
          f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
