"""`trainprof wrap`: run an unmodified job with probes in every rank, then analyze it."""

from __future__ import annotations

from pathlib import Path

import click

from trainprof.launch.launcher import (HANG_EXIT_CODE, HangPolicy, JobResult, LaunchError, exit_like,
                                prepare_run_dir, reason, run_job)
from trainprof.rundir.nodes import job_id_of
from trainprof.launch.outdir import OutDirError
from trainprof.settings import SettingsError, validated_env
from trainprof.rundir import nodes
from trainprof.rundir.worker_exits import how
from trainprof.rundir.files import MANIFEST, RunDirError, read_json


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path), default="traces",
              show_default=True, help="Run directory to capture into.")
@click.option("--force", is_flag=True,
              help="Replace a previous trainprof run in --out: remove only the files it wrote "
                   "(never other files; never /, your home or the current directory).")
@click.option("--no-analyze", is_flag=True, help="Only capture; run `trainprof analyze` later.")
@click.option("--profile-steps", default="3-4", show_default=True, metavar="FIRST-LAST|none",
              help="Steps (0-based, inclusive) to record with torch.profiler. Step 0 includes set-up.")
@click.option("--profile-ranks", default=None, metavar="SPEC",
              help="Ranks that record the profiler window: all, none, ranks such as 0,3,8-15, "
                   "per-node (local rank 0 of each host) or per-coord (one rank per coordinate "
                   "of each mesh dimension: every pp stage, tp shard and dp index). Default: all "
                   "up to 64 ranks, above that per-coord (per-node without a DeviceMesh). The "
                   "other probes run on every rank.")
@click.option("--job-id", default=None, metavar="ID",
              help="The job's id, the same on every node: nodes sharing one --out join one run "
                   "directory. Default: torchrun's --rdzv-id, else TORCHELASTIC_RUN_ID.")
@click.option("--hang-timeout", type=float, default=None, metavar="SECONDS",
              help="Treat the job as hung when no rank has progressed (finished a step or a "
                   "collective) for SECONDS; every rank then dumps its stacks, collectives and "
                   "flight recorder. Choose more than your longest gap between collectives.")
@click.option("--on-hang", type=click.Choice(["dump", "kill"]), default=None,
              help=f"With --hang-timeout: dump and keep waiting (default), or dump and terminate "
                   f"the job, exiting with code {HANG_EXIT_CODE}.")
@click.option("--analyze-every", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="MIN", help="Refresh summary.json and report.html every MIN minutes while "
                                  "the job runs (a low-priority background analysis), so that a "
                                  "job killed at its time limit still leaves a recent one.")
@click.option("--budget-mb", default=None, metavar="MB",
              help="Always-on data kept per rank (TRAINPROF_BUDGET_MB, default 256, at least 1): "
                   "compact records of every step, a ring of recent per-collective detail, older "
                   "steps folded into blocks when it would be exceeded (docs/run-directory.md).")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def wrap(out, force, no_analyze, profile_steps, profile_ranks, job_id, hang_timeout, on_hang,
         analyze_every, budget_mb, cmd):
    """Run CMD with trainprof's probes in every worker process.

    \b
    CMD is any launcher that starts Python workers, unchanged:
      trainprof wrap -- torchrun --nproc-per-node 8 train.py --lr 3e-4
      trainprof wrap --out runs/exp1 -- python train.py

    \b
    On several nodes, run one wrap per node. With a shared file system give them the same --out:
      trainprof wrap --out /shared/run1 -- torchrun --nnodes 4 --rdzv-backend c10d \\
          --rdzv-endpoint HOST:PORT --rdzv-id run1 --nproc-per-node 8 train.py
    The nodes of one job (same --rdzv-id or --job-id) join one run directory, each keeps its own
    record in RUN/nodes/, and the last node to finish analyzes. Without a shared file system,
    give each node its own --out and analyze them together: trainprof analyze DIR1 DIR2 ...

    Every worker that initializes torch.distributed (or steps an optimizer) records per-step
    timings, a torch.profiler window and its mesh coordinates into the run directory. The job's
    stdout/stderr, exit code and signals are preserved: trainprof exits as the job did (or with
    code 124 when --on-hang kill ended a hung job), also when trainprof cannot write its run
    directory or analyze it (one line on stderr says what it could not do). When the job ends,
    even by a signal, the run is analyzed and its findings and the report's path printed on
    stderr: stdout carries the job's output alone (`wrap ... > out.txt` holds what the job
    printed).

    Refused before the job starts, with exit code 2: a TRAINPROF_* variable with a value that
    is not accepted (or a name that is no setting), an --out that is /, your home, the current
    directory or one of their parents, and a non-empty --out that is not a previous trainprof
    run (a previous run needs --force, which removes only the files that run wrote).
    """
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise click.UsageError("give the command to run after --, e.g. trainprof wrap -- python train.py")
    from trainprof.probes.profiler_window import parse_steps  # lazy: start-up time of trainprof --help

    if on_hang and hang_timeout is None:
        raise click.UsageError("--on-hang needs --hang-timeout SECONDS")
    try:
        hang = HangPolicy(hang_timeout, on_hang or "dump") if hang_timeout is not None else None
        parse_steps(profile_steps)
    except ValueError as e:
        raise click.ClickException(str(e)) from e

    settings, before = check_before_start(out, force, job_id=job_id_of(cmd, explicit=job_id),
                                          profile_ranks=profile_ranks, budget_mb=budget_mb)
    live = None
    if analyze_every is not None:
        from trainprof.launch.live_analysis import PeriodicAnalysis  # lazy: start-up time of wrap

        live = PeriodicAnalysis(out, analyze_every * 60).start()
    try:
        result = run_job(cmd, out, profile_steps=profile_steps, hang=hang, settings=settings,
                         before=before, config={"profile_ranks": settings.get(
                             "TRAINPROF_PROFILE_RANKS") or "auto",
                             **({"analyze_every_min": analyze_every} if live else {})})
    except LaunchError as e:
        raise click.ClickException(str(e)) from e
    finally:
        if live is not None:
            live.stop()
            _say(live.summary())
    finish(out, result, analyze=not no_analyze)


