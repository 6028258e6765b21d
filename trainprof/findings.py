"""Findings and analyzer results: the contract between analyzers and reports.

summary.json (schema documented in docs/summary.md)::

    {"schema_version": 1, "trainprof_version": "...",
     "run": {"dir", "world_size", "mesh": {"dp", "pp", "tp"}, "command", "exit_code", ...},
     "metrics": {"<analyzer>": {...}, ...},
     "findings": [{"kind", "severity", "ranks", "message", "evidence": {...}, "analyzer"}],
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
)


@dataclass
class Finding:
    kind: str
    severity: str
    ranks: list[int]
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    analyzer: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; known: {', '.join(SEVERITIES)}")
        self.ranks = sorted(int(r) for r in self.ranks)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AnalyzerResult:
    """What one analyzer returns: JSON-able metrics (also the data the report plots) and findings."""

    metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
