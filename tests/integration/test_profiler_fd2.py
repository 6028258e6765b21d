"""A wrapped job's fd 2 holds what it holds bare: trainprof's profiler window used to put
torch's `USDT ... profiler_start/stop` and `CPUAllocator ... Memory block of unknown size`
lines there (three per rank; 361 bytes in the data file of a job that reused fd 2)."""

from __future__ import annotations

import sys

from helpers import run_cli, write_script

JOB = r"""
import os, sys
import torch
os.close(2)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
assert fd == 2, fd
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
older = [torch.randn(100) for _ in range(50)]  # freed inside the window: the allocator's warning
for step in range(6):
    model(torch.randn(32, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    del older[0]
    os.write(2, f"step {step} ok\n".encode())
"""


def test_the_profiler_window_writes_nothing_into_the_jobs_fd_2(tmp_path):
    job = write_script(tmp_path / "job.py", JOB)
    data = tmp_path / "data.txt"
    proc = run_cli(["wrap", "--out", tmp_path / "run", "--no-analyze", "--profile-steps", "2-3",
                    "--", sys.executable, job, data], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "run" / "profiler").glob("rank-00000.pt.trace.json*"))  # the window ran
    assert data.read_text() == "".join(f"step {i} ok\n" for i in range(6))
    assert "profiler_start" not in proc.stderr and "CPUAllocator" not in proc.stderr
