"""`trainprof compare BASELINE... -- CANDIDATE...`: a CI gate that fails on real regressions, not noise."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

from trainprof.cli._output import InputError

EXIT_PASS, EXIT_REGRESSION, EXIT_INPUT, EXIT_INCONCLUSIVE = 0, 1, 2, 3
SPLIT = "\0--"  # stands for the "--" between baseline and candidate runs (see CompareCommand)
HISTORY_GLOB = "baseline-*.json"  # the only files --baseline-dir reads, and ever deletes
DEFAULT_KEEP = 10


class CompareCommand(click.Command):
    """Keeps the first `--` as a positional marker: click would drop it, and options may still
    follow the candidate runs."""

    def parse_args(self, ctx, args):
        args = list(args)
        if "--" in args:
            args[args.index("--")] = SPLIT
        return super().parse_args(ctx, args)


def known_versions() -> range:
    from trainprof.findings import SUMMARY_SCHEMA_VERSION  # lazy: start-up time of trainprof --help

    return range(1, SUMMARY_SCHEMA_VERSION + 1)


def load_summary(path: Path, role: str) -> tuple[dict, Path]:
    """A summary from a summary.json file or a run directory (analyzed in memory when it has no
    summary.json yet: nothing is written into it). Anything that cannot be trusted -> InputError
    naming the file."""
    from trainprof.rundir.files import MANIFEST, SUMMARY  # lazy: start-up time of trainprof --help

    if not path.exists():
        raise InputError(f"{role} {path}: no such file or directory")
    if path.is_dir():
        if (path / SUMMARY).is_file():
            path = path / SUMMARY
        elif (path / MANIFEST).is_file():
            from trainprof.analysis.runner import analyze  # lazy: start-up time of trainprof --help
            from trainprof.analysis.run import RunDir  # lazy: start-up time of trainprof --help

            click.echo(f"{role}: {path} has no {SUMMARY}; analyzing it", err=True)
            try:
                summary = analyze(RunDir(path))
            except Exception as e:  # a run directory this trainprof cannot read is an input error
                raise InputError(f"{role} {path}: cannot analyze this run directory "
                                 f"({type(e).__name__}: {_one_line(e)})") from e
            return _check(summary, path, role), path
        else:
            raise InputError(f"{role} {path}: not a run directory or summary.json "
                             f"(no {SUMMARY} or {MANIFEST})")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(f"{role} {path}: not a text file ({e})") from e
    except json.JSONDecodeError as e:
        raise InputError(f"{role} {path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from e
    except OSError as e:
        raise InputError(f"{role} {path}: cannot read ({e.strerror or e})") from e
    except Exception as e:
        raise InputError(f"{role} {path}: cannot read ({type(e).__name__}: {_one_line(e)})") from e
    return _check(summary, path, role), path


def _check(summary, path, role) -> dict:
    """The shape compare relies on: an object with a known schema_version, `run` and `metrics`
    objects, and the metrics it reads of the right types."""
    # lazy: start-up time of trainprof --help
    from trainprof.gate.metrics import BUILTIN, SAMPLES, malformed, peak_memory, step_samples

    if not isinstance(summary, dict):
        raise InputError(f"{role} {path}: not a trainprof summary.json (top level is "
                         f"{type(summary).__name__}, expected an object)")
    missing = [k for k in ("run", "metrics") if not isinstance(summary.get(k), dict)]
    if missing:
        raise InputError(f"{role} {path}: not a trainprof summary.json (no {' or '.join(repr(k) for k in missing)} object)")
    version, known = summary.get("schema_version"), known_versions()
    if isinstance(version, int) and not isinstance(version, bool) and version > known[-1]:
        raise InputError(f"{role} {path}: summary schema_version {version} is newer than this "
                         f"trainprof understands ({known[-1]}); upgrade trainprof")
    if not (isinstance(version, int) and not isinstance(version, bool) and version in known):
        raise InputError(f"{role} {path}: summary schema_version {version!r} is not one this "
                         f"trainprof knows ({', '.join(map(str, known))})")
    errors = malformed(summary)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InputError(f"{role} {path}: malformed summary.json: {errors[0]}{more}")
    try:  # the readers are defensive about absent keys; a wrong type is a damaged file
        step_samples(summary)
        for name in BUILTIN:
            if name in SAMPLES:
                SAMPLES[name](summary)
        peak_memory(summary)
    except Exception as e:
        raise InputError(f"{role} {path}: malformed summary.json ({type(e).__name__}: {_one_line(e)})") from e
    return summary


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def is_run(path: Path) -> bool:
    from trainprof.rundir.files import MANIFEST, SUMMARY  # lazy: start-up time of trainprof --help

    return path.is_file() or (path / SUMMARY).is_file() or (path / MANIFEST).is_file()


def expand(paths) -> list[Path]:
    """Run directories and summary files; a directory that is neither but holds runs stands for
    all of them (sorted by name)."""
    out = []
    for p in paths:
        if p.is_dir() and not is_run(p):
            runs = sorted(c for c in p.iterdir() if c.is_dir() and is_run(c))
            if runs:
                out.extend(runs)
                continue
        out.append(p)
    return out


# --- baseline history (--baseline-dir) ----------------------------------------------------------

def history_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(HISTORY_GLOB)) if directory.is_dir() else []


def save_history(directory: Path, summaries: list[tuple[dict, Path]], keep: int) -> tuple[list[Path], list[Path]]:
    """Store each summary as DIR/baseline-<UTC time>-<i>.json, then keep only the newest `keep`
    such files. Only files matching baseline-*.json are ever deleted."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        saved = []
        for i, (summary, _) in enumerate(summaries):
            target = directory / f"baseline-{stamp}-{i:02d}.json"
            tmp = target.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(summary), encoding="utf-8")
            tmp.replace(target)
            saved.append(target)
        files = history_files(directory)
        dropped = files[:max(0, len(files) - keep)]
        for f in dropped:
            f.unlink()
        return saved, dropped
    except OSError as e:
        raise InputError(f"baseline history {directory}: cannot write ({e.strerror or e})") from e


