"""Shared by test_hang.py and test_hang_watchdog.py (single-process and job tests)."""

from __future__ import annotations

import json
from pathlib import Path


def _lines(path: Path):
    return [json.loads(x) for x in path.read_text().splitlines()]
