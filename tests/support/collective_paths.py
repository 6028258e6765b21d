"""The two paths of the collective log (C extension, pure Python) the collective tests run on;
no job here (tests/unit imports it: collective_job.py, which starts the job, must not be)."""
from __future__ import annotations

import pytest


def _fast_built() -> bool:
    try:
        import trainprof.probes._fastlog  # noqa: F401
    except ImportError:
        return False
    return True


PATHS = [pytest.param("c", marks=pytest.mark.skipif(not _fast_built(), reason="_fastlog not built")),
         "python"]
