"""Shared terminal helpers for the CLI verbs (analysis progress and the closing summary), and
the handling of inputs trainprof refuses (exit 2, one line of plain text)."""

from __future__ import annotations

import contextlib
import sys

import click


EXIT_INPUT = 2


class InputError(click.ClickException):
    """An input trainprof refuses to read (not a run directory, a newer schema, a bad input
    limit): exit 2, the message printed as plain text (no control characters)."""

    exit_code = EXIT_INPUT

    def __init__(self, message: str):
        from trainprof.reports.terminal import printable  # lazy: start-up time of trainprof --help

        super().__init__(printable(message))


def max_input_option(f):
    """--max-input-mb: the largest input file read (see trainprof/safeio.py)."""
    from trainprof.safeio import DEFAULT_MAX_INPUT_MB, ENV  # lazy: start-up time of trainprof --help

    return click.option(
        "--max-input-mb", type=click.FloatRange(min=0, min_open=True), default=None, metavar="MB",
        help=f"Read each input file up to MB megabytes, after decompression (default "
             f"{DEFAULT_MAX_INPUT_MB}, or ${ENV}; small JSON documents get 1/16 of it). Larger "
             f"files are skipped with a problem naming them.")(f)


def apply_input_limit(mb: float | None) -> None:
    """Set the input limit for this process; InputError when the environment's value is bad."""
    from trainprof import safeio  # lazy: start-up time of trainprof --help

    try:
        safeio.set_max_input_mb(mb)
        safeio.check_setting()
    except safeio.SettingError as e:
        raise InputError(str(e)) from None


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


def analyze_and_print(run_dir, out_dir=None, as_json=False, report=True, quiet=False,
                      err=False):
    """Run the analysis and print the terminal summary (or the JSON). Returns the summary.
    ``err``: print on stderr (wrap: its stdout is the job's)."""
    import json

    from trainprof.analysis.runner import analyze_and_write  # lazy: start-up time of trainprof --help

    from trainprof.analysis.outputs import OutputsNotWritten  # lazy: start-up time of trainprof --help

    failed = None
    with progress_status(enabled=not as_json and not quiet) as progress:
        try:
            summary, summary_path, report_path = analyze_and_write(
                run_dir, out_dir, report=report, progress=progress)
        except OutputsNotWritten as e:  # the findings are printed all the same, then re-raised
            failed, summary, summary_path, report_path = e, e.summary, None, None
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str), err=err)
    elif not quiet:
        from rich.console import Console

        # lazy: start-up time of trainprof --help
        from trainprof.reports.terminal import printable, render_terminal

        stream = sys.stderr if err else sys.stdout
        console = Console(highlight=False, stderr=err, soft_wrap=not stream.isatty())
        render_terminal(summary, report_path=str(report_path) if report_path else None,
                        console=console)
        if summary_path:
            click.echo(f"summary: {printable(summary_path)}", err=err)
    if failed:
        raise failed
    return summary
