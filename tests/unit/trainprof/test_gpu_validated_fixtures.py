"""The fixtures benchmarks/gpu/validate.py wrote on a GPU (tests/fixtures/gpu/validated/), re-analysed
on this CPU machine: every check that passed on the GPU holds again on its run directory or trace
(benchmarks/gpu/vfixtures.verify: the same criteria, with the fixture's cuda flag)."""

from __future__ import annotations

import json
import sys

import pytest
from paths import REPO

ROOT = REPO
VALIDATED = ROOT / "tests" / "fixtures" / "gpu" / "validated"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

pytestmark = pytest.mark.skipif(not (VALIDATED / "fixtures.json").is_file(),
                                reason="no GPU validation fixtures yet: run benchmarks/gpu/validate.py on a "
                                       "GPU (docs/gpu-validation.md)")


def test_validated_gpu_fixtures_hold_on_cpu(tmp_path):
    import vfixtures

    doc = json.loads((VALIDATED / "fixtures.json").read_text())
    assert doc["cuda"] is True, "tests/fixtures/gpu/validated must come from a GPU run, not a dry run"
    results = vfixtures.verify(VALIDATED, tmp_path)
    assert results
    bad = {f"{e['check']} ({e['path']})": v.failed() for e, v in results if not v.ok}
    assert not bad, bad
