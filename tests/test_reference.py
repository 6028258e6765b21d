"""The reference workload: the parallelism is real (losses match the unsharded model), fault
specs are validated, and each injected fault is observable in the raw captured data."""

from __future__ import annotations

import json
import math

import pytest

from trainprof.reference.faults import FaultSpecError, parse
from trainprof.reference.parallel import layer_layout, stage_ids

# dp2·pp2·tp2 vs one process, fp32 on CPU: measured agreement is ~1e-8 relative (reduction order
# differs: TP row-parallel all-reduce, FSDP reduce-scatter, micro-batch accumulation).
LOSS_RTOL = 1e-5


def _losses(run):
    return [json.loads(x) for x in (run / "loss.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
def test_losses_of_dp2_pp2_tp2_match_a_single_process(reference_run):
    single = reference_run("single", nproc=1,
                           args=["--steps", "3", "--loss-file", "{out}/loss.jsonl"])
    three_d = reference_run("clean8")
    a, b = _losses(single)[:3], _losses(three_d)[:3]
    assert [x["step"] for x in a] == [x["step"] for x in b] == [0, 1, 2]
    for x, y in zip(a, b):
        assert math.isfinite(x["loss"])
        assert y["loss"] == pytest.approx(x["loss"], rel=LOSS_RTOL), (x, y)
    assert a[2]["loss"] < a[0]["loss"]  # it trains


@pytest.mark.multiproc
def test_run_info_and_injected_json(reference_run):
    run = reference_run("clean8")
    meta = json.loads((run / "ranks" / "rank-00007" / "meta.json").read_text())
    info = meta["run_info"]
    assert info["dp"] == info["pp"] == info["tp"] == 2
    assert info["tokens_per_step"] == 16 * 32 and info["schedule"] == "1f1b"
    assert info["n_params"] > info["n_params_non_embedding"] > 0
    assert json.loads((run / "injected.json").read_text())["injections"] == []


@pytest.mark.multiproc
def test_injections_are_observable_in_raw_data(reference_run):
    """One 4-rank run (dp1·pp2·tp2) with a straggler, a NaN, an imbalanced stage and slow data."""
    run = reference_run("faults4", nproc=4, args=[
        "--dp", "1", "--pp", "2", "--tp", "2", "--steps", "7", "--loss-file", "{out}/loss.jsonl",
        "--inject", "straggler:rank=1,delay_ms=300",
        "--inject", "slow_data:rank=2,delay_ms=300",
        "--inject", "imbalance:stage=1,extra_layers=2",
        "--inject", "nan:rank=3,step=5,module=layers.4.mlp,phase=forward,value=inf",
        "--inject", "fragment:rank=0"])
    inj = {i["kind"]: i for i in json.loads((run / "injected.json").read_text())["injections"]}
    assert inj["straggler"]["coords"] == {"dp": 0, "pp": 0, "tp": 1}
    assert inj["imbalance"]["layers_per_stage"] == [2, 4] and inj["imbalance"]["ranks"] == [2, 3]
    assert inj["fragment"]["performed"] is False and "CPU" in inj["fragment"]["reason"]
    # NaN: the loss is finite before step 5 and not from then on
    losses = [x["loss"] for x in _losses(run)]
    assert all(math.isfinite(v) for v in losses[:5]) and not math.isfinite(losses[5])
    # the stage with 2 extra layers holds 4 blocks: its ranks report it
    info = json.loads((run / "ranks" / "rank-00002" / "meta.json").read_text())["run_info"]
    assert info["stage_layers"] == [2, 4] and info["my_stages"] == [1]
    # straggler: the profiler shows ≥300 ms more aten compute per step on rank 1 than on rank 0
    # (its TP peer, same work otherwise); slow data: rank 2 waits ≥300 ms in the DataLoader
    import gzip

    def op_ms(rank, pred):
        """ms per profiled step in host ops matching pred (read straight from the Chrome trace)."""
        with gzip.open(run / "profiler" / f"rank-{rank:05d}.pt.trace.json.gz") as fh:
            events = json.load(fh)["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        total = sum(e["dur"] for e in events if e.get("ph") == "X" and pred(e.get("name", "")))
        return total / 1e3 / max(len(steps), 1)

    def is_tanh(n):
        return n == "aten::tanh"

    def is_loader(n):
        return n.startswith("enumerate(DataLoader)")

    assert op_ms(1, is_tanh) > 100 and op_ms(0, is_tanh) < 5  # the straggler's compute loop
    assert op_ms(2, is_loader) >= 300 * 0.9 and op_ms(3, is_loader) < 100


def test_fault_specs_are_validated():
    f = parse("straggler:rank=3,delay_ms=150")
    assert f.params == {"rank": 3, "delay_ms": 150.0, "from_step": 0}
    assert parse("nan:rank=1,step=4,module=layers.1.mlp").params["phase"] == "forward"
    for bad, msg in [("bogus:rank=1", "unknown kind"), ("straggler:rank=1", "missing delay_ms"),
                     ("nan:rank=1,step=2,module=x,phase=sideways", "phase must be"),
                     ("hang:rank=x,step=1", "rank must be an integer"),
                     ("slow_data:rank=1,delay_ms=5,color=red", "not 'color'")]:
        with pytest.raises(FaultSpecError, match=msg):
            parse(bad)


def test_layer_layout_and_looped_stages():
    assert layer_layout(4, 2, {}) == [[0, 1], [2, 3]]
    assert layer_layout(5, 2, {}) == [[0, 1, 2], [3, 4]]
    assert layer_layout(4, 2, {1: 2}) == [[0, 1], [2, 3, 4, 5]]
    assert stage_ids(1, 2, 2) == [1, 3]


def test_cli_rejects_bad_layouts():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "trainprof.reference", "--hidden", "96", "--heads", "6", "--tp", "4"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "divisible by --tp" in p.stderr
