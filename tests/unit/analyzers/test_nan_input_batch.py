"""A NaN that arrives in the input batch: the finding says so first (the batch already held it,
before any op), names the model rather than DDP's attribute, and counts the non-finite values."""

from __future__ import annotations

import sys
import subprocess
import textwrap

from helpers import write_script

from trainprof.analyzers import nan_origin
from trainprof.analysis.run import RunDir

BATCH_NAN = """
import sys, torch, torch.nn as nn, trainprof
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
with trainprof.session(sys.argv[1], profile_steps="none"):
    for step in range(4):
        x = torch.randn(4, 8)
        if step == 2:
            x[0, 0] = float("nan"); x[1, 3] = float("nan"); x[2, 1] = float("inf")
        loss = net(x).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
"""


def test_nan_in_input_batch_is_named_as_such(tmp_path):
    out = tmp_path / "run"
    script = write_script(tmp_path / "job.py", textwrap.dedent(BATCH_NAN))
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (f,) = [f for f in nan_origin.analyze(RunDir(out)).findings if f.kind == "nan_origin"]
    assert f.message.startswith("The input batch of step 2 on rank 0 already contained "
                                "2 NaNs and 1 +Inf (before any op)"), f.message
    assert f.evidence["input_batch"] is True and f.evidence["module"] == nan_origin.MODEL
    assert f.evidence["step"] == 2 and f.evidence["created"] is False
    assert "No rank showed it being created" not in f.message


def _ddp_records(role="inputs", module="module", nan=1):
    """nan.jsonl of rank 0 of a DDP job whose step-4 batch held `nan` NaNs (the records
    probes/nan_watch.py writes: the root is DDP, its replay runs DDP's `module`)."""
    inputs = [{"dtype": "float32", "shape": [8, 32], "nan": nan, "posinf": 0, "neginf": 0,
               "max_abs": 3.02, "min": -2.29, "max": 3.02, "zeros": 0}]
    return [
        {"kind": "root", "step": 0, "module": "<DistributedDataParallel>",
         "module_class": "DistributedDataParallel", "replayable": True},
        {"kind": "nonfinite", "step": 4, "t_ns": 100, "phase": "forward", "role": "loss",
         "created": False, "module": "<loss>", "value": "nan"},
        {"kind": "origin", "step": 4, "t_ns": 100, "created": False, "phase": "forward",
         "module": module, "op": None, "role": role, "inputs": inputs, "value": "nan",
         "evidence": "the call's inputs were already non-finite (received)"},
    ]


def test_ddp_batch_nan_names_the_model_not_ddps_attribute():
    peer = [{"kind": "nonfinite", "step": 4, "t_ns": 200, "phase": "backward",
             "role": "parameter_grads", "created": False, "module": None, "value": "nan"}]
    o = nan_origin.find_origin({0: _ddp_records(), 1: peer}, {})
    assert o["input_batch"] and o["module"] == "<model>" and o["received_by"] == [1]
    msg = nan_origin.origin_finding(o).message
    assert msg.startswith("The input batch of step 4 on rank 0 already contained 1 NaN "
                          "(before any op)"), msg
    assert "Rank 1 received it." in msg and "in module" not in msg and "Ranks 1" not in msg


def test_submodule_inputs_are_not_called_the_batch():
    """A replayed call whose inputs were already bad but which is not the model's root (a
    submodule path) stays 'first seen in <path>'."""
    o = nan_origin.find_origin({0: _ddp_records(module="encoder.block")}, {})
    assert not o.get("input_batch") and o["module"] == "encoder.block"
    assert nan_origin.origin_finding(o).message.startswith("First nan on rank 0 at step 4")
