"""`trainprof demo`: the reference 3D-parallel workload, wrapped, analyzed, reported."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trainprof.launch.launcher import LaunchError, run_job


def default_layout() -> tuple[str, int, dict]:
    """(device, nproc, {dp, pp, tp}): all GPUs present, else 8 gloo ranks on the CPU."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return "cpu", 8, {"dp": 2, "pp": 2, "tp": 2}
    tp = 2 if n % 2 == 0 else 1
    pp = 2 if n % (2 * tp) == 0 and n >= 4 else 1
    return "cuda", n, {"dp": n // (tp * pp), "pp": pp, "tp": tp}


@click.command()
@click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path),
              default="trainprof-demo", show_default=True, help="Run directory.")
@click.option("--force", is_flag=True,
              help="Replace a previous run in --out (only the files it wrote are removed).")
@click.option("--steps", default=12, show_default=True, help="Training steps.")
@click.option("--nproc", type=int, default=None, help="Ranks (default: GPUs present, else 8 on CPU).")
@click.option("--dp", type=int, default=None)
@click.option("--pp", type=int, default=None)
@click.option("--tp", type=int, default=None)
@click.option("--schedule", default="1f1b", show_default=True,
              type=click.Choice(["gpipe", "1f1b", "interleaved1f1b"]))
@click.option("--inject", multiple=True, metavar="KIND:key=value,...",
              help="Fault to inject (repeatable), e.g. straggler:rank=3,delay_ms=200.")
@click.option("--profile-steps", default="3-4", show_default=True, metavar="FIRST-LAST|none")
@click.option("--no-analyze", is_flag=True)
def demo(out, force, steps, nproc, dp, pp, tp, schedule, inject, profile_steps, no_analyze):
    """Run the reference 3D-parallel workload (TP x PP x DP) under trainprof and analyze it.

    On a CPU-only machine this is dp2 x pp2 x tp2 = 8 gloo ranks of a small transformer (a few
    minutes on 2 cores); on a GPU machine it uses the GPUs present with NCCL. Add faults with
    --inject to see trainprof find them, e.g.:

    \b
      trainprof demo --inject straggler:rank=5,delay_ms=300
      trainprof demo --inject slow_data:rank=2,delay_ms=300
    """
    device, n, layout = default_layout()
    layout = {"dp": dp or layout["dp"], "pp": pp or layout["pp"], "tp": tp or layout["tp"]}
    if nproc is None:
        nproc = layout["dp"] * layout["pp"] * layout["tp"]
    if layout["dp"] * layout["pp"] * layout["tp"] != nproc:
        raise click.UsageError(f"dp*pp*tp = {layout['dp'] * layout['pp'] * layout['tp']} must equal "
                               f"--nproc {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "trainprof.reference",
           "--dp", str(layout["dp"]), "--pp", str(layout["pp"]), "--tp", str(layout["tp"]),
           "--steps", str(steps), "--schedule", schedule]
    for spec in inject:
        cmd += ["--inject", spec]
    click.echo(f"trainprof demo: {nproc} ranks on {device} (dp{layout['dp']} x pp{layout['pp']} x "
               f"tp{layout['tp']}), {steps} steps -> {out}", err=True)
    from trainprof.cli.wrap import check_before_start, finish  # lazy: start-up time of trainprof --help

    settings, before = check_before_start(out, force)
    try:
        result = run_job(cmd, out, profile_steps=profile_steps, settings=settings, before=before)
    except LaunchError as e:
        raise click.ClickException(str(e)) from e
    finish(out, result, analyze=not no_analyze)
