"""Memory and time of `trainprof analyze` with per-rank trace digests, as the number of profiled
ranks grows: a run of N ranks, every one with a profiler trace (one real trace copied N times).

    python benchmarks/bench_digest.py [--ranks 8 32 128] [--source RUN] [--workers W]
                                      [--baseline]

For each N: `trainprof analyze` cold (no digests: every trace parsed once, in a pool of W
processes, one trace per worker at a time) and warm (digests current: no trace parsed), each in
its own process; printed: wall time, max RSS of the analyzing process and max RSS of its pool
workers (resource.getrusage, RUSAGE_SELF / RUSAGE_CHILDREN). ``--baseline`` adds what holding
every parsed trace at once costs (RunDir.traces(), which job-level analysis no longer calls).

The source is rank 0 of a run directory (default: the H100 run in tests/fixtures/gpu): its
meta.json (rank and world size rewritten), its steps/memory/collective streams and its trace
are copied to every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = ROOT / "tests" / "fixtures" / "gpu" / "h100_hang_run"
STREAMS = ("steps.jsonl", "memory.jsonl", "collectives.jsonl", "groups.jsonl", "steps_device.jsonl")


def synth_run(out: Path, n: int, src: Path) -> Path:
    """``n`` ranks made of ``src``'s rank 0 (meta.json rewritten, streams and trace copied)."""
    from trainprof.rundir.files import profiler_trace_path

    out.mkdir(parents=True)
    man = json.loads((src / "manifest.json").read_text())
    man.update(world_size=n, ranks_seen=n, ranks=[])
    (out / "manifest.json").write_text(json.dumps(man))
    (out / "profiler").mkdir()
    meta = json.loads((src / "ranks/rank-00000/meta.json").read_text())
    for r in range(n):
        d = out / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        for f in STREAMS:
            if (src / "ranks/rank-00000" / f).exists():
                shutil.copy(src / "ranks/rank-00000" / f, d / f)
        (d / "meta.json").write_text(json.dumps(dict(meta, rank=r, world_size=n, local_rank=r % 8)))
        shutil.copy(profiler_trace_path(src, 0), profiler_trace_path(out, r))
    return out


def child(mode: str, run_dir: str) -> None:
    """Runs in its own process: the measured work, then its rusage as one JSON line."""
    t0 = time.perf_counter()
    if mode == "analyze":
        from trainprof.analysis.runner import analyze_and_write

        s, _, _ = analyze_and_write(run_dir, report=False)
        extra = {"errors": len(s["errors"]), "ranks": s["metrics"].get("comm_compute", {})
                 .get("job", {}).get("ranks")}
    else:  # every trace parsed and held at once
        from trainprof.analysis.run import RunDir

        extra = {"traces": len(RunDir(run_dir).traces())}
    wall = time.perf_counter() - t0
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"wall_s": round(wall, 2), "rss_mb": round(me, 1),
                      "workers_rss_mb": round(kids, 1), **extra}))


def measure(mode: str, run_dir: Path, workers: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(run_dir)]
    env = dict(os.environ, **({"TRAINPROF_DIGEST_WORKERS": str(workers)} if workers else {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    ap.add_argument("--workers", type=int, default=None,
                    help="pool size (TRAINPROF_DIGEST_WORKERS; default: the CPUs)")
    ap.add_argument("--baseline", action="store_true", help="also: every trace held at once")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "RUN"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1])
        return 0
    trace = args.source / "profiler" / "rank-00000.pt.trace.json.gz"
    print(f"source trace: {trace} ({trace.stat().st_size / 2**20:.2f} MB); CPUs: "
          f"{len(os.sched_getaffinity(0))}; workers: {args.workers or 'CPUs'}")
    head = f"{'ranks':>6} {'run':>5} {'wall s':>7} {'RSS MB':>7} {'workers RSS MB':>15}"
    print(head)
    with tempfile.TemporaryDirectory(prefix="bench-digest-") as tmp:
        for n in args.ranks:
            run_dir = synth_run(Path(tmp) / f"run{n}", n, args.source)
            runs = [("cold", "analyze"), ("warm", "analyze")]
            if args.baseline:
                runs.append(("all traces", "traces"))
            for label, mode in runs:
                m = measure(mode, run_dir, args.workers)
                print(f"{n:>6} {label:>5} {m['wall_s']:>7.2f} {m['rss_mb']:>7.0f} "
                      f"{m['workers_rss_mb']:>15.0f}", flush=True)
            shutil.rmtree(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
