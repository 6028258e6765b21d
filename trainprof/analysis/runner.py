"""Run every analyzer over a run directory and assemble summary.json."""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import Callable

from trainprof import __version__
from trainprof.rundir import health as stream_health
from trainprof.findings import SUMMARY_SCHEMA_VERSION
from trainprof.meshinfo import group_sizes, mesh_sizes
from trainprof.analysis.run import RunDir
from trainprof.rankranges import ranges
from trainprof.analyzers import load_all
from trainprof.analyzers.critical_path import replay_findings
from trainprof.analysis.summary_bound import bound_findings, bound_metrics, bounded, named_ranks
from trainprof.analyzers.advice import actions as ranked, advise
from trainprof.analyzers._onset import stamp_findings
from trainprof.settings import flag_on
from trainprof.rundir.files import REPORT, RunDirError, SUMMARY, write_json_atomic
from trainprof.analysis import outputs

SEVERITY_ORDER = {"critical": 0, "error": 1, "warning": 2, "info": 3}
SNAPSHOT_ANALYZERS = ("memory", "fragmentation")


def run_info(run: RunDir) -> dict:
    launcher = run.launcher
    mesh = run.mesh
    sizes = mesh_sizes(mesh) if mesh else _group_sizes(run)
    ranks = []
    for r in run.ranks:
        meta = run.rank_meta(r)
        ranks.append({
            "rank": r,
            "host": meta.get("host"),
            "local_rank": meta.get("local_rank"),
            "device": meta.get("device_name") or meta.get("device"),
            "coords": run.coords(r),
        })
    first = run.rank_meta(run.ranks[0]) if run.ranks else {}
    off: dict[str, list[int]] = {}
    for r in run.ranks:
        for name in run.rank_meta(r).get("probes_off") or ():
            off.setdefault(str(name), []).append(r)
    return {
        # bare traces: the folder they were found in, absolute ("." says nothing in a header)
        "dir": os.path.abspath(run.path) if run.trace_inputs else str(run.path),
        **({"dirs": [str(d) for d in run.roots]} if len(getattr(run, "roots", ())) > 1 else {}),
        "command": launcher.get("command"),
        "start_time": launcher.get("start_time"),
        "end_time": launcher.get("end_time"),
        "exit_code": launcher.get("exit_code"),
        "signal": launcher.get("signal"),
        "world_size": run.world_size,
        # the files' world size where it is larger than the one analysed (a few ranks profiled
        # of a large job: trusted only so far, as a loop bound; trainprof/analysis/ranks.py)
        **({"declared_world_size": d} if (p := run.partial()) and (d := p["world_size"]) > run.world_size
           else {}),
        "mesh": sizes,  # dp/pp/tp sizes plus other dims by name (trainprof/meshinfo.py)
        "mesh_dims": mesh,
        "device": first.get("device_name") or first.get("device"),
        "backend": first.get("backend"),
        "torch_version": first.get("torch_version"),
        "run_info": first.get("run_info", {}),
        "ranks": ranks,
        **({"probes_off": off} if off else {}),
        # --profile-ranks: which ranks recorded the profiler window (the others on purpose)
        **({"profiled": prof} if (prof := run.profiled()) else {}),
        # bounded capture: which steps are kept at which resolution (docs/run-directory.md)
        **({"resolution": res} if not run.trace_inputs and (res := run.resolution()) else {}),
        # the launchers of a multi-node job (RUN/nodes/*.json, or several run directories)
        **({"nodes": _nodes(launcher["nodes"])} if launcher.get("nodes") else {}),
        # ranks of the job without files: job-level figures are partial (or withheld)
        **({"partial": partial} if (partial := run.partial()) else {}),
        **({"snapshots": [str(p) for p in run.bare_snapshots]} if run.snapshot_only else {}),
        # bare profiler traces: what was found and read, and the facts only the traces carry
        **({"input": dict(run.input_facts), **run.trace_run_facts()} if run.trace_inputs else {}),
    }


def live_state(run: RunDir) -> dict:
    """run.state ("running", "ended", "stopped": trainprof/rundir/state.py) and the last step seen,
    for a run directory (a run in progress is analyzed as a snapshot)."""
    if run.trace_inputs or run.snapshot_only:
        return {}
    try:
        from trainprof.rundir.state import state  # lazy: start-up time of analyze

        st = state(run.path, run.launcher)
    except Exception as e:  # noqa: BLE001 - the state is a note, never a reason to fail
        run.problems.append(f"run state unknown: {type(e).__name__}: {e}")
        return {}
    return {"state": st["state"], "last_step": st["last_step"],
            "live": {k: st[k] for k in ("why", "last_progress", "heartbeat_age_s")}}


