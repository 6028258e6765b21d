"""`trainprof wrap`: run an unmodified job with probes in every rank, then analyze it."""

from __future__ import annotations

from pathlib import Path

import click

from trainprof.launcher import (HANG_EXIT_CODE, HangPolicy, LaunchError, exit_like, prepare_run_dir,
                                run_job)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path), default="traces",
              show_default=True, help="Run directory to capture into.")
@click.option("--force", is_flag=True, help="Replace the trainprof files of an existing run in --out.")
@click.option("--no-analyze", is_flag=True, help="Only capture; run `trainprof analyze` later.")
@click.option("--profile-steps", default="3-4", show_default=True, metavar="FIRST-LAST|none",
              help="Steps (0-based, inclusive) to record with torch.profiler. Step 0 includes set-up.")
@click.option("--hang-timeout", type=float, default=None, metavar="SECONDS",
              help="Treat the job as hung when no rank has progressed (finished a step or a "
                   "collective) for SECONDS; every rank then dumps its stacks, collectives and "
                   "flight recorder. Choose more than your longest gap between collectives.")
@click.option("--on-hang", type=click.Choice(["dump", "kill"]), default=None,
              help=f"With --hang-timeout: dump and keep waiting (default), or dump and terminate "
                   f"the job, exiting with code {HANG_EXIT_CODE}.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def wrap(out, force, no_analyze, profile_steps, hang_timeout, on_hang, cmd):
    """Run CMD with trainprof's probes in every worker process.

    \b
    CMD is any launcher that starts Python workers, unchanged:
      trainprof wrap -- torchrun --nproc-per-node 8 train.py --lr 3e-4
      trainprof wrap --out runs/exp1 -- python train.py

    Every worker that initializes torch.distributed (or steps an optimizer) records per-step
    timings, a torch.profiler window and its mesh coordinates into the run directory. The job's
    stdout/stderr, exit code and signals are preserved: trainprof exits as the job did (or with
    code 124 when --on-hang kill ended a hung job). When the job ends, even by a signal, the run
    is analyzed and the report's path printed.
    """
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise click.UsageError("give the command to run after --, e.g. trainprof wrap -- python train.py")
    from trainprof.probes.profiler_window import parse_steps

    if on_hang and hang_timeout is None:
        raise click.UsageError("--on-hang needs --hang-timeout SECONDS")
    try:
        hang = HangPolicy(hang_timeout, on_hang or "dump") if hang_timeout is not None else None
        parse_steps(profile_steps)
        prepare_run_dir(out, force)
        code, sig = run_job(cmd, out, profile_steps=profile_steps, hang=hang)
    except (LaunchError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    finish(out, code, sig, analyze=not no_analyze)


def finish(out: Path, code: int, sig: int | None, analyze: bool) -> None:
    """Analyze (never changing the job's outcome), then exit exactly as the job did."""
    how = f"killed by signal {sig}" if sig else f"exit code {code}"
    if code == HANG_EXIT_CODE and not sig and _hung(out):
        how = f"terminated as hung, exit code {code}"
    click.echo(f"trainprof: job finished ({how}); run directory: {out}", err=True)
    if analyze:
        from trainprof.cli._output import analyze_and_print

        try:
            analyze_and_print(out)
        except KeyboardInterrupt:
            click.echo("trainprof: analysis interrupted; run `trainprof analyze` later", err=True)
        except Exception as e:  # noqa: BLE001 - the job's exit code matters more than our report
            click.echo(f"trainprof: analysis failed: {type(e).__name__}: {e}; the captured data "
                       f"in {out} is intact", err=True)
    exit_like(code, sig)


def _hung(out: Path) -> bool:
    from trainprof.rundir import MANIFEST, RunDirError, read_json

    try:
        return read_json(out / MANIFEST).get("status") == "hung"
    except (RunDirError, AttributeError):
        return False
