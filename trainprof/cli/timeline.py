"""`trainprof timeline`: every rank of the job in one trace for Perfetto / chrome://tracing."""

from __future__ import annotations

from pathlib import Path

import click

from trainprof.cli._output import InputError, apply_input_limit, max_input_option


@click.command()
@click.argument("inputs", metavar="RUN_DIR|TRACES", nargs=-1, required=True,
                type=click.Path(exists=True, path_type=Path))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The trace file to write (JSON; .json.gz with --gzip).")
@click.option("--steps", default=None, metavar="A-B", help="Steps to show (e.g. 10-20 or 3,7).")
@click.option("--ranks", default=None, metavar="SPEC", help="Ranks to show (e.g. 0-7,12).")
@click.option("--gzip", "gz", is_flag=True, help="Write the file gzip-compressed.")
@click.option("--max-mb", type=click.FloatRange(min=1), default=100, show_default=True,
              help="Size limit of the trace (uncompressed JSON): the shortest profiler ops are "
                   "left out first, and the file says what was left out.")
@click.option("--no-findings", is_flag=True,
              help="Without summary.json, do not run the analysis for the findings' markers.")
@max_input_option
def timeline(inputs, out, steps, ranks, gz, max_mb, no_findings, max_input_mb):
    """Write one Chrome trace of every rank on one clock: steps, data waits, collectives joined
    across ranks (the last to arrive marked), the critical path, findings, and the profiler
    window's ops, kernels and memory. Opens in ui.perfetto.dev and chrome://tracing
    (docs/timeline.md). RUN_DIR may also be a folder of plain torch.profiler traces.

    At more than 64 ranks or 40 steps a default selection is shown (culprits, their peers,
    one rank per host; the steps around findings), said on stderr and in the file."""
    from trainprof.rundir.files import RunDirError  # lazy: start-up time of trainprof --help
    from trainprof.analysis.timeline import make, parse_spec  # lazy: start-up time of trainprof --help

    apply_input_limit(max_input_mb)
    try:
        step_list = parse_spec(steps, "--steps") if steps else None
        rank_list = parse_spec(ranks, "--ranks") if ranks else None
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    try:
        info = make(inputs[0] if len(inputs) == 1 else list(inputs), out, step_list, rank_list,
                    gz=gz, max_mb=max_mb, findings=not no_findings)
    except RunDirError as e:
        raise InputError(str(e)) from e
    except OSError as e:  # the output cannot be written
        raise click.ClickException(f"{out}: cannot write: {e.strerror or e}") from None
    meta = info["meta"]
    say = lambda s: click.echo(f"trainprof: {s}", err=True)  # noqa: E731
    say(f"timeline written: {info['path']} ({info['bytes'] / 1e6:.1f} MB, {info['events']} events)")
    say(f"ranks: {meta['ranks_selection']}")
    say(f"steps: {meta['steps_selection']}")
    say(f"clock: {meta['clock']['how']}")
    dropped = meta["limit"]["dropped"]
    if dropped:
        say(f"size limit {max_mb:g} MB: left out " + ", ".join(f"{n} {w}" for w, n in dropped.items()))
    say("open it at https://ui.perfetto.dev (Open trace file) or chrome://tracing")
