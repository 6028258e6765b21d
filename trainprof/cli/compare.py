"""`trainprof compare BASELINE CANDIDATE`: a CI gate that fails on real regressions, not noise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

EXIT_PASS, EXIT_REGRESSION, EXIT_INPUT, EXIT_INCONCLUSIVE = 0, 1, 2, 3


class InputError(click.ClickException):
    exit_code = EXIT_INPUT


def load_summary(path: Path, role: str) -> tuple[dict, Path]:
    """A summary from a summary.json file or a run directory (analyzed in memory when it has no
    summary.json yet: nothing is written into it)."""
    from trainprof.findings import SUMMARY_SCHEMA_VERSION
    from trainprof.rundir import SUMMARY

    if not path.exists():
        raise InputError(f"{role} {path}: no such file or directory")
    if path.is_dir():
        if (path / SUMMARY).is_file():
            path = path / SUMMARY
        else:
            from trainprof.analysis import analyze
            from trainprof.rundir import RunDir, RunDirError

            click.echo(f"{role}: {path} has no {SUMMARY}; analyzing it", err=True)
            try:
                return _check(analyze(RunDir(path)), path, role, SUMMARY_SCHEMA_VERSION), path
            except RunDirError as e:
                raise InputError(f"{role} {path}: not a run directory or summary.json ({e})") from e
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(f"{role} {path}: not a text file ({e})") from e
    except json.JSONDecodeError as e:
        raise InputError(f"{role} {path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from e
    except OSError as e:
        raise InputError(f"{role} {path}: cannot read ({e.strerror or e})") from e
    return _check(summary, path, role, SUMMARY_SCHEMA_VERSION), path


def _check(summary, path, role, supported) -> dict:
    if not isinstance(summary, dict):
        raise InputError(f"{role} {path}: not a trainprof summary.json (top level is "
                         f"{type(summary).__name__}, expected an object)")
    missing = [k for k in ("run", "metrics") if not isinstance(summary.get(k), dict)]
    if missing:
        raise InputError(f"{role} {path}: not a trainprof summary.json (no {' or '.join(repr(k) for k in missing)} object)")
    version = summary.get("schema_version")
    if isinstance(version, int) and version > supported:
        raise InputError(f"{role} {path}: summary schema_version {version} is newer than this "
                         f"trainprof understands ({supported}); upgrade trainprof")
    return summary


CONFIG_KEYS = {"alpha", "min_effect", "fail_on", "metrics", "allow_mismatch"}


def load_config(path: Path) -> dict:
    """TOML: alpha, min_effect, metrics = [...], allow_mismatch, [fail_on] name = "+5%" — at the
    top level or under [compare] / [tool.trainprof.compare]."""
    import tomllib

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"config {path}: cannot read ({e.strerror or e})") from e
    except tomllib.TOMLDecodeError as e:
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
    from trainprof.regression import canonical

    name, sep, th = spec.rpartition(":")
    if not sep:
        return canonical(spec.strip()), None
    if not name.strip():
        raise click.BadParameter(f"{option} {spec!r}: expected NAME:THRESHOLD, e.g. step_time:+5%")
    return canonical(name.strip()), th.strip()


def build_settings(alpha, min_effect, fail_on, metric, config):
    from trainprof.regression import (BUILTIN, DEFAULT_ALPHA, DEFAULT_MIN_EFFECT, Settings,
                                      ThresholdError, canonical, parse_threshold)

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


def comparison_result(base, base_path, cand, cand_path, settings, allow_mismatch=False) -> dict:
    """Everything the outputs render (and --json prints)."""
    from trainprof.regression import (compare_summaries, fingerprint, fingerprint_mismatches,
                                      overall_verdict)

    mismatches = fingerprint_mismatches(base, cand)
    results, absent = compare_summaries(base, cand, settings)
    code, verdict = overall_verdict(results)
    notes = []
    for role, s in (("baseline", base), ("candidate", cand)):
        ec = (s.get("run") or {}).get("exit_code")
        if ec not in (0, None):
            notes.append(f"the {role} job exited with code {ec}")
    if mismatches:
        notes.append("environments differ (allowed): " + "; ".join(mismatches))
    return {
        "verdict": verdict, "exit_code": code,
        "baseline": {"path": str(base_path), "fingerprint": fingerprint(base)},
        "candidate": {"path": str(cand_path), "fingerprint": fingerprint(cand)},
        "mismatches": mismatches, "absent": absent, "notes": notes,
        "settings": {"alpha": settings.alpha, "min_effect": settings.min_effect,
                     "thresholds": settings.thresholds, "metrics": settings.extra,
                     "allow_mismatch": allow_mismatch},
        "metrics": [r.to_dict() for r in results],
    }


def _write(path: Path, text: str, what: str):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"{what} {path}: cannot write ({e.strerror or e})") from e


@click.command()
@click.argument("baseline", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@click.option("--fail-on", multiple=True, metavar="METRIC:THRESHOLD",
              help="Fail when METRIC moves the bad way by more than THRESHOLD, e.g. step_time:+5%, "
                   "peak_memory:+2%, mfu:-3%, exposed_comm:+2pp, peak_memory:+512MiB, "
                   "metrics.x.y:+10%. Repeatable. A sign sets which direction is bad.")
@click.option("--metric", multiple=True, metavar="DOTTED.NAME[:THRESHOLD]",
              help="Also compare this value of summary.json (a number, or a list of per-step "
                   "samples), e.g. metrics.step_time.job.p90_ms:+10%. Without a threshold it is "
                   "shown, not gated. Repeatable.")
@click.option("--alpha", type=float, default=None, help="Significance level of the Mann–Whitney U "
              "test for sampled metrics [default: 0.01].")
@click.option("--min-effect", default=None, metavar="PCT",
              help="Smallest change of the median that counts for sampled metrics [default: 5%].")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML file: alpha, min_effect, metrics = [...], [fail_on] metric = \"+5%\" "
                   "(flags win).")
@click.option("--allow-mismatch", is_flag=True, default=None,
              help="Compare even if device, world size, mesh or torch version differ.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write an asv-style markdown table (for $GITHUB_STEP_SUMMARY or a PR comment).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write JUnit XML: one test case per metric, a failure per regression.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON to stdout.")
def compare(baseline, candidate, fail_on, metric, alpha, min_effect, config, allow_mismatch,
            markdown_path, junit_path, as_json):
    """Compare CANDIDATE with BASELINE and fail on real performance regressions.

    Each of BASELINE and CANDIDATE is a run directory (its summary.json; analyzed first when it
    has none) or a summary.json file. Compared: step time and throughput (per-step samples:
    regression only when significant — Mann–Whitney U, p < alpha — AND the median moved by more
    than the minimum effect; a bootstrap CI of the median ratio is shown), MFU, exposed
    communication fraction, pipeline bubble fraction, peak memory per rank (thresholds), and any
    metric named with --metric / --fail-on.

    \b
    Exit codes: 0 pass, 1 regression, 2 usage or input error (including runs from different
    environments without --allow-mismatch), 3 inconclusive (fewer than 6 samples per side, or a
    gated metric missing on one side).
    """
    from trainprof.reports import comparison as out

    settings, cfg = build_settings(alpha, min_effect, fail_on, metric, config)
    if allow_mismatch is None:
        allow_mismatch = bool(cfg.get("allow_mismatch", False))
    base, base_path = load_summary(baseline, "baseline")
    cand, cand_path = load_summary(candidate, "candidate")

    from trainprof.regression import ThresholdError, fingerprint_mismatches

    mismatches = fingerprint_mismatches(base, cand)
    if mismatches and not allow_mismatch:
        raise InputError("runs from different environments (use --allow-mismatch to compare "
                         "anyway):\n  " + "\n  ".join(mismatches))
    try:
        result = comparison_result(base, base_path, cand, cand_path, settings, allow_mismatch)
    except ThresholdError as e:
        raise InputError(str(e)) from e
    if result["absent"]:
        raise InputError(f"metric(s) in neither {base_path} nor {cand_path}: "
                         + ", ".join(result["absent"]))
    if not result["metrics"]:
        raise InputError(f"nothing to compare: neither {base_path} nor {cand_path} has step-time "
                         "or other comparable metrics")

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
