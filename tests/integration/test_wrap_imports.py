"""A wrapped job that uses neither pipelining nor DDP does not pay for importing them: the
probes patch torch.distributed.pipelining and DDP's pre-hook when the job imports them
(probes/post_import.py); importing pipelining ahead pulls in DTensor and dynamo, 1-3 s of CPU
per rank."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from helpers import run_cli

JOB = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
t = torch.ones(4); dist.all_reduce(t)
dist.destroy_process_group()
print(json.dumps([m for m in ("torch._dynamo", "torch.distributed.pipelining",
                              "torch.distributed.pipelining.stage") if m in sys.modules]))
from torch.distributed.pipelining import stage  # the job's own import: the probes patch it then
print(json.dumps([hasattr(stage._PipelineStageBase.forward_one_chunk, "_trainprof_original"),
                  getattr(stage.PipelineStage._forward_metadata_inference, "_trainprof_nan", False)]))
"""


@pytest.mark.multiproc
def test_a_plain_wrapped_job_imports_neither_pipelining_nor_dynamo_until_it_does(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "job.py"
    script.write_text(JOB)
    res = run_cli(["wrap", "--no-analyze", "--out", tmp_path / "run", "--", sys.executable, script],
                   env={"PORT": str(port)})
    assert res.returncode == 0, res.stderr[-3000:]
    imported, patched = (json.loads(x) for x in res.stdout.strip().splitlines()[-2:])
    assert imported == []
    assert patched == [True, True]  # pipeline spans and the NaN watch's shape-inference quiet
    # the probes were active: the all_reduce is in the collective log
    log = (tmp_path / "run" / "ranks" / "rank-00000" / "collectives.jsonl")
    assert log.exists() and '"all_reduce"' in log.read_text()
