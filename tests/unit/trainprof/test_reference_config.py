"""The reference job's configuration without running it: fault specs, layer layout, looped stages,
bad layouts refused."""

from __future__ import annotations

import pytest

from trainprof.reference.faults import FaultSpecError, parse
from trainprof.reference.parallel import layer_layout, stage_ids


def test_fault_specs_are_validated():
    f = parse("straggler:rank=3,delay_ms=150")
    assert f.params == {"rank": 3, "delay_ms": 150.0, "from_step": 0}
    assert parse("nan:rank=1,step=4,module=layers.1.mlp").params["phase"] == "forward"
    for bad, msg in [("bogus:rank=1", "unknown kind"), ("straggler:rank=1", "missing delay_ms"),
                     ("nan:rank=1,step=2,module=x,phase=sideways", "phase must be"),
                     ("hang:rank=x,step=1", "rank must be an integer"),
                     ("slow_data:rank=1,delay_ms=5,color=red", "not 'color'"),
                     ("imbalance:stage=0,extra_layers=0", "extra_layers must be >= 1"),
                     ("straggler:rank=-1,delay_ms=5", "rank must be >= 0")]:
        with pytest.raises(FaultSpecError, match=msg):
            parse(bad)


def test_fault_specs_are_checked_against_the_model_and_layout():
    from trainprof.reference.config import parse_args
    from trainprof.reference.faults import module_stage, validate
    from trainprof.reference.model import build_full

    cfg = parse_args(["--pp", "2", "--tp", "2"])
    layout = layer_layout(4, 2, {})
    full = build_full(cfg, 4)

    def coords_of(r):
        return {"dp": r // 4, "pp": (r // 2) % 2, "tp": r % 2}

    def check(spec):
        validate([parse(spec)], full, layout, pp=2, steps=5, world=4, coords_of=coords_of)

    assert [module_stage(p, layout) for p in ("tok_emb", "layers.1.mlp.up", "layers.2", "head")] == [0, 0, 1, 1]
    check("nan:rank=2,step=4,module=layers.3.attn.o,phase=backward")  # stage 1 is on ranks 2, 3
    for bad, msg in [("nan:rank=0,step=1,module=layers.9.mlp", "no module 'layers.9.mlp'"),
                     ("nan:rank=1,step=1,module=head", r"stage 1, which rank 1 does not hold \(ranks \[2, 3\]"),
                     ("nan:rank=0,step=1,module=tok_emb,phase=backward", "no input gradient"),
                     ("hang:rank=0,step=5", "outside the run's steps 0..4"),
                     ("straggler:rank=0,delay_ms=5,from_step=7", "from_step=7 is outside")]:
        with pytest.raises(FaultSpecError, match=msg):
            check(bad)


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
