"""`trainprof timeline`: one Chrome trace of every rank on one clock (analyzers/_timeline.py
builds it, reports/chrome_trace.py writes it; docs/timeline.md)."""

from __future__ import annotations

import json
from pathlib import Path

from trainprof.rundir import RunDir

DEFAULT_MAX_MB = 100


def _findings(run: RunDir, analyze: bool) -> tuple[list[dict], str]:
    """The run's findings: its summary.json when there is one (written by `trainprof analyze`),
    else an analysis now (nothing written) unless ``analyze`` is false."""
    p = Path(run.path) / "summary.json" if not run.trace_inputs else None
    if p is not None and p.is_file():
        try:
            doc = json.loads(p.read_text())
            return [f for f in doc.get("findings") or [] if isinstance(f, dict)], f"from {p}"
        except (OSError, ValueError) as e:
            run.problems.append(f"{p}: not read ({e}); findings computed again")
    if not analyze:
        return [], "not shown (--no-findings)"
    from trainprof.analysis import analyze as run_analysis

    return run_analysis(run).get("findings") or [], "computed now (no summary.json)"


def make(inputs, out, steps=None, ranks=None, gz: bool = False, max_mb: float = DEFAULT_MAX_MB,
         findings: bool = True) -> dict:
    """Write the timeline; returns what was written and chosen (for the verb to print)."""
    from trainprof.analyzers import _timeline
    from trainprof.reports import chrome_trace

    run = RunDir(inputs)
    if not run.ranks and not run.trace_inputs:
        from trainprof.rundir import RunDirError

        raise RunDirError(f"{run.path}: no rank data and no profiler trace: nothing to show")
    found, source = _findings(run, findings) if not run.trace_inputs else ([], "none (plain traces)")
    model = _timeline.build(run, steps=steps, ranks=ranks, findings=found,
                            max_bytes=int(max_mb * (1 << 20)))
    model["meta"]["findings"] = {"count": len(found), "source": source}
    model["meta"]["problems"] = list(dict.fromkeys(run.problems))[:50]
    info = chrome_trace.write(model, out, gz=gz)
    return {**info, "meta": model["meta"]}
