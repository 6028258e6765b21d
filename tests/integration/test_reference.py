"""The reference workload: the parallelism is real (losses match the unsharded model), fault
specs are validated, and each injected fault is observable in the raw captured data.

Single-process cases: tests/unit/trainprof/test_reference_config.py."""

from __future__ import annotations

import json
import math

import pytest


# dp2·pp2·tp2 (and dp2·pp2 interleaved, replicate) vs one process, fp32 on CPU: measured
# agreement is <= 1e-7 relative (bit-identical on some steps; reduction order differs: TP
# row-parallel all-reduce, FSDP reduce-scatter, micro-batch accumulation).
LOSS_RTOL = 1e-5
SINGLE = {"nproc": 1, "args": ["--steps", "3", "--loss-file", "{out}/loss.jsonl"]}


def _losses(run):
    return [json.loads(x) for x in (run / "loss.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
def test_losses_of_dp2_pp2_tp2_match_a_single_process(reference_run):
    single = reference_run("single", **SINGLE)
    _assert_same_losses(_losses(single), _losses(reference_run("clean8")))
    assert _losses(single)[2]["loss"] < _losses(single)[0]["loss"]  # it trains


@pytest.mark.multiproc
@pytest.mark.long  # a check of the reference job itself (a fixture): benchmarks/long_tests.py
def test_losses_of_interleaved_replicate_match_a_single_process(reference_run):
    """The other code paths: interleaved 1F1B with 2 virtual stages per rank, DDP-style grads."""
    run = reference_run("interleaved-replicate4", nproc=4, wrap_args=["--profile-steps", "none"],
                        args=["--dp", "2", "--pp", "2", "--tp", "1", "--schedule", "interleaved1f1b",
                              "--virtual-stages", "2", "--dp-mode", "replicate", "--steps", "3",
                              "--loss-file", "{out}/loss.jsonl"])
    _assert_same_losses(_losses(reference_run("single", **SINGLE)), _losses(run))
    info = json.loads((run / "ranks" / "rank-00001" / "meta.json").read_text())["run_info"]
    assert info["my_stages"] == [1, 3] and info["stage_layer_ids"] == [[0], [1], [2], [3]]


def _assert_same_losses(a, b):
    a, b = a[:3], b[:3]
    assert [x["step"] for x in a] == [x["step"] for x in b] == [0, 1, 2]
    for x, y in zip(a, b):
        assert math.isfinite(x["loss"])
        assert y["loss"] == pytest.approx(x["loss"], rel=LOSS_RTOL), (x, y)


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
@pytest.mark.long  # the reference job's own ground truth (a fixture check): benchmarks/long_tests.py
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
    # Read straight from the Chrome traces. Each ProfilerStep span opens at the optimizer step;
    # the end-of-step collectives, then the straggler's compute loop, then the DataLoader fetch
    # follow. The loop runs until a perf_counter deadline, so its wall time is >= delay_ms even
    # on a loaded host: rank 1's gap before the fetch is >= 300 ms (and well above its TP peer's) and
    # holds matmuls, rank 0's none. Slow data: rank 2 spends >= 300 ms per step in the fetch.
    import gzip

    def trace(rank):
        with gzip.open(run / "profiler" / f"rank-{rank:05d}.pt.trace.json.gz") as fh:
            return [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]

    def before_fetch(rank):
        """Per profiled step: (ms from step start to the DataLoader fetch, aten::mm ops in between)."""
        ev = trace(rank)
        fetches = sorted(e["ts"] for e in ev if e["name"].startswith("enumerate(DataLoader)"))
        out = []
        for st in (e for e in ev if e["name"].startswith("ProfilerStep#")):
            fetch = next((t for t in fetches if t >= st["ts"]), None)
            if fetch is not None and fetch < st["ts"] + st["dur"]:
                mm = sum(1 for e in ev if e["name"] == "aten::mm" and st["ts"] <= e["ts"] < fetch)
                out.append(((fetch - st["ts"]) / 1e3, mm))
        return out

    def fetch_ms(rank):
        ev = trace(rank)
        n = sum(1 for e in ev if e["name"].startswith("ProfilerStep#"))
        return sum(e["dur"] for e in ev if e["name"].startswith("enumerate(DataLoader)")) / 1e3 / n

    slow, peer = before_fetch(1), before_fetch(0)
    assert slow and len(slow) == len(peer)
    for (gap_s, mm_s), (gap_p, mm_p) in zip(slow, peer):
        assert gap_s >= 300 and gap_s - gap_p >= 150 and mm_s > 10 and mm_p == 0, (slow, peer)
    assert fetch_ms(2) >= 300 * 0.95 and fetch_ms(3) < 100


