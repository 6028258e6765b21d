"""Build a run directory's per-rank trace digests where the traces are (trainprof/analysis/digest.py).

    python -m trainprof.analysis.reduce RUN_DIR [--workers N]              # this machine: every rank
    torchrun --nnodes K --nproc-per-node P ... -m trainprof.analysis.reduce RUN_DIR   # a cluster job

Under torchrun (RANK and WORLD_SIZE set) each process takes its share of the traced ranks —
the i-th of them in rank order when i % WORLD_SIZE == RANK — and digests them with a small
local pool (CPUs ÷ LOCAL_WORLD_SIZE workers unless --workers); the run directory must be on a
file system every node sees. No process group is created: the launcher's environment is all
it needs. Digests already current are kept. Exit status 0 when every trace of the share was
digested, 1 when some could not be (each said on stderr), 2 when RUN_DIR cannot be read.

(``--pool FILE`` is internal: the fresh single-threaded process in which a process with
threads, such as the launcher, runs its digest pool; trainprof/analysis/pool.py pool_in_child.)
"""

from __future__ import annotations

import argparse
import os
import sys

from trainprof import settings
from trainprof.rankranges import ranges
from trainprof.analysis import digest
from trainprof.rundir.files import RunDirError
from trainprof.analysis.run import RunDir


def share(ranks: list[int], rank: int, world: int) -> list[int]:
    """The traced ranks one of ``world`` processes digests: every world-th, from its own."""
    return [r for i, r in enumerate(sorted(ranks)) if i % world == rank]


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--pool":  # trainprof.analysis.pool.pool_in_child's process
        return digest.pool_child_main(argv[1])
    ap = argparse.ArgumentParser(prog="python -m trainprof.analysis.reduce", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="a trainprof run directory")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes of the local pool (default: CPUs / LOCAL_WORLD_SIZE)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    world = max(1, _env_int("WORLD_SIZE", 1))
    me = min(max(0, _env_int("RANK", 0)), world - 1)
    local = max(1, _env_int("LOCAL_WORLD_SIZE", 1))
    try:
        run = RunDir(args.run_dir)
        if run.trace_inputs or run.snapshot_only:
            raise RunDirError(f"{args.run_dir}: not a trainprof run directory")
        mine = share(list(run.profiler_traces()), me, world)
    except RunDirError as e:
        print(f"trainprof.analysis.reduce: {e}", file=sys.stderr)
        return 2
    workers = args.workers or max(1, settings.available_cpus() // local)
    report = digest.build(args.run_dir, ranks=mine, workers=workers) if mine else \
        {"built": [], "reused": [], "failed": {}, "seconds": 0.0}
    for r, why in sorted(report["failed"].items()):
        print(f"trainprof.analysis.reduce: rank {r}: {why}", file=sys.stderr)
    if not args.quiet:  # one write per line: the processes of one node share the stream
        sys.stdout.write(f"trainprof.analysis.reduce: process {me}/{world}: {len(mine)} trace(s): "
                         f"{len(report['built'])} digested, {len(report['reused'])} already "
                         f"current, {len(report['failed'])} failed ({report['seconds']:.1f} s, "
                         f"{workers} worker(s)); ranks {ranges(mine, sep=', ') or 'none'}\n")
        sys.stdout.flush()
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