# --- settings -----------------------------------------------------------------------------------

CONFIG_KEYS = {"alpha", "min_effect", "fail_on", "metrics", "allow_mismatch", "allow_different"}


def load_config(path: Path) -> dict:
    """TOML: alpha, min_effect, metrics = [...], allow_mismatch, [fail_on] name = "+5%" — at the
    top level or under [compare] / [tool.trainprof.compare]."""
    import tomllib

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"config {path}: cannot read ({e.strerror or e})") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"config {path}: not valid TOML ({e})") from e
    for key in ("tool", "trainprof"):
        if isinstance(data.get(key), dict) and set(data) == {key}:
            data = data[key]
    if isinstance(data.get("compare"), dict):
        data = data["compare"]
    unknown = set(data) - CONFIG_KEYS
    if unknown:
        raise InputError(f"config {path}: unknown key(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted(CONFIG_KEYS))})")
    if "fail_on" in data and not isinstance(data["fail_on"], dict):
        raise InputError(f"config {path}: fail_on must be a table of metric = \"threshold\"")
    if "metrics" in data and not (isinstance(data["metrics"], list)
                                  and all(isinstance(m, str) for m in data["metrics"])):
        raise InputError(f"config {path}: metrics must be a list of dotted names")
    return data


def _percent(text, what) -> float:
    s = str(text).strip()
    try:
        return float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise click.BadParameter(f"{what}: expected a number or a percentage, got {text!r}") from None


def _split(spec: str, option: str) -> tuple[str, str | None]:
    from trainprof.gate.metrics import canonical  # lazy: start-up time of trainprof --help

    name, sep, th = spec.rpartition(":")
    if not sep:
        return canonical(spec.strip()), None
    if not name.strip():
        raise click.BadParameter(f"{option} {spec!r}: expected NAME:THRESHOLD, e.g. step_time:+5%")
    return canonical(name.strip()), th.strip()