def _group_sizes(run: RunDir) -> dict:
    """Without a DeviceMesh: the layout the probes' process-group labels give (plain DDP)."""
    try:
        return group_sizes(run.stream(run.ranks[0], "groups"), run.world_size) if run.ranks else {}
    except Exception:  # noqa: BLE001 - the group records are optional
        return {}


def _nodes(records: list[dict]) -> list[dict]:
    return [{"node": n.get("node"), "host": n.get("host"), "status": n.get("status"),
             "exit_code": n.get("exit_code"), "signal_name": n.get("signal_name"),
             "ranks": ranges(n.get("ranks") or []), "file": n.get("file")} for n in records]


def analyze(run: RunDir, progress: Callable[[str], None] | None = None) -> dict:
    modules, errors = load_all()
    if run.snapshot_only:  # bare allocator snapshots: only the memory analyzers have input
        modules = [m for m in modules if m.NAME in SNAPSHOT_ANALYZERS]
    metrics: dict = {}
    findings: list[dict] = []
    timings: dict = {}
    for mod in modules:
        if progress:
            progress(mod.NAME)
        t0 = time.perf_counter()
        try:
            result = mod.analyze(run)
        except Exception as e:  # noqa: BLE001 - one analyzer's bug must not lose the others' work
            import traceback

            errors.append({"analyzer": mod.NAME, "error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc(limit=8)})
            continue
        finally:
            timings[mod.NAME] = round(time.perf_counter() - t0, 4)
        if result.metrics:
            metrics[mod.NAME] = result.metrics
        _stamp_onsets(run, result.findings)
        for f in result.findings:
            f.analyzer = f.analyzer or mod.NAME
            findings.append(f.to_dict())
    findings = withhold_window(metrics, findings)
    actions = _advise(metrics, findings, errors)
    _replay_estimates(run, metrics, findings, errors)

    # per-step series past a few thousand steps thinned, rank x step tables of many ranks
    # bounded to the ranks that matter: said so in each analyzer's metrics
    long_run = bound_metrics(metrics, named=named_ranks(findings))
    bound_findings(findings, digits=long_run)
    # by severity, then by what fixing it would save (analyzers/advice.py), largest first
    findings.sort(key=lambda f: (SEVERITY_ORDER.get(f["severity"], 9), -_saving(f), f["kind"], f["ranks"]))
    if actions is not None:
        actions = ranked(findings)
    info = run_info(run)
    info.update(live_state(run))
    for name, rs in info.get("probes_off", {}).items():  # absent data must not read as "nothing found"
        run.problems.append(f"probe {name} was left out (TRAINPROF_PROBES_OFF) on {len(rs)} of "
                            f"{len(run.ranks)} rank{'s' * (len(run.ranks) != 1)}: analyses that need "
                            f"it saw no data there")
    lost = lost_traces(run) if info.get("profiled") else None
    if lost:
        run.problems.append(lost)
    health = None if run.trace_inputs or run.snapshot_only else stream_health.check(run)
    if health:  # empty or torn stream files: said by name, never "nothing looks wrong"
        run.problems.extend(stream_health.problems(run, health))
    nothing = nothing_captured(run) or (health and stream_health.nothing_readable(run, health))
    if nothing:
        run.problems.insert(0, nothing)
    cover = None if nothing else coverage(run, metrics, health)
    if cover and run.trace_inputs:
        # only a run directory's streams missing: the nature of bare traces, said plainly
        streams = {need for _, need in RUN_DIR_ANALYSES}
        cover["input_only"] = all(m.get("needs") in streams for m in cover.get("not_analyzed") or [])
    if cover:
        run.problems.insert(0, cover["text"])
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "trainprof_version": __version__,
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run": info,
        "metrics": metrics,
        "findings": findings,
        "problems": list(dict.fromkeys(run.problems)),
        "errors": errors,
        "analyzer_seconds": timings,
        # what to change first: failures (critical, error), then findings whose fix saves ≥ 5 %
        # of the step, warnings before info, largest saving first (analyzers/advice.actions)
        "actions": actions or [],
        **({"nothing_analyzed": nothing} if nothing else {}),
        # what could not be analyzed (and why): never "nothing looks wrong" about it
        **({"coverage": cover} if cover else {}),
    }


def _stamp_onsets(run: RunDir, found) -> None:
    """onset / end on findings whose analyzer names their steps (analyzers/_onset.py)."""
    try:
        stamp_findings(run, found)
    except Exception as e:  # noqa: BLE001 - a finding without its onset is still a finding
        run.problems.append(f"onsets: {type(e).__name__}: {e}")


def _advise(metrics: dict, findings: list[dict], errors: list) -> list | None:
    """``fix`` and ``estimate`` on every finding (analyzers/advice.py); None when it failed."""
    try:
        return advise(metrics, findings)
    except Exception as e:  # noqa: BLE001 - the findings stand without their estimates
        errors.append({"analyzer": "advice", "error": f"{type(e).__name__}: {e}"})
        return None


def _replay_estimates(run: RunDir, metrics: dict, findings: list[dict], errors: list) -> None:
    """The estimates whose change the critical path's graph can replay, replayed: each gets
    ``estimate.replay``, and ``metrics.critical_path.what_if`` lists them side by side."""
    cp = metrics.get("critical_path")
    if not isinstance(cp, dict) or "job" not in cp:
        return
    try:
        rows = replay_findings(run, findings)
    except Exception as e:  # noqa: BLE001 - the estimates stand without their replay
        errors.append({"analyzer": "critical_path", "error": f"replay of the estimates: {type(e).__name__}: {e}"})
        return
    if rows:
        cp["what_if"] = rows


def _saving(f: dict) -> float:
    e = f.get("estimate")
    return float(e.get("saving_fraction") or 0.0) if isinstance(e, dict) else -1.0


# analyzers whose figures come from the profiled window alone (withheld with comm_compute's
# when that window holds no training step)
WINDOW_ANALYZERS = ("comm_compute", "ops", "roofline", "launch", "trace_stragglers", "gpu_overview")
# what a run directory's streams give and bare profiler traces cannot: (analysis, stream)
RUN_DIR_ANALYSES = (("step time", "step timings (steps.jsonl)"),
                    ("stragglers over every step", "the collective log (collectives.jsonl)"),
                    ("collective desync / mismatch", "the collective log (collectives.jsonl)"),
                    ("NaN origin", "the NaN watch (nan.jsonl)"),
                    ("hang", "heartbeats (heartbeat.jsonl)"))
# analyses between ranks: they do not apply to a job of one process
INTER_RANK_ANALYSES = ("stragglers over every step", "collective desync / mismatch")
_LABELS = {"comm_compute": "communication vs compute", "trace_stragglers": "stragglers in the "
           "profiled steps", "launch": "kernel launch", "step_time": "step time",
           "gpu_overview": "GPU overview",
           "nan_origin": "NaN origin", "whole_run": "whole run over time"}


def withhold_window(metrics: dict, findings: list[dict]) -> list[dict]:
    """When comm_compute withheld its figures (the profiled window holds no training step), the
    other window-only analyzers' figures and findings are withheld too: the findings kept."""
    why = (metrics.get("comm_compute") or {}).get("withheld")
    if not why:
        return findings
    for name in WINDOW_ANALYZERS[1:]:
        if name in metrics:
            metrics[name] = {"withheld": why}
    return [f for f in findings if f.get("analyzer") not in WINDOW_ANALYZERS]


def coverage(run: RunDir, metrics: dict, health=None) -> dict | None:
    """What was analyzed and what could not be, with why: bare profiler traces carry none of a
    run directory's streams; a profiled window without training steps gives no trace figures.
    None when everything that applies was analyzed."""
    analyzed = [_LABELS.get(n, n) + (" (from the traces)" if n == "memory" and run.trace_inputs else "")
                for n, m in metrics.items() if isinstance(m, dict) and not m.get("withheld")]
    missing: list[dict] = []
    single = _one_process(run)
    if run.trace_inputs:
        missing += [{"analysis": a, "needs": need} for a, need in RUN_DIR_ANALYSES
                    if not (single and a in INTER_RANK_ANALYSES)]
    why = (metrics.get("comm_compute") or {}).get("withheld")
    if why:
        missing += [{"analysis": _LABELS.get(n, n), "needs": "a profiled window of training steps"}
                    for n in WINDOW_ANALYZERS if n in metrics]
    unreached = None if run.trace_inputs else window_unreached(run)
    if unreached:
        missing += [{"analysis": _LABELS.get(n, n), "needs": "a profiled window of training steps"}
                    for n in WINDOW_ANALYZERS if n not in metrics or n == "trace_stragglers"]
    lost = stream_health.not_analyzed(health) if health else []
    missing += [m for m in lost if m["analysis"] not in {x["analysis"] for x in missing}]
    unread = ((metrics.get("gpu_overview") or {}).get("job") or {}).get("unread_device_categories")
    if not missing and not unread:
        return None
    needs = list(dict.fromkeys(m["needs"] for m in missing))
    if not missing:
        text = ""
    elif run.trace_inputs:
        text = ("profiler traces only (no run directory): not analyzed — "
                + ", ".join(m["analysis"] for m in missing if m["needs"] in dict(RUN_DIR_ANALYSES).values())
                + "; they need a run directory's " + ", ".join(n for n in needs if "window" not in n)
                + " (record one with `trainprof wrap -- CMD`)")
    elif unreached:
        text = "not analyzed: " + ", ".join(m["analysis"] for m in missing) + f" ({unreached})"
    elif lost and not why:
        text = ("not analyzed: " + ", ".join(m["analysis"] for m in missing) + " (their streams, "
                + ", ".join(f"{s}.jsonl" for s in health.lost_streams())
                + ", hold no complete record on any rank: see problems)")
    else:
        text = ("not analyzed: " + ", ".join(m["analysis"] for m in missing)
                + " (the profiler window did not cover training steps: see problems)")
    if why and run.trace_inputs:
        text += "; the profiled window holds no training step: trace figures withheld"
    if unread:  # a device trace read as a CPU one is no clean run (analyzers/gpu_overview.py)
        missing.append({"analysis": "GPU analyses", "needs": "device events in a format trainprof reads"})
        text = ("device events not read: events of " + ", ".join(repr(c) for c in unread)
                + " look like kernels or runtime calls in a trace format trainprof does not know, "
                "so the GPU analyses did not run" + ("; " + text if text else ""))
    text += "; analyzed: " + (", ".join(analyzed) if analyzed else "nothing")
    return {"analyzed": analyzed, "not_analyzed": missing, "text": text,
            **({"not_applicable": list(INTER_RANK_ANALYSES)} if single else {})}


def window_unreached(run: RunDir) -> str | None:
    """Why a run directory has no profiler trace although its probes were to record a window
    (meta.json ``profile_steps``): the job ended before the window's first step. None when a
    trace exists, no window was asked for (``--profile-steps none``, the job's own profiler),
    or the ranks skipped it on purpose (--profile-ranks)."""
    try:
        if run.profiler_traces():
            return None
    except Exception:  # noqa: BLE001 - the trace analyzers report an unreadable profiler/
        return None
    windows, recorded = [], []
    for r in run.ranks:
        m = run.rank_meta(r)
        w = m.get("profile_steps")
        if m.get("profiled") is False or m.get("job_profiler") or not (
                isinstance(w, list) and len(w) == 2 and all(type(x) is int for x in w)):
            continue
        windows.append(tuple(w))
        n = m.get("steps_recorded")
        if type(n) is int:
            recorded.append(n)
    if not windows or not recorded or max(recorded) > windows[0][0]:
        return None  # a window reached but not written is lost_traces' to say
    first, last = windows[0]
    n = max(recorded)
    if n == 0:  # no window of steps can be reached: there are none
        return (f"the profiler window, steps {first}-{last}, was never reached: the job recorded "
                "no step (neither an optimizer step nor a `trainprof.step()` marker closed one); "
                "mark the loop's steps with `trainprof.step()` to profile them")
    rerun = "0-0" if n == 1 else f"1-{min(n - 1, 2)}"  # steps the job does run
    return (f"the profiler window, steps {first}-{last}, was never reached: the job recorded "
            f"{n} step{'s' * (n != 1)}; rerun with `trainprof wrap --profile-steps {rerun}`")


def _one_process(run: RunDir) -> bool:
    """A job of one process (world size 1): stragglers and collective desync do not apply."""
    try:
        return run.world_size == 1 and len(run.ranks) <= 1
    except Exception:  # noqa: BLE001 - unknown world size: the analyses may apply
        return False


def lost_traces(run: RunDir) -> str | None:
    """Ranks that were to record the profiler window (meta.json ``profiled``) but left no trace:
    absent data, unlike the ranks --profile-ranks skipped on purpose. None when there are none."""
    try:
        have = set(run.profiler_traces())
    except Exception:  # noqa: BLE001 - the trace analyzers report an unreadable profiler/
        return None
    lost = [r for r in run.ranks if run.rank_meta(r).get("profiled") is True and r not in have]
    if not lost:
        return None

    return (f"{len(lost)} rank(s) that were to record the profiler window left no trace "
            f"(ranks {ranges(lost)}: the job ended before the window, or the trace was lost): "
            f"trace-based analyses cover only the other ranks")


def nothing_captured(run: RunDir) -> str | None:
    """Why a run directory holds no rank's data (so that no analysis ran), or None. Such a run
    must never read as "nothing looks wrong"."""
    if run.snapshot_only:
        return None
    if run.trace_inputs:
        return _nothing_in_traces(run)
    if run.ranks:
        return None

    man = run.launcher
    config = man.get("config") if isinstance(man.get("config"), dict) else {}
    env = man.get("env") if isinstance(man.get("env"), dict) else {}
    disabled = config.get("probes_disabled") is True or flag_on(str(env.get("TRAINPROF_DISABLE") or ""))
    if disabled:
        return "the probes were disabled (TRAINPROF_DISABLE): no rank captured anything"
    return ("no rank captured any data (the probes start in a process that initializes "
            "torch.distributed, creates a DeviceMesh or steps an optimizer)")


def _nothing_in_traces(run: RunDir) -> str | None:
    """Why bare profiler traces gave nothing to analyze (no trace read, or no event in any)."""
    f = run.input_facts
    where = ", ".join(str(p) for p in run.trace_inputs[:3]) + (" …" if len(run.trace_inputs) > 3 else "")
    if not f.get("files"):
        return (f"no profiler trace file (*.json, *.json.gz) in {where}; expected Chrome traces "
                f"written by torch.profiler (tensorboard_trace_handler or export_chrome_trace)")
    if not run.ranks:
        return (f"none of the {f['traces_read'] + f['unreadable']} profiler trace file(s) in {where} "
                f"could be read (see problems); expected Chrome traces written by torch.profiler")
    if not f.get("steps"):
        return (f"the {f['traces_read']} profiler trace(s) read from {where} hold no events; "
                f"expected the CPU ops (and kernels) of at least one step")
    return None


def analyze_and_write(run_dir, out_dir=None, report: bool = True, progress=None):
    """Analyze a run directory, write summary.json (and report.html). Returns
    (summary, summary_path, report_path_or_None)."""
    from pathlib import Path

    if out_dir and (why := outputs.refusal(Path(out_dir))):  # wrap --out's rule: never the user's files
        raise RunDirError(why)
    run = RunDir(run_dir)
    if not run.snapshot_only and run.profiler_traces():
        # the traces' digests first, built in a pool one trace at a time; cached in the run
        # directory when the outputs go there (trainprof/analysis/digest.py)
        try:
            run.digest_docs(progress=progress, write=not out_dir or Path(out_dir).resolve()
                            == run.path.resolve())
        except Exception:  # noqa: BLE001 - the analyzers that need them report it
            pass
    summary = outputs.cap_strings(analyze(run, progress=progress))
    out = Path(out_dir) if out_dir else run.path
    names = (SUMMARY, REPORT)
    single = run_dir if not isinstance(run_dir, (list, tuple)) else (
        run_dir[0] if len(run_dir) == 1 else None)
    if not out_dir and single is not None and Path(single).is_file() \
            and (len(run.bare_snapshots) == 1 or run.trace_inputs):
        # one bare snapshot or trace: name the outputs after it, beside it, so that several
        # files in one folder can be analysed one by one without overwriting each other
        name = Path(single).name
        names = (f"{name}.{SUMMARY}", f"{name}.{REPORT}")
    summary_path = out / names[0]
    if run.trace_inputs:  # a folder of the user's files: never overwrite one trainprof did not write
        _refuse_foreign(summary_path, b'"trainprof_version"')
        if report:
            _refuse_foreign(out / names[1], b"trainprof report")
    # indented for reading; compact when its per-rank tables run to thousands of lines or its
    # series were bounded (a long run: one number a line would double its size)
    many = len(summary.get("run", {}).get("ranks") or []) > 64 or bounded(summary)
    report_path = out / names[1] if report else None
    writing = summary_path
    try:  # a full disk: the findings are still printed (OutputsNotWritten carries them)
        out.mkdir(parents=True, exist_ok=True)
        outputs.clean_stale_tmp(out, names)  # a killed analyze's temporaries
        write_json_atomic(summary_path, summary, indent=None if many else 2)
        if report:
            from trainprof.reports.html import write_html  # lazy: start-up time of analyze --no-report

            writing = report_path
            write_html(summary, report_path)
    except OSError as e:
        raise outputs.OutputsNotWritten(summary, writing, e) from None
    return summary, summary_path, report_path


def _refuse_foreign(path, marker: bytes) -> None:
    """RunDirError when ``path`` exists and does not look written by trainprof (no ``marker``
    in its first 64 KB)."""
    import os

    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16) if os.path.isfile(path) else marker
    except FileNotFoundError:
        return
    except OSError as e:
        raise RunDirError(f"{path}: cannot check before writing: {e.strerror or e}") from None
    if marker not in head:
        raise RunDirError(f"{path} exists and was not written by trainprof; not overwritten: "
                          f"write the outputs elsewhere with --out DIR")
