"""The recorded trace folders in tests/fixtures have no straggler."""

from __future__ import annotations

import shutil

import pytest

from paths import FIXTURES
from trainprof.analysis.run import RunDir


TRIAL_DIRS = [FIXTURES / "hta" / "trace_filter"]


@pytest.mark.parametrize("folder", TRIAL_DIRS, ids=lambda p: p.name)
def test_fixture_trace_folders_have_no_straggler(folder, tmp_path):
    d = tmp_path / folder.name
    shutil.copytree(folder, d)
    from trainprof.analyzers import trace_stragglers

    res = trace_stragglers.analyze(RunDir(d))
    assert res.findings == []
    assert len(res.metrics["per_rank"]) == 2
