"""Shared terminal helpers for the CLI verbs (analysis progress and the closing summary)."""

from __future__ import annotations

import contextlib
import sys

import click


@contextlib.contextmanager
def progress_status(enabled: bool = True):
    """Yields a callable(str) showing what the analysis is doing (a spinner on a TTY)."""
    if not enabled or not sys.stderr.isatty():
        yield lambda msg: None
        return
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("analyzing") as status:
        yield lambda msg: status.update(f"analyzing: {msg}")


def analyze_and_print(run_dir, out_dir=None, as_json=False, report=True, quiet=False):
    """Run the analysis and print the terminal summary (or the JSON). Returns the summary."""
    import json

    from trainprof.analysis import analyze_and_write

    with progress_status(enabled=not as_json and not quiet) as progress:
        summary, summary_path, report_path = analyze_and_write(
            run_dir, out_dir, report=report, progress=progress)
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    elif not quiet:
        from trainprof.reports.terminal import render_terminal

        render_terminal(summary, report_path=str(report_path) if report_path else None)
        click.echo(f"summary: {summary_path}")
    return summary
