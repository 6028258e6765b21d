"""A DDP job whose gradient all-reduce fails raises the same error under trainprof as bare.

The recording comm hook (probes/ddp.py) chains on each bucket's future; a ``then`` callback that
re-raises fails its future with torch's wrapper ("Got the following error when running the
callback: ... At: probes/ddp.py"), so the hook must keep that future's error from reaching the
job. The failure here is the usual one: uneven inputs without ``model.join()``, so rank 0 runs
out of batches, leaves, and rank 1's next bucket all-reduce finds the peer gone."""

from __future__ import annotations

import os
import re
import sys

import pytest

from helpers import run_bare_job, run_cli, write_script

pytestmark = pytest.mark.multiproc

JOB = """
import sys
import torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
if sys.argv[1] == "hook":  # the job's own Python hook: its future is the job's
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
for _ in range(3 + 3 * rank):  # rank 1 has more batches; no Join
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""


def _torchrun(job, mode):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(job), mode]


def _error_text(stderr: str, rank: int = 1) -> str:
    """The exception rank ``rank`` printed (type, message and any lines under it), without the
    traceback frames above it."""
    lines = [ln[len(f"[rank{rank}]: "):] for ln in stderr.splitlines()
             if ln.startswith(f"[rank{rank}]: ")]
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent")),
                default=None)
    assert start is not None, f"rank {rank} printed no traceback:\n{stderr[-3000:]}"
    tail = lines[start + 1:]
    at = next((i for i, ln in enumerate(tail) if ln and not ln.startswith(" ")), None)
    assert at is not None, f"no exception line after rank {rank}'s traceback:\n{stderr[-3000:]}"
    return "\n".join(tail[at:]).strip()


def _normal(text: str) -> str:
    """Addresses, ports and pids differ from run to run; so may how the socket went down."""
    text = re.sub(r"\d+", "N", text)
    return re.sub(r"Connection (closed|reset)", "Connection lost", text)


@pytest.mark.parametrize("mode", ["builtin", pytest.param("hook", marks=pytest.mark.long)])
def test_failed_bucket_allreduce_raises_the_jobs_own_error(tmp_path, mode):
    job = write_script(tmp_path / "uneven_job.py", JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROF_")}
    bare = run_bare_job(_torchrun(job, mode), env=env, timeout=180)
    assert bare.returncode != 0, "the bare job was expected to fail"
    wrapped = run_cli(["wrap", "--out", tmp_path / "run", "--no-analyze", "--profile-steps",
                       "none", "--", *_torchrun(job, mode)], timeout=180)
    assert wrapped.returncode == bare.returncode, wrapped.stderr[-3000:]

    want, got = _error_text(bare.stderr), _error_text(wrapped.stderr)
    assert _normal(got) == _normal(want), f"bare:\n{want}\n\nunder trainprof:\n{got}"
    assert "probes/" not in got and "trainprof" not in got, got
    if mode == "builtin":  # (a job's own Python hook gets torch's wrapper bare too)
        assert "when running the callback" not in got, got
    # the error is gloo's, raised where DDP waits for the bucket
    assert got.startswith("RuntimeError: ") or got.startswith("torch.distributed"), got
    assert "rank 0 done" in wrapped.stdout
