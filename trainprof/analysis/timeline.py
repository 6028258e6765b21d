"""`trainprof timeline`: one Chrome trace of every rank on one clock (analyzers/_timeline.py
builds it, reports/chrome_trace.py writes it; docs/timeline.md)."""

from __future__ import annotations

import json
from pathlib import Path

from trainprof.analysis.run import RunDir
from trainprof.analysis.runner import analyze as run_analysis
from trainprof.analyzers import _timeline
from trainprof.reports import chrome_trace
from trainprof.rundir.files import RunDirError

DEFAULT_MAX_MB = 100


def parse_spec(spec: str, what: str = "--ranks") -> list[int]:
    """"0,3,8-15" -> [0, 3, 8, ..., 15]; ValueError naming the bad part."""
    out: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a or b - a > 1_000_000:
                    raise ValueError
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a number or a range A-B") from None
    if not out:
        raise ValueError(f"{what}: {spec!r} names nothing")
    return sorted(out)


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

    return run_analysis(run).get("findings") or [], "computed now (no summary.json)"


def make(inputs, out, steps=None, ranks=None, gz: bool = False, max_mb: float = DEFAULT_MAX_MB,
         findings=True) -> dict:
    """Write the timeline; returns what was written and chosen (for the verb to print).
    ``findings``: True (summary.json, else an analysis now), False (none), or a list."""
    run = RunDir(inputs)
    if not run.ranks and not run.trace_inputs:
        raise RunDirError(f"{run.path}: no rank data and no profiler trace: nothing to show")
    if isinstance(findings, list):
        found, source = findings, "given"
    elif run.trace_inputs:
        found, source = [], "none (plain traces)"
    else:
        found, source = _findings(run, findings)
    limit = int(max_mb * (1 << 20))
    budget = limit
    for _ in range(4):  # the model's byte estimate is per event: render, and shrink if over
        model = _timeline.build(run, steps=steps, ranks=ranks, findings=found, max_bytes=budget)
        model["meta"]["findings"] = {"count": len(found), "source": source}
        model["meta"]["problems"] = list(dict.fromkeys(run.problems))[:50]
        model["meta"]["limit"]["max_bytes"] = limit
        doc = chrome_trace.render(model)
        size = chrome_trace.size(doc)
        if size <= limit:
            break
        budget = int(budget * limit / size * 0.95)
    info = chrome_trace.write_doc(doc, out, gz=gz)
    return {**info, "meta": model["meta"]}
