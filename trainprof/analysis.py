"""Run every analyzer over a run directory and assemble summary.json."""

from __future__ import annotations

import time
import traceback
from datetime import datetime, timezone
from typing import Callable

from trainprof import __version__
from trainprof.findings import SUMMARY_SCHEMA_VERSION
from trainprof.rundir import RunDir

SEVERITY_ORDER = {"critical": 0, "error": 1, "warning": 2, "info": 3}
SNAPSHOT_ANALYZERS = ("memory", "fragmentation")


def run_info(run: RunDir) -> dict:
    launcher = run.launcher
    mesh = run.mesh
    sizes = dict(zip(mesh.get("dim_names", []), mesh.get("shape", [])))
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
        "dir": str(run.path),
        "command": launcher.get("command"),
        "start_time": launcher.get("start_time"),
        "end_time": launcher.get("end_time"),
        "exit_code": launcher.get("exit_code"),
        "signal": launcher.get("signal"),
        "world_size": run.world_size,
        "mesh": {k: int(sizes.get(k, 1)) for k in ("dp", "pp", "tp")} if sizes else {},
        "mesh_dims": mesh,
        "device": first.get("device_name") or first.get("device"),
        "backend": first.get("backend"),
        "torch_version": first.get("torch_version"),
        "run_info": first.get("run_info", {}),
        "ranks": ranks,
        **({"probes_off": off} if off else {}),
        # ranks of the job without files: job-level figures are partial (or withheld)
        **({"partial": partial} if (partial := run.partial()) else {}),
        **({"snapshots": [str(p) for p in run.bare_snapshots]} if run.snapshot_only else {}),
    }


def analyze(run: RunDir, progress: Callable[[str], None] | None = None) -> dict:
    from trainprof.analyzers import load_all

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
            errors.append({"analyzer": mod.NAME, "error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc(limit=8)})
            continue
        finally:
            timings[mod.NAME] = round(time.perf_counter() - t0, 4)
        if result.metrics:
            metrics[mod.NAME] = result.metrics
        for f in result.findings:
            f.analyzer = f.analyzer or mod.NAME
            findings.append(f.to_dict())
    findings.sort(key=lambda f: (SEVERITY_ORDER.get(f["severity"], 9), f["kind"], f["ranks"]))
    info = run_info(run)
    for name, rs in info.get("probes_off", {}).items():  # absent data must not read as "nothing found"
        run.problems.append(f"probe {name} was left out (TRAINPROF_PROBES_OFF) on {len(rs)} of "
                            f"{len(run.ranks)} ranks: analyses that need it saw no data there")
    nothing = nothing_captured(run)
    if nothing:
        run.problems.insert(0, nothing)
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
        **({"nothing_analyzed": nothing} if nothing else {}),
    }


def nothing_captured(run: RunDir) -> str | None:
    """Why a run directory holds no rank's data (so that no analysis ran), or None. Such a run
    must never read as "nothing looks wrong"."""
    if run.snapshot_only or run.ranks:
        return None
    from trainprof.settings import flag_on

    man = run.launcher
    config = man.get("config") if isinstance(man.get("config"), dict) else {}
    env = man.get("env") if isinstance(man.get("env"), dict) else {}
    disabled = config.get("probes_disabled") is True or flag_on(str(env.get("TRAINPROF_DISABLE") or ""))
    if disabled:
        return "the probes were disabled (TRAINPROF_DISABLE): no rank captured anything"
    return ("no rank captured any data (the probes start in a process that initializes "
            "torch.distributed, creates a DeviceMesh or steps an optimizer)")


def analyze_and_write(run_dir, out_dir=None, report: bool = True, progress=None):
    """Analyze a run directory, write summary.json (and report.html). Returns
    (summary, summary_path, report_path_or_None)."""
    from pathlib import Path

    from trainprof.rundir import REPORT, SUMMARY, write_json_atomic

    run = RunDir(run_dir)
    summary = analyze(run, progress=progress)
    out = Path(out_dir) if out_dir else run.path
    out.mkdir(parents=True, exist_ok=True)
    names = (SUMMARY, REPORT)
    if not out_dir and len(run.bare_snapshots) == 1 and Path(run_dir).is_file():
        # one bare snapshot: name the outputs after it, beside it, so that several snapshots
        # in one folder can be analysed one by one without overwriting each other
        names = (f"{run.bare_snapshots[0].name}.{SUMMARY}", f"{run.bare_snapshots[0].name}.{REPORT}")
    summary_path = out / names[0]
    write_json_atomic(summary_path, summary)
    report_path = None
    if report:
        from trainprof.reports.html import write_html

        report_path = out / names[1]
        write_html(summary, report_path)
    return summary, summary_path, report_path
