"""The small real FSDP2 + TP + PP job on gloo (tests/support/jobs/fsdp_tp_pp_job.py) and the session fixture that runs it once under wrap (shared by the collective-log, clock and collectives-analyzer tests)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from collective_paths import PATHS, _fast_built  # noqa: F401 - the paths of the collective log


# every kind of collective the collective log records, once per step (the script's defaults)
JOB = (Path(__file__).resolve().parent / "jobs" / "fsdp_tp_pp_job.py").read_text()


NPROC = 4


STEPS = 4


@pytest.fixture(scope="session", params=PATHS)
def collective_run(request, reference_run, tmp_path_factory):
    """The job above under `trainprof wrap`, run once per test session and per path of the
    collective log (C, pure Python) (shared by the collectives and clock tests)."""
    return _collective_job(reference_run, tmp_path_factory, request.param)


def _collective_job(reference_run, tmp_path_factory, path):
    d = tmp_path_factory.mktemp("collective-job")
    (d / "trainprof_collective_job.py").write_text(JOB)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(d)] + ([old] if old else []))
    try:
        return reference_run(f"collective-job-{path}", nproc=NPROC, args=[str(STEPS)],
                             wrap_args=["--profile-steps", "none"],
                             module="trainprof_collective_job",
                             env={"TRAINPROF_COLLECTIVES_PY": "1" if path == "python" else "0"})
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
