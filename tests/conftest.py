import pytest

from runs import ReferenceRuns


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """Factory: reference_run(name, nproc=None, args=None, wrap_args=None) -> run directory.
    Runs each named job once per test session (see tests/runs.py; import configs with `from runs import CONFIGS`)."""
    return ReferenceRuns(tmp_path_factory.mktemp("reference-runs"))