def build_settings(alpha, min_effect, fail_on, metric, config):
    from trainprof.gate.metrics import BUILTIN, canonical  # lazy: start-up time of trainprof --help
    from trainprof.gate.regression import (DEFAULT_ALPHA, DEFAULT_MIN_EFFECT,
                                           Settings)  # lazy: start-up time of trainprof --help
    from trainprof.gate.threshold import ThresholdError, parse_threshold  # lazy: start-up time of trainprof --help

    cfg = load_config(config) if config else {}
    thresholds = {canonical(k): str(v) for k, v in (cfg.get("fail_on") or {}).items()}
    extra = list(cfg.get("metrics") or [])
    for spec in metric:
        name, th = _split(spec, "--metric")
        extra.append(name)
        if th:
            thresholds[name] = th
    for spec in fail_on:
        name, th = _split(spec, "--fail-on")
        if th is None:
            raise click.BadParameter(f"{spec!r}: expected NAME:THRESHOLD, e.g. step_time:+5%",
                                     param_hint="--fail-on")
        thresholds[name] = th
    for name, th in thresholds.items():
        try:
            parse_threshold(th, +1)
        except ThresholdError as e:
            raise click.BadParameter(f"{name}: {e}", param_hint="--fail-on / config") from None
    a = alpha if alpha is not None else _percent(cfg.get("alpha", DEFAULT_ALPHA), "alpha")
    me = _percent(min_effect, "--min-effect") if min_effect is not None else \
        _percent(cfg.get("min_effect", DEFAULT_MIN_EFFECT), "min_effect")
    if not 0 < a < 1:
        raise click.BadParameter(f"alpha must be in (0, 1), got {a}", param_hint="--alpha")
    if me < 0:
        raise click.BadParameter(f"min effect must be ≥ 0, got {me}", param_hint="--min-effect")
    return Settings(alpha=a, min_effect=me, thresholds=thresholds,
                    extra=[e for e in dict.fromkeys(extra) if e not in BUILTIN]), cfg


# --- the comparison -----------------------------------------------------------------------------

def _who(role, path, bases, cands) -> str:
    return "candidate" if role == "candidate" and len(cands) == 1 and len(bases) == 1 else f"{role} {path}"


def environment_mismatches(bases, cands) -> list[str]:
    """Every run against the first baseline run: device, world size, mesh, torch version."""
    from trainprof.gate.facts import fingerprint, same_fact  # lazy: start-up time of trainprof --help

    ref = fingerprint(bases[0][0])
    out = []
    for role, runs in (("baseline", bases[1:]), ("candidate", cands)):
        for s, path in runs:
            fp = fingerprint(s)
            for k in ref:
                if not same_fact(k, ref[k], fp[k]):
                    out.append(f"{k}: baseline {ref[k]!r}, {_who(role, path, bases, cands)} {fp[k]!r}")
    return out


def job_mismatches(bases, cands) -> list[str]:
    """Every run against the first baseline run: the job it ran (script, framework, model and
    batch facts the probes recorded; facts.JOB_FACTS)."""
    from trainprof.gate.facts import job_differences  # lazy: start-up time of trainprof --help

    out = []
    for role, runs in (("baseline", bases[1:]), ("candidate", cands)):
        for s, path in runs:
            for k, a, b in job_differences(bases[0][0], s):
                out.append(f"{k}: baseline {a!r}, {_who(role, path, bases, cands)} {b!r}")
    return out


def _side(runs, label=None) -> dict:
    from trainprof.gate.facts import fingerprint  # lazy: start-up time of trainprof --help
    from trainprof.gate.metrics import side_info  # lazy: start-up time of trainprof --help

    info = side_info([s for s, _ in runs])
    return {"path": label or str(runs[0][1]), "paths": [str(p) for _, p in runs],
            "fingerprint": fingerprint(runs[0][0]), **info}


def comparison_result(bases, cands, settings, allow_mismatch=False, mismatches=(),
                      base_label=None, notes=(), job_diffs=()) -> dict:
    """Everything the outputs render (and --json prints). `bases`/`cands`: [(summary, path)]."""
    from trainprof.gate.regression import compare_runs  # lazy: start-up time of trainprof --help
    from trainprof.gate.verdict import overall_verdict  # lazy: start-up time of trainprof --help

    results, absent = compare_runs([s for s, _ in bases], [s for s, _ in cands], settings)
    code, verdict = overall_verdict(results)
    notes = list(notes)
    for role, runs in (("baseline", bases), ("candidate", cands)):
        for s, path in runs:
            ec = (s.get("run") or {}).get("exit_code")
            if ec not in (0, None):
                notes.append(f"the {role} job {path} exited with code {ec}")
    if mismatches:
        notes.append("environments differ (allowed): " + "; ".join(mismatches))
    if job_diffs:
        notes.append("the runs are of different jobs (allowed): " + "; ".join(job_diffs))
    return {
        "verdict": verdict, "exit_code": code,
        "baseline": _side(bases, base_label), "candidate": _side(cands),
        "mismatches": list(mismatches), "job_differences": list(job_diffs), "absent": absent,
        "notes": notes,
        "underpowered": _underpowered(results),
        "settings": {"alpha": settings.alpha, "min_effect": settings.min_effect,
                     "thresholds": settings.thresholds, "metrics": settings.extra,
                     "allow_mismatch": allow_mismatch, "multiple_comparisons": "benjamini-hochberg"},
        "metrics": [r.to_dict() for r in results],
        "op_diff": _op_diff(bases, cands),
    }


