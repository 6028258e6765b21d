"""Analyzers: pure functions from a run directory to metrics and findings, one module per concern.

Each module exposes ``NAME`` and ``analyze(run: trainprof.analysis.run.RunDir) -> AnalyzerResult``.
They read only what the run directory holds (never probe internals, never the fault-injection
ground truth) and share one parse of every file through the RunDir cache.
"""

from __future__ import annotations

import importlib

# Order matters only for the report's section order. Modules not present in this build are
# skipped silently.
ANALYZER_MODULES = ("step_time", "whole_run", "comm_compute", "collectives", "stragglers", "slow_steps",
                    "trace_stragglers",
                    "pipeline", "expert_balance", "critical_path",
                    "nan_origin", "hang", "memory", "fragmentation", "roofline", "ops", "launch",
                    "gpu_overview", "uneven_steps", "teardown")


def load_all():
    """The analyzer modules, imported lazily so one broken analyzer cannot hide the others."""
    mods, errors = [], []
    for name in ANALYZER_MODULES:
        try:
            mods.append(importlib.import_module(f"{__name__}.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                errors.append({"analyzer": name, "error": f"import failed: {e}"})
        except Exception as e:  # noqa: BLE001
            errors.append({"analyzer": name, "error": f"import failed: {type(e).__name__}: {e}"})
    return mods, errors


def digest_function(name: str):
    """The per-rank trace reduction of analyzer ``name``: ``trace_digest(run, rank, trace)``."""
    return importlib.import_module(f"{__name__}.{name}").trace_digest