class Refused(click.ClickException):
    """A setting or an --out that trainprof will not use: one line, exit 2, job not started."""
    exit_code = 2


def check_before_start(out: Path, force: bool, job_id: str | None = None,
                       profile_ranks: str | None = None,
                       budget_mb: str | None = None) -> tuple[dict, set]:
    """Validate every TRAINPROF_* setting and the run directory before the job starts.
    Returns (canonical settings for the job's environment, paths already in out: a
    trainprof.launch.outdir.Prepared, which also says whether this launcher joined another node's run
    of the same job). ``profile_ranks``: --profile-ranks, over TRAINPROF_PROFILE_RANKS."""
    import os

    environ = dict(os.environ)
    if profile_ranks is not None:
        environ["TRAINPROF_PROFILE_RANKS"] = profile_ranks
    if budget_mb is not None:
        environ["TRAINPROF_BUDGET_MB"] = str(budget_mb)
    try:
        settings = validated_env(environ)
    except SettingsError as e:
        problems = [p.replace("TRAINPROF_PROFILE_RANKS=", "--profile-ranks ")
                    if profile_ranks is not None else p for p in e.problems]
        problems = [p.replace("TRAINPROF_BUDGET_MB=", "--budget-mb ")
                    if budget_mb is not None else p for p in problems]
        raise Refused("; ".join(problems)) from e
    try:
        before = prepare_run_dir(out, force, job_id=job_id)
    except OutDirError as e:
        raise Refused(str(e)) from e
    return settings, before


def finish(out: Path, result: JobResult, analyze: bool) -> None:
    """Analyze (never changing the job's outcome), then exit exactly as the job did. What
    trainprof could not do is one line; no traceback."""
    code, sig = result.code, result.sig
    how = f"killed by signal {sig}" if sig else f"exit code {code}"
    if code == HANG_EXIT_CODE and not sig and _hung(out):
        how = f"terminated as hung, exit code {code}"
    _say(f"job finished ({how}); run directory: {out}")
    try:  # trainprof's own reporting: whatever fails here, the job's exit status stands
        for f in result.first_failures[:4]:
            _say(f"first failure: rank {f.get('rank')} (pid {f.get('pid')} on {f.get('host')}) "
                 f"{describe_exit(f)}")
    except Exception as e:  # noqa: BLE001
        _say(f"could not report the first failure: {type(e).__name__}: {e}")
    notes = list(result.notes)
    if analyze and result.probes_ran:
        reduce_local_ranks(out, result, notes)
    try:
        if result.record is not None and result.probes_ran:
            result.record.finished()  # after its digests: the last node may analyze now
    except Exception as e:  # noqa: BLE001
        notes.append(f"could not finish the node record ({reason(e)})")
    if analyze and result.probes_ran and analyzes_here(out, result):
        try:
            from trainprof.cli._output import analyze_and_print  # lazy: start-up time of wrap

            analyze_and_print(out, err=True)  # stdout is the job's alone
        except KeyboardInterrupt:
            notes.append("analysis interrupted; run `trainprof analyze` later")
        except SystemExit:  # rich exits this way when stderr is a closed pipe
            notes.append("could not print the analysis (stderr closed)")
        except Exception as e:  # noqa: BLE001 - the job's exit status matters more than our report
            notes.append(f"could not analyze the run ({reason(e)}); the captured data in {out} "
                         f"is kept for `trainprof analyze`")
    if notes:
        status = f"death by signal {sig}" if sig else f"exit code {code}"
        _say("; ".join(notes) + f" — the job's {status} is passed on unchanged")
    exit_like(code, sig)


