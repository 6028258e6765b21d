"""Which files in a folder trainprof wrote: a run directory's manifest and the analysis outputs
(summary.json, report.html) recognised by their own first bytes. Read by `wrap --out` and
`analyze --out` before they write into a folder (trainprof/launch/outdir.py,
trainprof/analysis/outputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

from trainprof.rundir.files import MANIFEST, REPORT, SUMMARY

RUN_KIND = "trainprof-run"
ANALYSIS_OUTPUTS = (SUMMARY, REPORT)  # written by `trainprof analyze`, after the inventory


def read_run_manifest(out: Path) -> dict | None:
    """The manifest.json of a trainprof run in out, or None when out holds none."""
    p = out / MANIFEST
    try:
        if not p.is_file() or p.is_symlink() or p.stat().st_size > 64 << 20:
            return None
        man = json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None
    return man if isinstance(man, dict) and man.get("kind") == RUN_KIND else None


def is_analysis_output(path: Path) -> bool:
    """summary.json / report.html whose first bytes are trainprof's."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return False
    if path.name == SUMMARY:
        return head.lstrip().startswith(b"{") and b'"trainprof_version"' in head \
            and b'"schema_version"' in head
    return head.startswith(b"<!DOCTYPE html>") and b"<title>trainprof" in head
