"""Shared by test_job_profiler.py and test_job_profiler_coexistence.py (single-process and job
tests)."""

from __future__ import annotations


def _line(text: str, code: str) -> int:
    """The line number of the first line of ``text`` that starts with ``code`` (indent aside)."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(code))
