"""The report of a real multi-process run, written offline (and rendered in headless Chromium where
installed)."""

from __future__ import annotations

import json
import sys

import pytest

from chromium import CHROMIUM, NETWORK_REF, _chromium
from helpers import run_cli, write_script
from trainprof.reports import kit


TRAIN = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
m = torch.nn.Linear(32, 32); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(10):
    m(torch.randn(8, 32)).sum().backward(); opt.step(); opt.zero_grad()
    t = torch.ones(4); dist.all_reduce(t)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report-run")
    script = write_script(tmp / "train.py", TRAIN)
    out = tmp / "run"
    proc = run_cli(["wrap", "--out", out, "--no-analyze", "--", sys.executable, "-m",
                    "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
                   cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.multiproc
def test_analyze_real_run_writes_an_offline_report(small_run, tmp_path):
    proc = run_cli(["analyze", small_run, "--out", tmp_path])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    html = (tmp_path / "report.html").read_text()
    assert not NETWORK_REF.search(html)
    assert 'id="s-step_time"' in html and "<svg" in html
    for rank in summary["metrics"]["step_time"]["per_rank"]:
        assert kit.fmt_ms(rank["median_ms"]) in html  # the table shows the analysis' numbers
    assert str(tmp_path / "report.html") in proc.stdout
    assert "step time (median)" in proc.stdout
    if CHROMIUM:
        dom = _chromium(["--dump-dom", (tmp_path / "report.html").as_uri()], tmp_path).stdout
        assert "Step time" in dom and "<svg" in dom