def _underpowered(results) -> list[str]:
    """Gated metrics that moved beyond their threshold the bad way without significance; the
    throughput and MFU of the same steps are one hypothesis with step time (named once)."""
    from trainprof.gate.verdict import SAME_TEST  # lazy: start-up time of trainprof --help

    weak = [r.metric for r in results if r.gate and r.underpowered]
    return [m for m in weak if SAME_TEST.get(m) not in weak]


def _op_diff(bases, cands) -> dict:
    """Which ops moved (trainprof/gate/opdiff.py): informational, never part of the verdict."""
    try:
        from trainprof.gate.opdiff import op_diff  # lazy: start-up time of trainprof --help

        return op_diff(bases, cands)
    except Exception as e:  # noqa: BLE001 - the gate's answer must not depend on it
        return {"available": False, "reason": f"op diff failed ({type(e).__name__}: {_one_line(e)})"}


def _write(path: Path, text: str, what: str):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"{what} {path}: cannot write ({e.strerror or e})") from e


def split_runs(args: tuple[str, ...], baseline_dir) -> tuple[list[Path], list[Path]]:
    marker = [i for i, p in enumerate(args) if p == SPLIT]
    runs = [Path(p) for p in args]
    if baseline_dir is not None:
        if marker:
            raise click.UsageError("with --baseline-dir, give only the candidate run(s) (no --)")
        if not runs:
            raise click.UsageError("give the candidate run(s) to compare with --baseline-dir")
        return [], list(runs)
    if marker:
        i = marker[0]
        base, cand = list(runs[:i]), list(runs[i + 1:])
        if not base or not cand:
            raise click.UsageError("expected BASELINE... -- CANDIDATE... with runs on both sides")
        return base, cand
    if len(runs) != 2:
        raise click.UsageError("expected BASELINE CANDIDATE, or BASELINE... -- CANDIDATE... for "
                               "several runs per side" if len(runs) > 2 else
                               "expected BASELINE CANDIDATE (or --baseline-dir DIR CANDIDATE)")
    return [runs[0]], [runs[1]]


def load_history(directory: Path, keep: int, cands, allow_mismatch: bool,
                 allow_different: bool = False) -> tuple[list, list[str]]:
    """The newest `keep` baselines of the history that can be used, and notes on the others."""
    # lazy: start-up time of trainprof --help
    from trainprof.gate.facts import fingerprint, fingerprint_mismatches, job_differences
    from trainprof.gate.metrics import run_problems  # lazy: start-up time of trainprof --help

    files = history_files(directory)[-keep:]
    runs, notes, other_env, other_job = [], [], [], []
    ref = fingerprint(cands[0][0])
    for f in files:
        s, p = load_summary(f, "baseline")
        problems = run_problems(s)
        if problems:
            notes.append(f"baseline history: {f.name} left out ({'; '.join(problems)})")
        elif fingerprint_mismatches(s, cands[0][0]) and not allow_mismatch:
            other_env.append(f.name)
        elif job_differences(s, cands[0][0]) and not allow_different:
            other_job.append(f.name)
        else:
            runs.append((s, p))
    if other_env:
        notes.append(f"baseline history: {len(other_env)} run(s) from another environment left out "
                     f"({', '.join(other_env)})")
    if other_job:
        notes.append(f"baseline history: {len(other_job)} run(s) of another job left out "
                     f"({', '.join(other_job)})")
    if (other_env or other_job) and not runs:
        if other_env:
            raise InputError(f"baseline history {directory}: no run from the candidate's environment "
                             f"({', '.join(f'{k}={v!r}' for k, v in ref.items())}); use --allow-mismatch "
                             f"to compare anyway")
        raise InputError(f"baseline history {directory}: no run of the candidate's job (script, "
                         f"framework, model or batch differ); use --allow-different to compare anyway")
    return runs, notes


@click.command(cls=CompareCommand)
@click.argument("runs", nargs=-1)
@click.option("--baseline-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Baseline history: compare the candidate run(s) with the newest --keep summaries "
                   "stored in DIR (e.g. recent main-branch runs, cached between CI jobs).")
@click.option("--save-baseline", is_flag=True,
              help="With --baseline-dir: after comparing, store the candidate run(s) in DIR (the "
                   "main-branch job). An empty DIR just stores them and exits 0.")
