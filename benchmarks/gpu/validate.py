"""trainprof's GPU validation suite: one command, one GPU, at most 8 minutes.

    python benchmarks/gpu/validate.py --out OUT [--fixtures DIR] [--jobs N] [--only a,b] [--skip a,b]
    python benchmarks/gpu/validate.py --dry-run --out OUT       # the same on CPU (gloo), no CUDA

Runs trainprof on real GPU jobs and checks what it finds (docs/gpu-validation.md lists the checks
and their pass criteria): the reference job on CUDA (1 rank; 2 ranks sharing the GPU over gloo),
DDP on NCCL (the recording bucket hook, bit-identical parameters), a job with its own profiler,
an injected NaN (default and TRAINPROF_NAN_SYNC=1), allocator fragmentation with a snapshot,
NVML telemetry joined to steps, MFU with the device's peak, the always-on probes' overhead
(alternated A/B) and trainprof's analysis of the captured CUDA traces against HTA's.

Prints a table (check, number, pass/fail) and writes into OUT: results.json, table.txt,
gpu-fixtures.tar.gz (the fixtures, to unpack into tests/fixtures/gpu/) and logs.tar.gz. The
fixtures (small run directories and traces) also go to --fixtures (default
tests/fixtures/gpu/validated on a GPU; OUT/fixtures with --dry-run: never the repo). Exit 0 only
when every check holds; 1 otherwise; 2 on bad usage (no CUDA without --dry-run).

Each check runs its own jobs under its own time limit (a job past it is killed with its process
group) and fails alone: the others go on. Independent checks run --jobs at a time; the overhead
A/B runs last, alone on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import vchecks  # noqa: E402
import vfixtures  # noqa: E402
from vcore import Ctx, Result  # noqa: E402

BUDGET_S = 480  # the whole suite on one GPU
DRY_BUDGET_S = 540  # a loaded 2-core CI machine (under pytest's 600 s limit)
FIXTURES_S = 90  # kept for copying the fixtures and re-analysing them on CPU


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="validate.py", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="checks: " + ", ".join(c.name for c in vchecks.CHECKS))
    ap.add_argument("--out", required=True, type=Path, help="results, logs and fixture tarball")
    ap.add_argument("--fixtures", type=Path, default=None,
                    help="where the fixtures go (default tests/fixtures/gpu/validated; "
                         "--dry-run: OUT/fixtures)")
    ap.add_argument("--dry-run", action="store_true",
                    help="everything but CUDA: jobs on CPU with gloo, small sizes")
    ap.add_argument("--jobs", type=int, default=None, help="checks at a time (default 4; dry-run 2)")
    ap.add_argument("--only", default="", help="comma list of checks to run")
    ap.add_argument("--skip", default="", help="comma list of checks to leave out (reported as skipped)")
    ap.add_argument("--hta-python", default=sys.executable,
                    help="a Python with HTA (`pip install -e .[hta]`); default this one")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"time for the whole suite (default {BUDGET_S}; dry run {DRY_BUDGET_S})")
    ap.add_argument("--work", default=None, help="where the jobs run (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the jobs' run directories")
    a = ap.parse_args(argv)
    a.budget_s = a.budget_s or (DRY_BUDGET_S if a.dry_run else BUDGET_S)
    names = {c.name for c in vchecks.CHECKS}
    for opt in ("only", "skip"):
        bad = [x for x in getattr(a, opt).split(",") if x and x not in names]
        if bad:
            ap.error(f"--{opt}: unknown check(s) {', '.join(bad)} (known: {', '.join(sorted(names))})")
    return a


def versions(cuda: bool) -> dict:
    import torch

    v = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "cuda": torch.version.cuda, "device": "cpu (dry run)", "nccl": None}
    if cuda:
        v["device"] = torch.cuda.get_device_name(0)
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - a build without NCCL: say so
            v["nccl"] = f"unavailable ({type(e).__name__})"
        try:
            import pynvml

            pynvml.nvmlInit()
            v["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001
            v["driver"] = None
    try:
        import trainprof

        v["trainprof"] = trainprof.__version__
    except Exception:  # noqa: BLE001
        v["trainprof"] = None
    return v


def run_checks(ctx: Ctx, selected: list, jobs: int) -> dict[str, Result]:
    """Run the selected checks: the independent ones `jobs` at a time, then those that read
    another check's output, then the exclusive ones alone. A check's exception is its failure."""
    results: dict[str, Result] = {}
    waves = [[c for c in selected if not c.after and not c.exclusive],
             [c for c in selected if c.after and not c.exclusive],
             [c for c in selected if c.exclusive]]
    # each wave ends early enough for the ones after it: the exclusive checks and the
    # fixtures keep a share of the budget whatever the first wave does
    budget = ctx.t_end - time.monotonic()
    keep = [0.0, 0.1 * budget if waves[1] else 0.0, 0.25 * budget if waves[2] else 0.0]
    for i, wave in enumerate(waves):
        if not wave:
            continue
        n = 1 if wave[0].exclusive else max(1, jobs)
        until = ctx.t_end - FIXTURES_S - sum(keep[i + 1:])
        with ThreadPoolExecutor(max_workers=n) as pool:
            for r in pool.map(lambda c: ctx.run_check(c, results, until), wave):
                results[r.name] = r
                print(r.line(), flush=True)
    return results


def table(results: list[Result]) -> str:
    w = max([len(r.name) for r in results] + [5])
    rows = [f"{'check':{w}}  {'number':52}  {'result':6}  {'s':>5}  detail"]
    for r in results:
        rows.append(f"{r.name:{w}}  {r.number[:52]:52}  {r.verdict:6}  {r.seconds:5.0f}  {r.detail}")
    return "\n".join(rows)


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    cuda = not a.dry_run
    if cuda and not torch.cuda.is_available():
        print("validate.py: no CUDA device (torch.cuda.is_available() is False); "
              "--dry-run runs the suite on CPU", file=sys.stderr)
        return 2
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    fixtures = (a.fixtures or (out / "fixtures" if a.dry_run else ROOT / "tests" / "fixtures" / "gpu"
                               / "validated")).resolve()
    if a.dry_run and fixtures.is_relative_to(ROOT / "tests"):
        print(f"validate.py: --dry-run never writes into the repo's tests/ ({fixtures})", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="trainprof-validate-", dir=a.work))
    ver = versions(cuda)
    ctx = Ctx(cuda=cuda, work=work, root=ROOT, hta_python=a.hta_python,
              t_end=time.monotonic() + a.budget_s)
    only = {x for x in a.only.split(",") if x}
    skip = {x for x in a.skip.split(",") if x}
    selected = [c for c in vchecks.CHECKS if (not only or c.name in only) and c.name not in skip]
    print(f"trainprof GPU validation{' (dry run, CPU)' if a.dry_run else ''}: {ver['device']}, "
          f"torch {ver['torch']}, CUDA {ver['cuda']}, NCCL {ver['nccl']}; {len(selected)} checks -> {out}",
          flush=True)
    t0 = time.monotonic()
    results = run_checks(ctx, selected, a.jobs or (2 if a.dry_run else 4))
    fx = vfixtures.write(ctx, results, fixtures, ver)
    results[fx.name] = fx
    print(fx.line(), flush=True)
    ordered = [results[c.name] for c in selected] + [fx]
    ordered += [Result(name=n, ok=None, number="", detail="skipped (--skip)") for n in sorted(skip)]
    txt = table(ordered)
    failed = [r.name for r in ordered if r.ok is False]
    total = time.monotonic() - t0
    summary = (f"{len(ordered) - len(failed) - len(skip)} passed, {len(failed)} failed, {len(skip)} "
               f"skipped in {total:.0f} s" + (f" (budget {a.budget_s:.0f} s exceeded)" if total > a.budget_s
                                                else ""))
    print("\n" + txt + "\n" + summary)
    head = (f"{ver['date']}: {ver['device']} (driver {ver.get('driver')}), torch {ver['torch']}, CUDA "
            f"{ver['cuda']}, NCCL {ver['nccl']}, Python {ver['python']}, trainprof {ver['trainprof']}")
    (out / "table.txt").write_text(f"{head}\n\n{txt}\n{summary}\n")
    (out / "results.json").write_text(json.dumps(
        {"versions": ver, "dry_run": a.dry_run, "seconds": total, "budget_s": a.budget_s,
         "fixtures": str(fixtures), "failed": failed, "skipped": sorted(skip),
         "checks": [r.to_dict() for r in ordered]}, indent=1, default=str))
    _pack(out, work, fixtures)
    if a.keep:
        print(f"run directories kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed or total > a.budget_s else 0


def _pack(out: Path, work: Path, fixtures: Path) -> None:
    """OUT gets two tarballs: the fixtures (relative to tests/fixtures/gpu/) and the logs."""
    if fixtures.is_dir():
        with tarfile.open(out / "gpu-fixtures.tar.gz", "w:gz") as t:
            t.add(fixtures, arcname=fixtures.name)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as t:
        for p in sorted(work.rglob("*.log")):
            t.add(p, arcname=str(p.relative_to(work)))


if __name__ == "__main__":
    sys.exit(main())
