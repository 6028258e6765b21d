"""`trainprof analyze`: findings, summary.json and report.html from a run directory."""

from __future__ import annotations

from pathlib import Path

import click

from trainprof.cli._output import InputError, analyze_and_print, apply_input_limit, max_input_option
from trainprof.rundir.files import RunDirError

NOTHING_ANALYZED_EXIT = 3  # no rank's data, no trace read, or no event in the traces read


@click.command()
@click.argument("inputs", metavar="RUN_DIR|TRACES|SNAPSHOT...", nargs=-1, required=True,
                type=click.Path(path_type=Path))
@click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where summary.json and report.html go (default: RUN_DIR, the traces' folder, or "
                   "beside a single file).")
@click.option("--json", "as_json", is_flag=True, help="Print summary.json to stdout.")
@click.option("--no-report", is_flag=True, help="Skip report.html.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing (files are still written).")
@max_input_option
def analyze(inputs, out, as_json, no_report, quiet, max_input_mb):
    """Analyze RUN_DIR (written by `trainprof wrap`) and report what is wrong, where and why.

    Writes RUN_DIR/summary.json (machine-readable findings and metrics) and RUN_DIR/report.html
    (one self-contained file, opens offline), and prints a short summary.

    TRACES: torch.profiler traces you already have are analyzed as a job: a folder of them
    (tensorboard_trace_handler's <host>_<pid>.<ts>.pt.trace.json[.gz], HTA's rank-N.*), one trace
    file (FILE.summary.json / FILE.report.html beside it), or several files and folders together
    (outputs in their common folder). The rank is distributedInfo.rank, else the rank in the file
    name, else one rank per file; of several windows of one process the one holding the most
    training (steps with ops in them, then the latest). A folder of several jobs: its latest
    complete job; several inputs of several jobs are refused. A folder whose traces are in one
    subfolder (Lightning's lightning_logs/version_0/): that subfolder, outputs in the folder.

    Several RUN_DIRs: the per-node run directories of one job (one `wrap --out` per node) are
    analyzed as one job, their ranks merged; directories of different jobs (manifest job_id or
    world size) or holding the same rank are refused, naming the files. The outputs go to --out,
    by default into the first RUN_DIR.

    RUN_DIR may also be a CUDA allocator snapshot (a *.pickle written by
    torch.cuda.memory._dump_snapshot) or a folder of them: the memory and fragmentation
    analyses run on them (loaded without executing code), and FILE.summary.json /
    FILE.report.html are written beside the file (summary.json / report.html in a folder).

    Inputs are read as untrusted (docs/security.md): only regular files, each up to
    --max-input-mb; what is refused is listed under problems.

    --out DIR is written only when it is missing, empty, a trainprof run directory or holds
    only trainprof's own summary.json/report.html (else exit 2: never the user's files).

    Exit codes: 0 analyzed, 2 input refused (not a readable run directory nor traces, JSON
    files none of which is a trace, traces of several jobs as several inputs, a newer schema, a
    bad input limit, an --out DIR holding other files), 3 nothing to analyze (no rank captured
    any data, e.g. the probes were disabled; every stream file empty or torn; no profiler trace
    could be read; the traces read hold no events), 4 analyzed and printed but summary.json or
    report.html could not be written (a full disk, a read-only folder).
    """
    # lazy: start-up time of trainprof --help
    from trainprof.analysis.outputs import EXIT_NOT_WRITTEN, OutputsNotWritten
    apply_input_limit(max_input_mb)
    run_dir = inputs[0] if len(inputs) == 1 else list(inputs)
    try:
        summary = analyze_and_print(run_dir, out, as_json=as_json, report=not no_report, quiet=quiet)
    except RunDirError as e:
        raise InputError(str(e)) from e
    except OutputsNotWritten as e:  # a full disk: the findings were printed; one line, exit 4
        from trainprof.reports.terminal import printable  # lazy: start-up time of trainprof --help

        click.echo(f"trainprof: {printable(e)}: the findings printed above are not saved; free "
                   f"space or write them elsewhere with --out DIR", err=True)
        raise SystemExit(EXIT_NOT_WRITTEN)
    if summary.get("nothing_analyzed"):  # never "nothing looks wrong" about what was not seen
        click.echo(f"trainprof: nothing analyzed: {summary['nothing_analyzed']}", err=True)
        raise SystemExit(NOTHING_ANALYZED_EXIT)
