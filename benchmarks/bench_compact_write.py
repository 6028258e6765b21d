"""Cost and size of the bounded capture's writes per step (probes/compact.py), against the
JSONL-only streams it replaces, on the collective pattern of a real run (tests/fixtures/rundir_v1:
the 2-rank --dp 2 reference, 22 collectives a step).

    python benchmarks/bench_compact_write.py [--steps 5000] [--budget-mb 256]

Per step: the job's thread (handing the step's records to the streams: the steps record is
written at once, the collectives queued) and the flushing thread (serializing the JSONL,
aggregating the collectives and packing the compact rows, appending; folding when the budget
asks), in µs, and the bytes per step on disk of the compact tables and of the JSONL. The
flushing thread's work runs off the job's thread, but holds the GIL while it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainprof.probes import compact  # noqa: E402
from trainprof.rundir.files import JsonlWriter  # noqa: E402

SRC = ROOT / "tests" / "fixtures" / "rundir_v1" / "ranks" / "rank-00000"


def pattern():
    steps = [json.loads(x) for x in (SRC / "steps.jsonl").read_text().splitlines()][1:]
    coll = [json.loads(x) for x in (SRC / "collectives.jsonl").read_text().splitlines()]
    by = {}
    for c in coll:
        by.setdefault(c["step"], []).append(c)
    return [(s, by.get(s["step"], [])) for s in steps]


def run(mode: str, n: int, budget_mb: float, d: Path):
    pat = pattern()
    store = compact.CompactStore(d, int(budget_mb * 2**20)) if mode == "compact" else None
    if store:
        sw = store.ring_writer(d / "steps.jsonl", "steps")
        cw = store.ring_writer(d / "collectives.jsonl", "collectives")
    else:
        sw, cw = JsonlWriter(d / "steps.jsonl", deferred=True), JsonlWriter(d / "collectives.jsonl", deferred=True)
    job, flush, cpu_job, cpu_flush = [], [], [], []
    tt = time.thread_time_ns
    for i in range(n):
        s, cs = pat[i % len(pat)]
        s = dict(s, step=i)
        cs = [dict(c, step=i, seq=c["seq"] + i * 100) for c in cs]
        c0, t0 = tt(), time.perf_counter_ns()
        cw.write_records(cs)
        sw.write(s, urgent=True)
        c1, t1 = tt(), time.perf_counter_ns()
        cw.flush()
        if store:
            store.flush()
        c2, t2 = tt(), time.perf_counter_ns()
        job.append((t1 - t0) / 1e3)
        flush.append((t2 - t1) / 1e3)
        cpu_job.append((c1 - c0) / 1e3)
        cpu_flush.append((c2 - c1) / 1e3)
    if store:
        store.close()
    sw.close()
    cw.close()
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    comp = sum(p.stat().st_size for p in (d / "compact").rglob("*.bin")) if store else 0
    return (statistics.median(job), statistics.mean(flush), size / n, comp / n,
            statistics.median(cpu_job), statistics.mean(cpu_flush))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--budget-mb", type=float, default=256.0)
    a = ap.parse_args()
    for mode in ("jsonl", "compact"):
        with tempfile.TemporaryDirectory() as t:
            job, fl, per, comp, cjob, cfl = run(mode, a.steps, a.budget_mb, Path(t))
            print(f"{mode:>8}: job thread {job:.1f} µs/step (median; CPU {cjob:.1f}), flushing "
                  f"thread {fl:.1f} µs/step (mean, folds included; CPU {cfl:.1f}), on disk "
                  f"{per:.0f} B/step" + (f" (compact tables {comp:.0f} B/step)" if comp else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
