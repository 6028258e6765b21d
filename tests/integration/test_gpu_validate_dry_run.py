"""benchmarks/gpu/validate.py --dry-run: the GPU validation suite's plumbing on CPU (gloo). Every
check runs its jobs and its criteria (their CPU form), the table is printed, results.json and
the tarballs written, the fixtures go to OUT (never the repo) and are re-analysed as CPU CI does."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile

import pytest
from paths import REPO

pytestmark = pytest.mark.multiproc

ROOT = REPO
VALIDATE = ROOT / "benchmarks" / "gpu" / "validate.py"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import vchecks  # noqa: E402


@pytest.mark.long  # 38 s on 2 cores: run it (benchmarks/long_tests.py -k dry_run) before a GPU session
def test_dry_run_runs_every_check_and_writes_fixtures_outside_the_repo(tmp_path):
    before = sorted((ROOT / "tests" / "fixtures" / "gpu").rglob("*"))
    out = tmp_path / "out"
    # HTA is an optional extra (`.[hta]`): without it the HTA check is left out, and said to be
    hta = importlib.util.find_spec("hta") is not None
    r = subprocess.run([sys.executable, str(VALIDATE), "--dry-run", "--out", str(out), "--work", str(tmp_path),
                        *([] if hta else ["--skip", "hta"])],
                       capture_output=True, text=True, timeout=590)
    res = json.loads((out / "results.json").read_text())
    checks = {c["check"]: c for c in res["checks"]}
    failed = {n: {"number": c["number"], "detail": c["detail"],
                  "failed": [x["criterion"] for x in c["criteria"] if not x["ok"]],
                  "data": str(c["data"])[:1500]}
              for n, c in checks.items() if c["verdict"] != "PASS" and (hta or n != "hta")}
    assert not failed, (failed, r.stderr[-2000:])  # which check, and which of its criteria
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-3000:])
    assert set(checks) == {c.name for c in vchecks.CHECKS} | {"fixtures"}
    if not hta:
        assert checks.pop("hta")["verdict"] == "skip" and res["skipped"] == ["hta"]
    assert all(c["verdict"] == "PASS" and c["criteria"] for c in checks.values()), checks
    # the table: one row per check with its number and verdict
    for name, c in checks.items():
        assert any(line.startswith(name) and "PASS" in line for line in r.stdout.splitlines()), name
    assert res["dry_run"] is True and res["versions"]["device"] == "cpu (dry run)"
    # fixtures: in OUT, re-analysed; the repo's tests/fixtures/gpu untouched
    fx = json.loads((out / "fixtures" / "fixtures.json").read_text())
    assert fx["cuda"] is False
    assert {e["check"] for e in fx["fixtures"]} == {"ref_1rank", "ref_2rank_gloo", "nan", "nan_sync",
                                                     "fragmentation", "telemetry", "mfu", "job_profiler"}
    assert sorted((ROOT / "tests" / "fixtures" / "gpu").rglob("*")) == before
    with tarfile.open(out / "gpu-fixtures.tar.gz") as t:
        assert "fixtures/fixtures.json" in t.getnames()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("trainprof-validate-")]  # no --keep

