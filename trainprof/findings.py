"""Findings and analyzer results: the contract between analyzers and reports.

summary.json (schema documented in docs/summary.md)::

    {"schema_version": 1, "trainprof_version": "...",
     "run": {"dir", "world_size", "mesh": {"dp", "pp", "tp"}, "command", "exit_code", ...},
     "metrics": {"<analyzer>": {...}, ...},
     "findings": [{"kind", "severity", "ranks", "message", "evidence": {...}, "analyzer",
                   "onset": {"step", "time"}, "end": {"step", "time"},  (onset/end: when known)
                   "fix": "what to change", "estimate": {...} | null}],
     "actions": [{"finding", "kind", "severity", "fix", "saving_ms", "saving_fraction",
                  "step_ms_before", "step_ms_after", "evidence", "section", "blocked"}],
     "problems": ["<file>: what is wrong", ...],
     "errors": [{"analyzer", "error"}]}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUMMARY_SCHEMA_VERSION = 1

SEVERITIES = ("info", "warning", "error", "critical")

KINDS = (
    "straggler", "nan_origin", "loss_spike", "hang", "rank_failure", "desync", "pipeline_bubble",
    "stage_imbalance",
    "exposed_comm", "fragmentation", "memory", "roofline", "data_starvation", "host_stall",
    "device_starved", "uneven_steps", "slow_steps", "no_communication", "expert_imbalance",
    "throughput_drop", "memory_growth", "process_group_not_destroyed",
)


@dataclass
class Finding:
    kind: str
    severity: str
    ranks: list[int]
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    analyzer: str = ""
    # when it started and, once over, ended: {"step": N, "time": ISO-8601 or None} (docs/onsets.md)
    onset: dict | None = None
    end: dict | None = None
    # what to change, and what it would buy: {"step_ms_before", "step_ms_after",
    # "saving_fraction", "model", "assumptions": [...]} (analyzers/estimates.py); filled in by
    # analyzers/advice.py for findings whose analyzer left them empty; null when the finding
    # is not about speed (a NaN, a hang) or the input gives no measure of the step
    fix: str = ""
    estimate: dict[str, Any] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; known: {', '.join(SEVERITIES)}")
        self.ranks = sorted(int(r) for r in self.ranks)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("onset", "end"):  # only findings that start and stop carry them
            if d.get(k) is None:
                d.pop(k, None)
        return d


@dataclass
class AnalyzerResult:
    """What one analyzer returns: JSON-able metrics (also the data the report plots) and findings."""

    metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
