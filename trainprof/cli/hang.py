"""`trainprof hang RUN_DIR`: the hang post-mortem on its own (the same analysis runs inside
`trainprof analyze`), optionally asking a live job to dump first."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from trainprof.cli._output import InputError, apply_input_limit, max_input_option
from trainprof.rundir.files import (HANG_DUMP as DUMP, HANG_TRIGGER as TRIGGER, RANKS_DIR,
                                    RunDirError, read_json, write_json_atomic)
from trainprof.wording import ranks_phrase, share_label, verb


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the post-mortem as JSON.")
@click.option("--dump", "request_dump", is_flag=True,
              help="The job is still running: ask every rank to dump its stacks, collectives and "
                   "flight recorder now, wait for the dumps, then show the post-mortem.")
@click.option("--wait", "wait_s", type=float, default=15.0, show_default=True, metavar="SECONDS",
              help="With --dump: how long to wait for the ranks' dumps.")
@max_input_option
def hang(run_dir, as_json, request_dump, wait_s, max_input_mb):
    """Who is stuck where: per-rank state, the collective each waits in, ranks that never
    arrived, desynchronized collectives, stacks grouped across ranks, and the culprit.

    Works on a run that is still hanging (with --dump), one ended by `wrap --on-hang kill`, and
    one killed with SIGKILL (from heartbeats alone; some ranks' files may be missing).

    Exit codes: 0 analyzed (a hang or not), 2 input refused (a run directory that cannot be
    read, or of a newer schema), 3 nothing analyzed (no heartbeats, hang dumps or flight
    recorder, e.g. a folder of profiler traces).
    """
    from trainprof.analyzers.hang import postmortem  # lazy: start-up time of trainprof --help
    from trainprof.cli.analyze import NOTHING_ANALYZED_EXIT  # lazy: start-up time of trainprof --help
    from trainprof.analysis.run import RunDir  # lazy: start-up time of trainprof --help

    apply_input_limit(max_input_mb)
    try:
        if request_dump:
            _request_dump(run_dir, wait_s)
        run = RunDir(run_dir)
        pm = postmortem(run)
    except RunDirError as e:
        raise InputError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - a broken input found a gap: one line, not a traceback
        from trainprof.reports.terminal import printable  # lazy: start-up time of trainprof --help

        raise click.ClickException(printable(
            f"{run_dir}: the hang analysis failed on this run directory ({type(e).__name__}: "
            f"{e}); `trainprof analyze` shows what else it holds")) from e
    if as_json:
        click.echo(json.dumps({"postmortem": pm, "problems": list(dict.fromkeys(run.problems))},
                              indent=2, default=str))
    else:
        render(pm, run)
    if pm is None:  # never "no hang" about a directory that holds no hang data
        from trainprof.reports.terminal import printable  # lazy: start-up time of trainprof --help

        click.echo(printable(f"trainprof: nothing analyzed: {run_dir}: {_found(run)}"), err=True)
        raise SystemExit(NOTHING_ANALYZED_EXIT)


def _found(run) -> str:
    """What RUN_DIR holds, for a directory without hang data, and what was expected."""
    if run.trace_inputs:
        what = f"found {len(run.trace_inputs)} profiler trace(s) only"
    elif getattr(run, "bare_snapshots", None):
        what = f"found {len(run.bare_snapshots)} allocator snapshot(s) only"
    elif run.ranks:
        what = (f"found {len(run.ranks)} rank folder(s) without heartbeats, hang dumps or "
                f"flight-recorder files")
    else:
        what = "found no rank folders (ranks/rank-N)"
    return (f"{what}; expected a run directory written by `trainprof wrap` (its ranks' "
            f"heartbeat.jsonl, hang-dump.json or flight-recorder files)")


def _request_dump(run_dir: Path, wait_s: float) -> None:
    ranks = sorted((run_dir / RANKS_DIR).glob("rank-*"))
    if not ranks:
        raise RunDirError(f"{run_dir}: no ranks/ yet; is the job running under trainprof wrap?")
    tid = f"manual-{time.time_ns()}"
    write_json_atomic(run_dir / TRIGGER, {"id": tid, "t_ns": time.time_ns(), "action": "dump",
                                          "requested_by": "trainprof hang --dump"})
    deadline = time.monotonic() + wait_s
    pending = set(ranks)
    while pending and time.monotonic() < deadline:
        for d in list(pending):
            try:
                dump = read_json(d / DUMP)
            except RunDirError:
                continue
            if dump.get("trigger_id") == tid and dump.get("complete"):
                pending.discard(d)
        time.sleep(0.2)
    if pending:
        click.echo(f"trainprof: {len(pending)} rank(s) did not dump within {wait_s:g} s: "
                   f"{', '.join(p.name for p in sorted(pending))}", err=True)


def render(pm: dict | None, run) -> None:
    """Every string from the run (names, frames, paths, problems) is printed as text: markup
    escaped (``escape``) or printed with markup off, control characters made visible (``pr``)."""
    from rich.console import Console
    from rich.table import Table

    from trainprof.reports.terminal import printable as pr  # lazy: start-up time of trainprof --help
    from trainprof.reports.terminal import text as escape  # lazy: start-up time of trainprof --help

    console = Console()
    if pm is None:  # said on stderr by the caller (exit 3)
        return
    if not pm["hung"] and not pm["desync"] and not pm.get("died"):
        console.print(f"[green]No hang[/green] in {escape(run.path)}: "
                      f"{pm['ranks_with_heartbeat']} rank(s) with heartbeats"
                      + (f", last progress {pm['stalled_s']:.1f} s "
                         + ("ago (the job is still running)" if pm["job"].get("running")
                            else "before the end")
                         if pm.get("stalled_s") is not None else ""))
        return
    console.print(f"[bold red]{escape(pm['message'])}[/bold red]", highlight=False)
    for reason in pm["detected_by"]:
        console.print(f"  detected: {pr(reason)}", highlight=False, markup=False)
    job = pm["job"]
    if job.get("exit_not_recorded"):  # never a blank exit code
        console.print(pr(f"  job: {job['exit_not_recorded']}"), highlight=False, markup=False)
    elif job.get("status"):
        code = job.get("exit_code")
        console.print(pr(f"  job: status {job['status']}, exit code "
                         f"{code if code is not None else 'not recorded'}"),
                      highlight=False, markup=False)

    t = Table(title="ranks", show_lines=False)
    for col in ("rank", "state", "step", "waiting in", "frame", "stalled"):
        t.add_column(col)
    for r in pm["ranks"]:
        w = r["waiting_in"]
        wait = f"{w['op']} #{w['seq']} pg {w['pg']}" if w else ""
        t.add_row(escape(r["rank"]), escape(r["state"]), "" if r["step"] is None else escape(r["step"]),
                  escape(wait), escape(r["user_frame"] or r["frame"] or ""),
                  "" if r["stalled_s"] is None else f"{r['stalled_s']:.1f} s")
    console.print(t)
    for d in pm["desync"]:  # plain text: ops and sizes contain brackets
        what = ", ranks out of step" if d.get("by") == "steps" else ""
        console.print(pr(f"desync ({d['source']}{what}): group {d['pg']} collective #{d['seq']}: "
                         + "; ".join(f"{ranks_phrase(v['ranks'])}: {v.get('call') or v['op']}"
                                     for v in d["variants"])),
                      highlight=False, markup=False)
    for m in pm["never_arrived"]:
        console.print(pr(f"never arrived ({m['source']}): {ranks_phrase(m['missing_ranks'])} at "
                         f"{m.get('op') or 'collective'} #{m['seq']} of group {m['pg']} "
                         f"({ranks_phrase(m['waiting_ranks'])} "
                         f"{verb(len(m['waiting_ranks']), 'waits', 'wait')} in it)"),
                      highlight=False, markup=False)
    if pm["job"].get("running") and not any(r["dumped"] for r in pm["ranks"]):
        console.print(f"  stacks: `trainprof hang {escape(run.path)} --dump` makes every rank "
                      f"write where it is (all threads), then says the same with frames",
                      highlight=False)
    for g in pm["stack_groups"]:
        label = share_label(len(g["ranks"]), [len(x["ranks"]) for x in pm["stack_groups"]])
        console.print(f"\n[bold]stack group {escape(g['id'])} ({label}): "
                      f"{escape(ranks_phrase(g['ranks']))}[/bold]")
        for f in g["frames"][:8]:
            console.print(pr(f"    {f['file']}:{f['line']} in {f['function']}"
                             + (f"  | {f['code']}" if f.get("code") else "")), highlight=False,
                          markup=False)
    for p in dict.fromkeys(run.problems):
        console.print(f"[yellow]problem:[/yellow] {escape(p)}", highlight=False)