@click.option("--keep", type=click.IntRange(min=1), default=DEFAULT_KEEP, show_default=True,
              help="Baseline summaries kept in --baseline-dir (older ones are deleted) and used.")
@click.option("--fail-on", multiple=True, metavar="METRIC:THRESHOLD",
              help="Gate METRIC when it moves the bad way by more than THRESHOLD, e.g. step_time:+5%, "
                   "peak_memory:+2%, mfu:-3%, bubble:+5pp, exposed_comm:+2pp, peak_memory:+512MiB, "
                   "metrics.x.y:+10%. Repeatable. A sign sets which direction is bad.")
@click.option("--metric", multiple=True, metavar="DOTTED.NAME[:THRESHOLD]",
              help="Also compare this value of summary.json (a number, or a list of per-step "
                   "samples), e.g. metrics.step_time.job.p90_ms:+10%. Without a threshold it is "
                   "shown, not gated. Repeatable.")
@click.option("--alpha", type=float, default=None, help="Significance level, after the "
              "Benjamini–Hochberg adjustment over the gated metrics [default: 0.01].")
@click.option("--min-effect", default=None, metavar="PCT",
              help="Smallest change that counts for step time, throughput, MFU and CPU time "
                   "[default: 5%].")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML file: alpha, min_effect, metrics = [...], [fail_on] metric = \"+5%\" "
                   "(flags win).")
@click.option("--allow-mismatch", is_flag=True, default=None,
              help="Compare even if device, world size, mesh or torch version differ.")
@click.option("--allow-different", is_flag=True, default=None,
              help="Compare even if the runs are of different jobs (script, framework, model or "
                   "batch facts differ).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write an asv-style markdown table (for $GITHUB_STEP_SUMMARY or a PR comment).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write JUnit XML: one test case per metric, a failure per regression.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON to stdout.")
def compare(runs, baseline_dir, save_baseline, keep, fail_on, metric, alpha, min_effect, config,
            allow_mismatch, allow_different, markdown_path, junit_path, as_json):
    """Compare candidate runs with baseline runs and fail on real performance regressions.

    \b
      trainprof compare BASELINE CANDIDATE
      trainprof compare BASE1 BASE2 BASE3 -- CAND1 CAND2 CAND3
      trainprof compare --baseline-dir perf-history CANDIDATE [--save-baseline]

    Each run is a run directory (its summary.json; analyzed in memory when it has none), a
    summary.json file, or a directory of run directories (all of them). Gated by default: step
    time, throughput and MFU per analysed step — a regression only when the change is
    significant (Mann–Whitney U over the steps with one run per side; a t-test over the per-run
    medians with several runs, so run-to-run noise counts) after the Benjamini–Hochberg
    adjustment over the gated metrics, AND beyond the minimum effect. Also gated: the busiest
    rank's CPU time per step (t-test over the runs; needs 3 runs or more, and only when every run
    recorded it), which a neighbour's load on a shared host barely moves. Pipeline bubble, exposed
    communication and peak memory are shown, and gated only with --fail-on.

    \b
    Exit codes: 0 pass, 1 regression, 2 usage or input error (unreadable or malformed input,
    an unknown schema_version, runs from different environments without --allow-mismatch,
    runs of different jobs without --allow-different),
    3 inconclusive (a run with fewer than 6 analysed steps or ranks missing, a gated metric
    missing from some run, one run per side that differ — a code change cannot be told from
    run-to-run noise —, an empty baseline history). A gated metric that moved beyond its
    threshold without significance is reported as "PASS (inconclusive)", exit 0.
    """
    import warnings

    import numpy as np

    try:  # values near the float range (denormals, 1e308) must not print numpy's warnings
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            _compare(runs, baseline_dir, save_baseline, keep, fail_on, metric, alpha, min_effect,
                     config, allow_mismatch, markdown_path, junit_path, as_json, allow_different)
    except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit, KeyboardInterrupt):
        raise
    except (OverflowError, FloatingPointError, ZeroDivisionError) as e:
        raise InputError(f"values out of the range compare can judge ({type(e).__name__}: "
                         f"{_one_line(e)}): a damaged or foreign summary.json?") from None
    except Exception as e:  # exit 1 means "regression" to CI: a crash must never look like one
        import traceback

        traceback.print_exc(file=sys.stderr)
        click.echo(f"Error: trainprof compare failed ({type(e).__name__}: {_one_line(e)})", err=True)
        sys.exit(EXIT_INPUT)


