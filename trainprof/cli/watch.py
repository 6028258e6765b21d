"""`trainprof watch`: a live terminal view of a run in progress."""

from __future__ import annotations

import time
from pathlib import Path

import click

from trainprof.cli._output import InputError


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--interval", "-n", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              metavar="S", help="Seconds between refreshes.")
@click.option("--window", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              metavar="MIN", help="Steps/s and step time over the last MIN minutes.")
@click.option("--rows", type=click.IntRange(min=1), default=20, show_default=True,
              help="Ranks listed (most behind first).")
@click.option("--once", is_flag=True, help="Print one snapshot and exit (no live refresh).")
def watch(run_dir, interval, window, rows, once):
    """Watch RUN_DIR while its job runs: steps/s and step time over the last minutes, each
    rank's lag and heartbeat age (most behind first), a hang suspicion, and the findings of the
    last analysis with their onsets (`wrap --analyze-every`, or `trainprof analyze`).

    Reads only the ends of the run's files (nothing is written; the job is not disturbed).
    Stops when the run has ended, or on Ctrl-C. Exit codes: 0, 2 not a run directory.
    """
    from rich.console import Console

    from trainprof.analyzers.live import snapshot  # lazy: start-up time of trainprof --help
    from trainprof.reports.live import render_watch  # lazy: start-up time of trainprof --help

    if not (run_dir / "ranks").is_dir() and not (run_dir / "manifest.json").is_file():
        raise InputError(f"{run_dir}: not a run directory (no manifest.json, no ranks/)")
    console = Console(highlight=False)
    if not console.is_terminal:  # a file or a pipe: not squeezed to 80 columns (as compare)
        console = Console(highlight=False, width=160)
    if once or not console.is_terminal:
        console.print(render_watch(snapshot(run_dir, window * 60), rows))
        return
    from rich.live import Live

    try:
        with Live(render_watch(snapshot(run_dir, window * 60), rows), console=console,
                  auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(interval)
                snap = snapshot(run_dir, window * 60)
                live.update(render_watch(snap, rows), refresh=True)
                if snap["state"] != "running":
                    break
    except KeyboardInterrupt:
        pass
