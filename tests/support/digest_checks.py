"""Shared by test_digest.py and test_digest_jobs.py (single-process and job tests)."""

from __future__ import annotations

import os
from pathlib import Path

from trainprof.analysis.run import RunDir
from trainprof.analyzers import comm_compute, memory, roofline


TRACE_ANALYZERS = (comm_compute, roofline, memory)


def metrics(run: RunDir) -> dict:
    return {m.NAME: m.analyze(run).metrics for m in TRACE_ANALYZERS}


def garble_keeping_stamp(path: Path) -> None:
    """Overwrite a file with bytes no parser reads, keeping its size and mtime (the digest's
    stamp): a digest that is reused proves the trace was not parsed."""
    st = os.stat(path)
    path.write_bytes(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
