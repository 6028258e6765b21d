"""probes/, analyzers/ and reports/ install as trainprof.probes, trainprof.analyzers and
trainprof.reports — from an editable install and from a built wheel — and nothing named
`probes`, `analyzers` or `reports` lands at the top of site-packages."""

from __future__ import annotations

import paths
import subprocess
import sys
import venv

import pytest

REPO = paths.REPO
CHECK = """
import importlib, sys
for name in ("trainprof.probes", "trainprof.analyzers", "trainprof.reports"):
    importlib.import_module(name)
for name in ("probes", "analyzers", "reports"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    sys.exit(f"import {name} should fail")
import trainprof.probes
print("OK", trainprof.probes.__file__)
"""


def test_current_install_maps_subpackages(tmp_path):
    res = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr + res.stdout
    assert res.stdout.startswith("OK")


def test_built_wheel_maps_subpackages(tmp_path):
    dist = tmp_path / "dist"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-w", str(dist), str(REPO)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build here: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr
    wheel = next(dist.glob("trainprof-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"trainprof", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for sub in ("probes", "analyzers", "reports", "_bootstrap"):
        assert f"trainprof/{sub}/__init__.py" in names
    assert "trainprof/_bootstrap/sitecustomize.py" in names
    compiled = {n.split("/")[-2] + "/" + n.split("/")[-1].split(".")[0] for n in names if n.endswith(".so")}
    if "probes/_fastlog" in compiled:  # a compiler was at hand: both C parts are built
        assert "trace/_kineto" in compiled, compiled

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    res = subprocess.run([str(py), "-c", CHECK], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "site-packages/trainprof/probes/__init__.py" in res.stdout