def reduce_local_ranks(out: Path, result: JobResult, notes: list[str]) -> None:
    """Reduce this node's ranks' traces to their digests, in parallel, where the data is
    (trainprof/analysis/digest.py; skipped in a build without it)."""
    if not result.local_ranks:
        return
    try:
        from trainprof.analysis import digest  # lazy: start-up time of wrap
    except ImportError:
        return
    try:
        digest.build(out, ranks=list(result.local_ranks), isolate=True)  # never in this process
    except KeyboardInterrupt:
        notes.append("digest reduction interrupted")
    except Exception as e:  # noqa: BLE001 - analysis rebuilds missing digests
        notes.append(f"could not reduce this node's traces to digests ({reason(e)})")


def analyzes_here(out: Path, result: JobResult) -> bool:
    """Of the nodes sharing one run directory, only the last to finish analyzes (its claim,
    nodes/.analysis-claim, is created with O_EXCL: one winner when several finish together).
    The other nodes' launchers that have not finished are watched (trainprof/rundir/nodes.py watch):
    one still running analyzes when it finishes; when all of them are gone (killed: a launcher
    of this host whose process is gone, one of another host whose record stopped changing),
    this node is the last survivor and analyzes, naming them. A node that the analyzing node
    took for gone, and that finishes after all, analyzes again with its own data."""
    rec = result.record
    if rec is None:
        return True
    cmd = f"trainprof analyze {out}"
    try:
        waiting = nodes.pending(out, rec.node)
        if waiting is None:  # our record could not be written: analyze, as a single node does
            return True
        gone = []
        if waiting:
            seen = nodes.watch(out, waiting, until_any_alive=True)
            alive = [v for v in seen.values() if v["state"] == "alive"]
            if alive:
                names = ", ".join(nodes.describe(v) for v in alive[:4]) + \
                    (f" and {len(alive) - 4} more" if len(alive) > 4 else "")
                _say(f"{len(alive)} other node(s) of this job still running ({names}): the last "
                     f"node to finish analyzes {out}; should none do so (killed), run `{cmd}`")
                return False
            gone = [v for v in seen.values() if v["state"] == "dead"]
        if not nodes.claim_analysis(out, rec.node, presumed_dead=[v["node"] for v in gone]):
            claim = nodes.read_claim(out)
            if claim is not None and rec.node in claim.get("presumed_dead", []):
                _say(f"node {claim.get('node')} analyzed {out} taking this node for gone; "
                     f"analyzing again with this node's data")
                return True
            _say(f"another node of this job analyzes {out}")
            return False
        if gone:
            names = ", ".join(nodes.describe(v) for v in gone[:4]) + \
                (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
            _say(f"the launcher of {names} is gone (its record still says running, unchanged "
                 f"for {max(v['seen_s'] for v in gone):.0f} s: killed?); this node is the last "
                 f"one left and analyzes {out} without waiting for it (its ranks' data may be "
                 f"incomplete)")
    except KeyboardInterrupt:  # while watching the other nodes: the job's exit status stands
        _say(f"interrupted while waiting for the other nodes; run `{cmd}` later")
        return False
    except Exception as e:  # noqa: BLE001 - another node's damaged record: never the exit status
        _say(f"could not decide which node analyzes ({reason(e)}); analyzing here")
    return True


def _say(msg: str) -> None:
    try:
        click.echo(f"trainprof: {msg}", err=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not change the exit status
        pass


def describe_exit(row: dict) -> str:
    return how(row)


def _hung(out: Path) -> bool:
    try:
        return read_json(out / MANIFEST).get("status") == "hung"
    except (RunDirError, AttributeError):
        return False
