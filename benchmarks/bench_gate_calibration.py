"""A/A and A/B calibration of the `trainprof compare` CI gate on real runs of the reference job.

    nice -n 19 python benchmarks/bench_gate_calibration.py record [--pool DIR] [--base 24]
        [--slow 8] [--effect slow40=40:12] [--max-load 5]
    python benchmarks/bench_gate_calibration.py evaluate [--pool DIR] [--fail-on bubble:+5pp] [--json OUT]
    python benchmarks/bench_gate_calibration.py fixtures [--pool DIR] base-00 slow50-00 ...

`record` runs the reference workload (4 ranks, dp=2 pp=2 tp=1, 14 steps) under `trainprof wrap`
into a pool of run directories, once each, skipping runs already recorded:

    base-NN       the clean job, --profile-steps none                  (--base runs)
    slowD-NN      the same job with a straggler on rank 1 costing D ms of compute per step
                  (--slow runs each; --effect NAME=DELAY_MS[:RUNS], default slow10=10,
                  slow30=30, slow50=50); evaluate measures what each costs in step time
    prof-NN       the clean job with the default profiler window (--prof runs): exposed comm
                  and the profiled window's metrics exist only there
    short-NN      the clean job with --steps 3 (--short runs): too few steps to decide

What each configuration still lacks is recorded round-robin (base, slow10, slow30, ..., base,
...), so a change of the machine's load over the recording hits every configuration alike; runs
added to a pool later are interleaved with each other. `--max-load L` waits before each run
until the 1-minute load average is at most L (other jobs on a shared machine). Run it under
`nice -n 19` on a shared machine; it takes a while (each run is 12-60 s on 2 cores, more under
load). `*.load.json` next to each run records the load it started at.

`evaluate` forms comparisons from the pool and runs the gate (the same code as `trainprof
compare`, in process, at the default settings or with --fail-on) on each:

    A/A  1 vs 1     every pair of base runs (12 runs -> 66 pairs)
    A/A  k vs k     disjoint k-run groups of base runs (random splits, fixed seed; --k)
    A/A  history    K base runs as a --baseline-dir history vs 1 and vs m other base runs
    A/B  the same shapes with the candidate side drawn from a slowD pool
    A/B  scaled: with --scale F, the k-vs-k and history shapes of disjoint base runs with the
         candidate side's step times and CPU times multiplied by F (MFU divided by it): a
         uniform slowdown of exactly F on top of the machine's real run-to-run noise

and prints, per shape, the false-alarm rate (A/A comparisons that exit 1), the detection rate
(A/B comparisons that exit 1; the metrics that failed are listed) and how many were
inconclusive (exit 3), with the actual cost of each effect (median over runs of each run's
median step, and of the busiest rank's CPU time per step, slow pool vs base pool). The k-vs-k shapes reuse runs, so their comparisons
are not independent; the 1-vs-1 pairs are each pair once.

`fixtures` writes trimmed copies of pool runs' summary.json (only what compare reads) for
tests/fixtures/compare/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REF = ["-m", "trainprof.reference", "--dp", "2", "--pp", "2", "--tp", "1", "--steps", "14"]
DEFAULT_POOL = Path(os.environ.get("TMPDIR", "/tmp")) / "trainprof-gate-pool"


def record(a) -> int:
    pool = Path(a.pool)
    pool.mkdir(parents=True, exist_ok=True)
    effects = dict(e.split("=", 1) for e in a.effect)  # NAME=DELAY_MS[:RUNS]
    configs = [("base", a.base, [], ["--profile-steps", "none"])]
    for name, spec in effects.items():
        delay, _, n = spec.partition(":")
        configs.append((name, int(n) if n else a.slow, ["--inject", f"straggler:rank=1,delay_ms={delay}"],
                        ["--profile-steps", "none"]))
    configs += [("prof", a.prof, [], [])]
    configs += [("short", a.short, ["--steps", "3"], ["--profile-steps", "none"])]
    # round-robin over what each configuration still lacks, so that runs added to a pool later
    # are interleaved with each other too
    missing = [[(f"{name}-{i:02d}", inject, wrap) for i in range(n)
                if not (pool / f"{name}-{i:02d}" / "summary.json").is_file()]
               for name, n, inject, wrap in configs]
    todo = [row[i] for i in range(max(map(len, missing), default=0)) for row in missing if i < len(row)]
    for k, (name, inject, wrap) in enumerate(todo):
        out = pool / name
        cmd = ["trainprof", "wrap", "--out", str(out), "--force", *wrap, "--", "torchrun",
               "--standalone", "--nproc_per_node", "4", *REF, *inject]
        waited = wait_for_quiet(a.max_load, a.max_wait)
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        log = pool / f"{name}.log"
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        (pool / f"{name}.load.json").write_text(json.dumps(
            {"load_before": load0, "load_after": os.getloadavg()[0], "waited_s": waited,
             "seconds": time.monotonic() - t0, "exit_code": rc}))
        print(f"[{k + 1}/{len(todo)}] {name}: exit {rc} in {time.monotonic() - t0:.0f} s "
              f"(load {load0:.1f}, waited {waited:.0f} s)", flush=True)
        if rc != 0 or not (out / "summary.json").is_file():
            print(f"  failed: see {log}", file=sys.stderr)
    return 0


def wait_for_quiet(max_load: float | None, max_wait: float) -> float:
    """Wait until the 1-minute load average is at most max_load (other jobs on a shared machine
    are noise the gate should not be calibrated on alone), at most max_wait seconds."""
    t0 = time.monotonic()
    while max_load is not None and os.getloadavg()[0] > max_load and time.monotonic() - t0 < max_wait:
        time.sleep(5)
    return time.monotonic() - t0


def _load(pool: Path, prefix: str) -> list[tuple[str, dict]]:
    from trainprof.cli.compare import load_summary

    runs = []
    for d in sorted(pool.glob(f"{prefix}-[0-9][0-9]")):
        if (d / "summary.json").is_file():
            runs.append((d.name, load_summary(d, "run")[0]))
    return runs


def _gate(bases, cands, settings):
    from trainprof.gate.regression import compare_runs
    from trainprof.gate.verdict import overall_verdict

    results, _ = compare_runs([s for _, s in bases], [s for _, s in cands], settings)
    code, _ = overall_verdict(results)
    failed = [r.metric for r in results if r.gate and r.verdict == "regression"]
    return code, failed


def _median_step(runs) -> float:
    from trainprof.gate.metrics import step_samples

    return statistics.median(statistics.median(step_samples(s)) for _, s in runs)


def _median_cpu(runs) -> float | None:
    from trainprof.gate.metrics import cpu_time_value

    vals = [cpu_time_value(s) for _, s in runs]
    return statistics.median(vals) if vals and None not in vals else None


def scaled(summary: dict, f: float) -> dict:
    """A copy of a summary whose every step (and the busiest rank's CPU time) took f times as
    long: what the gate reads of a uniform slowdown by f."""
    s = json.loads(json.dumps(summary))
    st = s.get("metrics", {}).get("step_time", {})
    for p in st.get("per_step") or []:
        p["max_ms"] *= f
    for r, v in (st.get("step_ms_by_rank") or {}).items():
        st["step_ms_by_rank"][r] = [x * f if x is not None else None for x in v]
    for p in (s.get("metrics", {}).get("roofline", {}).get("job", {}).get("per_step") or []):
        if p.get("mfu") is not None:
            p["mfu"] /= f
    for p in (s.get("metrics", {}).get("stragglers", {}).get("per_rank") or []):
        if p.get("cpu_ms") is not None:
            p["cpu_ms"] *= f
    return s


def _groups(runs, k, n_splits, rng):
    """n_splits random pairs of disjoint k-run groups (as sorted name tuples, deduplicated)."""
    seen, out = set(), []
    if len(runs) < 2 * k:
        return out
    for _ in range(n_splits * 20):
        pick = rng.sample(range(len(runs)), 2 * k)
        a, b = tuple(sorted(pick[:k])), tuple(sorted(pick[k:]))
        key = (min(a, b), max(a, b))
        if key in seen:
            continue
        seen.add(key)
        out.append(([runs[i] for i in a], [runs[i] for i in b]))
        if len(out) == n_splits:
            break
    return out


def _cross(bases, slows, k, n_splits, rng):
    out = []
    if len(bases) < k or len(slows) < k:
        return out
    for _ in range(n_splits):
        out.append((rng.sample(bases, k), rng.sample(slows, k)))
    return out


def _history(bases, cands, k, m, n_splits, rng, same_pool):
    """K baseline runs as a history vs m candidate runs (disjoint from it when from the same pool)."""
    out = []
    for _ in range(n_splits):
        if same_pool:
            if len(bases) < k + m:
                return out
            pick = rng.sample(bases, k + m)
            out.append((pick[:k], pick[k:]))
        else:
            if len(bases) < k or len(cands) < m:
                return out
            out.append((rng.sample(bases, k), rng.sample(cands, m)))
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def evaluate(a) -> int:
    from trainprof.gate.regression import Settings

    pool = Path(a.pool)
    settings = Settings(thresholds=dict(f.rsplit(":", 1) for f in a.fail_on))
    rng = random.Random(a.seed)
    bases = _load(pool, "base")
    profs = _load(pool, "prof")
    slow_names = sorted({d.name.rsplit("-", 1)[0] for d in pool.glob("slow*-[0-9][0-9]")})
    slows = {name: _load(pool, name) for name in slow_names}
    if len(bases) < 2:
        print(f"need at least 2 base runs in {pool}; run `record` first", file=sys.stderr)
        return 2
    base_ms = _median_step(bases)
    loads = [json.loads(f.read_text())["load_before"] for f in pool.glob("*.load.json")]
    if loads:
        print(f"1-minute load average before each run: median {statistics.median(loads):.1f}, "
              f"max {max(loads):.1f} (2 cores)")
    base_cpu = _median_cpu(bases)

    def cost(runs):
        text = f"{(_median_step(runs) / base_ms - 1) * 100:+.0f} %"
        cpu = _median_cpu(runs)
        return text + (f", CPU {(cpu / base_cpu - 1) * 100:+.0f} %" if cpu and base_cpu else "")

    print(f"pool {pool}: {len(bases)} base runs (median step {base_ms:.1f} ms"
          + (f", busiest rank's CPU {base_cpu:.1f} ms per step" if base_cpu else "") + "), "
          + ", ".join(f"{len(v)} {k} runs (median step {_median_step(v):.1f} ms, {cost(v)})"
                      for k, v in slows.items() if v)
          + (f", {len(profs)} prof runs" if profs else ""))
    rows = []

    def tally(kind, shape, effect, comparisons, want=None):
        if not comparisons or (a.only and a.only != kind):
            return
        codes = {0: 0, 1: 0, 3: 0}
        names = {}
        hits = 0
        for b, c in comparisons:
            code, failed = _gate(b, c, settings)
            codes[code] = codes.get(code, 0) + 1
            for m in failed:
                names[m] = names.get(m, 0) + 1
            if code == 1 and (want is None or want in failed):
                hits += 1
        n = len(comparisons)
        lo, hi = wilson(hits, n)
        rows.append({"kind": kind, "shape": shape, "effect": effect, "comparisons": n,
                     "exit_1": codes.get(1, 0), "exit_3": codes.get(3, 0), "exit_0": codes.get(0, 0),
                     "rate": hits / n, "rate_ci95": [lo, hi], "failed_metrics": names})

    aa_pairs = [([x], [y]) for x, y in itertools.combinations(bases, 2)]
    tally("A/A", "1 vs 1", "none", aa_pairs)
    for k in a.k:
        tally("A/A", f"{k} vs {k}", "none", _groups(bases, k, a.splits, rng))
    for m in (1, a.history_cands):
        tally("A/A", f"history {a.history} vs {m}", "none",
              _history(bases, bases, a.history, m, a.splits, rng, same_pool=True))
    if len(profs) >= 2:
        tally("A/A", "1 vs 1 (profiled)", "none", [([x], [y]) for x, y in itertools.combinations(profs, 2)])
    for name, runs in slows.items():
        if not runs:
            continue
        effect = f"{cost(runs)} ({name})"
        tally("A/B", "1 vs 1", effect, [([x], [y]) for x in bases for y in runs])
        for k in a.k:
            tally("A/B", f"{k} vs {k}", effect, _cross(bases, runs, k, a.splits, rng))
        for m in (1, a.history_cands):
            tally("A/B", f"history {a.history} vs {m}", effect,
                  _history(bases, runs, a.history, m, a.splits, rng, same_pool=False))
    for f in a.scale:
        effect = f"x{f:g} (scaled base runs)"

        def scale(comparisons):
            return [(b, [(n, scaled(s, f)) for n, s in c]) for b, c in comparisons]
        for k in a.k:
            tally("A/B", f"{k} vs {k}", effect, scale(_groups(bases, k, a.splits, rng)))
        for m in (1, a.history_cands):
            tally("A/B", f"history {a.history} vs {m}", effect,
                  scale(_history(bases, bases, a.history, m, a.splits, rng, same_pool=True)))

    print(f"\nsettings: alpha={settings.alpha}, min effect {settings.min_effect * 100:g} %"
          + (f", fail on {', '.join(a.fail_on)}" if a.fail_on else " (the defaults)") + "\n")
    print("| comparison | shape | step-time cost | n | exit 1 | exit 3 | rate (95 % CI) | metrics that failed |")
    print("|:--|:--|:--|--:|--:|--:|:--|:--|")
    for r in rows:
        what = "false alarms" if r["kind"] == "A/A" else "detected"
        lo, hi = r["rate_ci95"]
        print(f"| {r['kind']} | {r['shape']} | {r['effect']} | {r['comparisons']} | {r['exit_1']} | "
              f"{r['exit_3']} | {what} {r['rate'] * 100:.0f} % ({lo * 100:.0f}-{hi * 100:.0f} %) | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(r['failed_metrics'].items())) or '-'} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"pool": str(pool), "rows": rows}, indent=2))
    return 0


# what `trainprof compare` reads from a summary.json (tests/fixtures/compare/ keeps only this)
KEEP = {
    "schema_version": True, "trainprof_version": True,
    "run": {"world_size": True, "mesh": True, "device": True, "torch_version": True,
            "exit_code": True, "run_info": {"tokens_per_step": True}},
    "metrics": {
        "step_time": {"job": {"steps": True, "median_ms": True, "tokens_per_step": True,
                              "ranks_reporting": True},
                      "per_step": [{"step": True, "max_ms": True}], "excluded_steps": True},
        "roofline": {"job": {"mfu": True, "peak_flops_per_s_total": True,
                             "per_step": [{"step": True, "mfu": True}]},
                     "peak": {"basis": True, "dtype": True}},
        "pipeline": {"bubble_fraction": True, "bubble_fraction_by_step": True},
        "comm_compute": {"exposed_comm_fraction": True, "job": {"exposed_comm_fraction": True}},
        "memory": {"per_rank": [{"rank": True, "peak_rss_bytes": True, "peak_allocated_bytes": True}]},
        "stragglers": {"per_rank": [{"rank": True, "cpu_ms": True}]},
    },
}


def trim(x, keep):
    if keep is True:
        return x
    if isinstance(keep, list):
        return [trim(v, keep[0]) for v in x] if isinstance(x, list) else None
    if isinstance(x, dict):
        return {k: trim(x[k], sub) for k, sub in keep.items() if k in x}
    return None


def fixtures(a) -> int:
    """Trimmed copies of pool runs: OUT/<run name>.json."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.runs:
        s = json.loads((Path(a.pool) / name / "summary.json").read_text())
        s = trim(s, KEEP)
        s["run"]["dir"] = name  # the pool path would only leak a temporary directory
        (out / f"{name}.json").write_text(json.dumps(s, separators=(",", ":")) + "\n")
        print(f"{out / f'{name}.json'}: {(out / f'{name}.json').stat().st_size} bytes")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record the pool of runs (skips runs already there)")
    r.add_argument("--pool", default=str(DEFAULT_POOL))
    r.add_argument("--base", type=int, default=12, help="clean runs")
    r.add_argument("--slow", type=int, default=6, help="runs per effect size")
    r.add_argument("--prof", type=int, default=6, help="clean runs with the profiler window")
    r.add_argument("--short", type=int, default=1, help="3-step runs (too few steps to decide)")
    r.add_argument("--max-load", type=float, default=None,
                   help="before each run, wait until the 1-minute load average is at most this")
    r.add_argument("--max-wait", type=float, default=600, help="longest wait for --max-load (s)")
    r.add_argument("--effect", action="append", default=None, metavar="NAME=DELAY_MS[:RUNS]",
                   help="straggler delay on rank 1 per step, and runs if not --slow (default "
                        "slow10=10, slow30=30, slow50=50)")
    e = sub.add_parser("evaluate", help="A/A and A/B comparisons over the pool")
    e.add_argument("--pool", default=str(DEFAULT_POOL))
    e.add_argument("--k", type=int, action="append", default=None,
                   help="runs per side for the k-vs-k shapes (default 2, 3, 4, 6, 8)")
    e.add_argument("--history", type=int, default=8, help="baseline runs in the history shapes")
    e.add_argument("--history-cands", type=int, default=3, help="candidate runs against the history")
    e.add_argument("--splits", type=int, default=100, help="random comparisons per k-vs-k shape")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--fail-on", action="append", default=[], metavar="METRIC:THRESHOLD",
                   help="gate this metric too, as `trainprof compare --fail-on` (e.g. bubble:+5pp)")
    e.add_argument("--scale", type=float, action="append", default=[], metavar="F",
                   help="also A/B with base runs slowed by exactly F (e.g. 1.3), see above")
    e.add_argument("--only", choices=["A/A", "A/B"], help="only these comparisons")
    e.add_argument("--json", help="also write the rows as JSON")
    f = sub.add_parser("fixtures", help="trimmed summary.json copies of pool runs (test fixtures)")
    f.add_argument("--pool", default=str(DEFAULT_POOL))
    f.add_argument("--out", default="tests/fixtures/compare")
    f.add_argument("runs", nargs="+", help="run names in the pool, e.g. base-00 slow30-01")
    a = ap.parse_args()
    if a.cmd == "fixtures":
        return fixtures(a)
    if a.cmd == "record":
        a.effect = a.effect or ["slow10=10", "slow30=30", "slow50=50"]
        return record(a)
    a.k = a.k or [2, 3, 4, 6, 8]
    return evaluate(a)


if __name__ == "__main__":
    sys.exit(main())
