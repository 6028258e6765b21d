"""Shared fixtures. tests/support (helpers, runs, paths, the jobs the integration tests run) is put
on sys.path here, so every test imports them by name: `from helpers import run_cli`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import pytest

from runs import ReferenceRuns


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """Factory: reference_run(name, nproc=None, args=None, wrap_args=None) -> run directory.
    Runs each named job once per test session (see tests/support/runs.py; import configs with `from runs import CONFIGS`)."""
    return ReferenceRuns(tmp_path_factory.mktemp("reference-runs"))


INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked `long` (sweeps and scale checks kept out of the "
                          "default suite; benchmarks/long_tests.py runs them alone)")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration starts multi-process jobs: marked `multiproc` here, so
    `-m "not multiproc"` runs the single-process tests (tests/unit) whatever a file declares.
    Tests marked `long` (the further points of a sweep whose first point stays in the suite,
    1,024-rank scale checks) are deselected unless `--long` is given: the default suite stays
    within CI's 20 minutes on 2 cores."""
    keep, long_ = [], []
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.multiproc)
        (long_ if item.get_closest_marker("long") and not config.getoption("--long") else keep).append(item)
    if long_:
        config.hook.pytest_deselected(items=long_)
        items[:] = keep