def _compare(runs, baseline_dir, save_baseline, keep, fail_on, metric, alpha, min_effect, config,
             allow_mismatch, markdown_path, junit_path, as_json, allow_different=None):
    from trainprof.gate.metrics import holds_no_rank_data, run_problems  # lazy: start-up time of trainprof --help
    from trainprof.gate.threshold import ThresholdError  # lazy: start-up time of trainprof --help
    from trainprof.reports import comparison as out  # lazy: start-up time of trainprof --help

    if save_baseline and baseline_dir is None:
        raise click.UsageError("--save-baseline needs --baseline-dir")
    settings, cfg = build_settings(alpha, min_effect, fail_on, metric, config)
    if allow_mismatch is None:
        allow_mismatch = bool(cfg.get("allow_mismatch", False))
    if allow_different is None:
        allow_different = bool(cfg.get("allow_different", False))
    base_paths, cand_paths = split_runs(runs, baseline_dir)
    bases = [load_summary(p, "baseline") for p in expand(base_paths)]
    cands = [load_summary(p, "candidate") for p in expand(cand_paths)]
    notes, keepable = [], []
    if baseline_dir is not None:
        bases, notes = load_history(baseline_dir, keep, cands, allow_mismatch, allow_different)
        if save_baseline:
            for s, p in cands:
                if run_problems(s) or (s.get("run") or {}).get("exit_code") not in (0, None):
                    notes.append(f"{p} not stored in the baseline history (too few steps, ranks "
                                 f"missing or a failed job)")
                else:
                    keepable.append((s, p))
        if not bases:
            stored = save_history(baseline_dir, keepable, keep)[0] if save_baseline else []
            for n in notes:
                click.echo(f"note: {n}", err=True)
            if save_baseline:
                click.echo(f"baseline history {baseline_dir}: empty; stored {len(stored)} run(s), "
                           f"nothing to compare yet")
                sys.exit(EXIT_PASS)
            click.echo(f"INCONCLUSIVE: no usable baseline run in {baseline_dir} (a cold cache? run "
                       f"the main-branch job with --save-baseline first) (exit 3)")
            sys.exit(EXIT_INCONCLUSIVE)
    empty = [f"{side} {p}" for side, runs in (("baseline", bases), ("candidate", cands))
             for sm, p in runs if holds_no_rank_data(sm)]
    if empty:  # said as such: its missing facts are no "different environment"
        raise InputError("run(s) holding no data from any rank (the job ran without probes, e.g. "
                         "TRAINPROF_DISABLE=1, or no rank started): " + ", ".join(map(str, empty)))
    job_diffs, mismatches = job_mismatches(bases, cands), environment_mismatches(bases, cands)
    refused = []
    if job_diffs and not allow_different:
        refused.append("runs of different jobs (use --allow-different to compare anyway):\n  "
                       + "\n  ".join(job_diffs))
    if mismatches and not allow_mismatch:
        refused.append("runs from different environments (use --allow-mismatch to compare "
                       "anyway):\n  " + "\n  ".join(mismatches))
    if refused:
        raise InputError("\n".join(refused))
    try:
        result = comparison_result(bases, cands, settings, allow_mismatch, mismatches,
                                   base_label=str(baseline_dir) if baseline_dir else None, notes=notes,
                                   job_diffs=job_diffs)
    except ThresholdError as e:
        raise InputError(str(e)) from e
    where = f"{len(base_paths) + len(cand_paths)} run(s)" if baseline_dir is None else "the runs"
    if result["absent"]:
        raise InputError(f"metric(s) in none of {where}: " + ", ".join(result["absent"]))
    if not result["metrics"]:
        raise InputError(f"nothing to compare: none of {where} has step-time or other comparable metrics")
    if baseline_dir is not None and save_baseline:
        saved, dropped = save_history(baseline_dir, keepable, keep)
        result["notes"].append(f"baseline history {baseline_dir}: stored {len(saved)} run(s)"
                               + (f", removed {len(dropped)} older" if dropped else ""))

    if markdown_path:
        _write(markdown_path, out.render_markdown(result), "markdown")
    if junit_path:
        _write(junit_path, out.render_junit(result), "junit")
    if as_json:
        click.echo(out.render_json(result))
    else:
        from rich.console import Console

        console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
        for note in result["notes"]:
            console.print(f"note: {note}", markup=False)
        out.render_terminal(result, console=console)
    sys.exit(result["exit_code"])
