"""NaN/Inf origin found in single-process scripts with known creations, fp32 norms per dtype,
replay decisions and loss series."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import write_script
from trainprof.analysis.run import RunDir
from trainprof.analyzers import nan_origin
from trainprof.probes import nan_watch


SCRIPT_HEAD = """
import sys, torch, torch.nn as nn, trainprof
torch.manual_seed(0)
"""


def _run_script(tmp_path: Path, body: str) -> Path:
    out = tmp_path / "run"
    script = write_script(tmp_path / "job.py", SCRIPT_HEAD + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _analyze(run: Path):
    res = nan_origin.analyze(RunDir(run))
    return res, [f for f in res.findings if f.kind == "nan_origin"], \
        [f for f in res.findings if f.kind == "loss_spike"]


MASKED_LOG = """
class MaskedLog(nn.Module):
    def forward(self, x):
        return torch.where(x > 0, torch.log(x), 0.0)

class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.inp = nn.Linear(8, 8); s.mlog = MaskedLog(); s.out = nn.Linear(8, 1)
        s.register_buffer("keep", (torch.arange(8) % 3 != 0).float())  # a padding mask
    def forward(s, x):
        return s.out(s.mlog(s.inp(x).abs() * s.keep))   # exact zeros reach the log

net = Net(); opt = torch.optim.SGD(net.parameters(), lr=0.01)
with trainprof.session(sys.argv[1], profile_steps="none"):
    for step in range(3):
        loss = net(torch.randn(16, 8)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
"""


def _check_masked_log(f):
    ev = f.evidence
    # the forward output is finite (where hides log(0) = -inf); the backward's 0 * (1/0) makes
    # NaN in the gradient w.r.t. mlog's input, which reaches inp's parameters
    assert ev["module"] == "mlog" and ev["phase"] == "backward" and ev["step"] == 0
    assert ev["created"] is True and ev["value"] == "nan"
    assert ev["op"] == "aten::log" and ev["op_value"] == "-inf"
    assert ev["hidden_by"] == "aten::where" and ev["backward_op"] == "aten::div"
    # 16 rows x 3 masked columns reach the log as exact zeros, nothing negative
    assert ev["op_inputs"][0]["zeros"] == 48 and ev["op_inputs"][0]["min"] == 0.0
    assert f.ranks == [0]


def test_masked_log_found_by_replay(tmp_path):
    run = _run_script(tmp_path, MASKED_LOG)
    _, origin, spikes = _analyze(run)
    assert len(origin) == 1 and not spikes
    _check_masked_log(origin[0])
    assert origin[0].evidence["method"] == "replay"
    (o,) = [r for r in RunDir(run).stream(0, "nan") if r["kind"] == "origin"]
    assert o["at"] == "optimizer pre-step" and o["detected_by"] == "parameter_grads"
    # the loss stayed finite: only the gradients showed it
    assert o["loss_nonfinite"] is False and o["grads_nonfinite"] is True
    # the replay ran inside step 0 (the optimizer pre-step hook): its span is recorded, its time
    # booked as the step's probe overhead, and step statistics leave the step out
    r = RunDir(run)
    ((kind, a, b),) = [(x["kind"], x["start_ns"], x["end_ns"]) for x in r.rank_meta(0)["overhead_spans"]]
    step0 = next(x for x in r.stream(0, "steps") if x["step"] == 0)
    assert kind == "nan_replay" and step0["start_ns"] <= a < b <= step0["end_ns"]
    assert (b - a) / 1e6 <= o["replay_ms"] <= (b - a) / 1e6 + 50  # (replay_ms: the record's too)
    assert step0["probe_overhead_ms"] >= (b - a) / 1e6
    from trainprof.analyzers import step_time
    assert step_time.analyze(r).metrics["excluded_steps"]["nan_replay"] == [0]


WEIGHT_GRAD_OVERFLOW = """
net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
with trainprof.session(sys.argv[1], profile_steps="none"):
    for step in range(3):
        x = torch.randn(8, 4)
        if step == 1:  # huge finite inputs, tiny weights: activations and input-gradients stay
            x = torch.full((8, 4), 3e38)  # finite, the first layer's weight gradient (8 rows
            with torch.no_grad():         # of ~1 x 3e38 summed) not
                net[0].weight.fill_(1e-39)
                net[2].weight.fill_(1.0)
        loss = net(x).sum() * 10
        loss.backward(); opt.step(); opt.zero_grad()
"""


def test_weight_gradient_only_overflow_named(tmp_path):
    """Only a parameter gradient overflows (the weight-gradient matmul sums 8 rows of 3e38): the
    replay's per-parameter gradient hooks see it although nothing flowing back is non-finite."""
    run = _run_script(tmp_path, WEIGHT_GRAD_OVERFLOW)
    _, origin, _ = _analyze(run)
    (f,) = origin
    ev = f.evidence
    assert (ev["step"], ev["phase"], ev["role"], ev["module"]) == (1, "backward", "parameter_grads", "0")
    assert ev["created"] is True and ev["op"] == "aten::mm" and ev["grad"]["posinf"] + ev["grad"]["neginf"] > 0
    assert ev["params_nonfinite"] >= 1 and ev["value"] == "inf"


def test_fp32_norms_per_dtype():
    """The gradient and parameter checks' norms: hand-computed values in every floating dtype,
    list order kept across dtype groups, NaN/Inf propagated per tensor, no fp16 overflow for a
    finite norm above 65504 (bf16 is normed in bf16: its result is rounded to 8 bits)."""
    import math

    import torch

    ts = [torch.full((100, 1000), 300.0, dtype=torch.float16),   # 300 * sqrt(1e5) > 65504
          torch.full((4,), 3.0, dtype=torch.bfloat16),            # 6
          torch.tensor([3.0, 4.0]),                               # 5
          torch.full((1000,), 1.0, dtype=torch.bfloat16),         # sqrt(1000) = 31.62
          torch.tensor([1.0, float("nan")], dtype=torch.bfloat16),
          torch.tensor([1.0, float("inf")], dtype=torch.float16),
          torch.tensor([float("-inf"), 2.0])]
    got = nan_watch.fp32_norms(torch, ts, 2)
    assert all(n.dtype == torch.float32 and n.dim() == 0 for n in got)
    want = [300 * math.sqrt(1e5), 6.0, 5.0, math.sqrt(1000)]
    for n, w in zip(got, want):
        assert abs(float(n) / w - 1) < 2 ** -8
    assert math.isnan(float(got[4])) and float(got[5]) == math.inf and float(got[6]) == math.inf
    inf = nan_watch.fp32_norms(torch, ts, math.inf)
    assert [float(x) for x in inf[:4]] == [300.0, 3.0, 4.0, 1.0]
    assert math.isnan(float(inf[4])) and float(inf[5]) == math.inf == float(inf[6])
    # no bf16 in the list: one call, the fp32 result as it always was
    assert float(nan_watch.fp32_norms(torch, ts[2:3], 2)[0]) == 5.0


LOW_PRECISION_GRADS = """
dtype = getattr(torch, sys.argv[2])
net = nn.Linear(1000, 100, bias=False).to(dtype)
with torch.no_grad():
    net.weight.zero_()
opt = torch.optim.SGD(net.parameters(), lr=0.0)
with trainprof.session(sys.argv[1], profile_steps="none"):
    for step in range(4):
        net(torch.full((1, 1000), 300.0, dtype=dtype)).sum().backward()  # every grad 300
        if step == 2:
            net.weight.grad[3, 7] = float("nan")  # corrupted between the backward and the step
        opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_low_precision_gradients_checked(tmp_path, dtype):
    """fp16/bf16/fp32 gradients: a finite gradient norm above fp16's max (94,868) is finite and
    reported within the dtype's rounding; the one NaN element is found at its step."""
    import math

    run = _run_script(tmp_path, LOW_PRECISION_GRADS.replace("sys.argv[2]", repr(dtype)))
    recs = list(RunDir(run).stream(0, "nan"))
    steps = {r["step"]: r for r in recs if r["kind"] == "step"}
    assert sorted(steps) == [0, 1, 2, 3]
    for s in (0, 1):
        assert steps[s]["grad_finite"] is True and steps[s]["loss_finite"] is True
        assert abs(steps[s]["grad_norm"] / (300 * math.sqrt(1e5)) - 1) < 2 ** -8
    assert steps[2]["grad_finite"] is False and steps[2]["grad_norm"] is None
    bad = [r for r in recs if r["kind"] == "nonfinite"]
    assert (bad[0]["step"], bad[0]["role"], bad[0]["value"]) == (2, "parameter_grads", "nan")
    assert bad[0]["params_nonfinite"] == 1 and bad[0]["first_params"] == ["weight"]
    # SGD wrote 0 * NaN into the weight: step 3's loss is the next to show it
    assert steps[3]["loss_finite"] is False


def test_masked_log_found_by_module_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPROF_NAN_MODULES", "all")  # the always-on module-level mode
    run = _run_script(tmp_path, MASKED_LOG)
    _, origin, _ = _analyze(run)
    assert len(origin) == 1
    _check_masked_log(origin[0])
    assert origin[0].evidence["method"] == "module flags"


OVERFLOW = """
dtype = getattr(torch, sys.argv[2])
big = float(sys.argv[3])

class Square(nn.Module):
    def forward(self, x):
        return x * x

class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.inp = nn.Linear(4, 4); s.sq = Square(); s.out = nn.Linear(4, 1)
    def forward(s, x):
        h = s.inp(x)
        return s.out(s.sq(h.to(dtype)).float())

net = Net()
with trainprof.session(sys.argv[1], profile_steps="none"):
    for step in range(4):
        x = torch.randn(8, 4) * (big if step == 2 else 0.1)
        loss = net(x).pow(2).mean()
        loss.backward()
        with torch.no_grad():   # hand-written SGD that, like AMP's GradScaler, skips overflowed steps
            if all(torch.isfinite(p.grad).all() for p in net.parameters()):
                for p in net.parameters():
                    p -= 0.01 * p.grad
            for p in net.parameters():
                p.grad = None
        trainprof.step()        # explicit step boundary (no optimizer)
"""


@pytest.mark.parametrize("dtype,big,limit", [("float16", "1000", "65504"),
                                             ("bfloat16", "1e21", "3.38953e+38")])
def test_low_precision_overflow_evidence(tmp_path, dtype, big, limit):
    body = OVERFLOW.replace("sys.argv[2]", repr(dtype)).replace("sys.argv[3]", repr(big))
    run = _run_script(tmp_path, body)
    _, origin, _ = _analyze(run)
    assert len(origin) == 1
    ev = origin[0].evidence
    assert ev["step"] == 2 and ev["phase"] == "forward" and ev["module"] == "sq"
    assert ev["op"] == "aten::mul" and "inf" in ev["value"]
    short = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    assert ev["overflow"].startswith(f"{short} overflow: ") and ev["overflow"].endswith(f"> {limit}")
    # the true magnitude, recomputed in fp32, is above the dtype's max
    true = float(ev["overflow"].split(": ")[1].split(" >")[0])
    assert true > float(limit)
    assert ev["op_inputs"][0]["dtype"] == dtype
    assert ev["recovered"] is True and origin[0].severity == "warning"  # later steps finite


CLEAN = """
net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
with trainprof.session(sys.argv[1], profile_steps="none"):
    for step in range(12):
        loss = net(torch.randn(32, 8)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
"""


def test_clean_script_silent_and_records_every_step(tmp_path):
    run = _run_script(tmp_path, CLEAN)
    res, origin, spikes = _analyze(run)
    assert not origin and not spikes
    steps = [r for r in RunDir(run).stream(0, "nan") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(12))
    assert all(r["loss_finite"] and r["grad_finite"] and r["modules_finite"] for r in steps)
    # parameters: checked on step 0, then every params_every steps (amortized to 0.1 % of a step)
    checked = [r["step"] for r in steps if r["params_finite"] is not None]
    assert checked[0] == 0 and all(r["params_finite"] in (True, None) for r in steps)
    for a, b in zip(checked, checked[1:]):
        assert b - a == steps[a]["params_every"] <= nan_watch.PARAM_MAX_INTERVAL
    assert all(r["root_calls"] == 1 and r["mode"] == "replay" for r in steps)  # the Sequential
    assert not [r for r in RunDir(run).stream(0, "nan") if r["kind"] in ("nonfinite", "origin")]


# the clean job with one change: a broken schedule sets lr = NaN for step 6 (finite gradients)
BAD_LR = CLEAN.replace("loss.backward(); opt.step()", """loss.backward()
        opt.param_groups[0]["lr"] = float("nan") if step == 6 else 1e-3
        opt.step()""")
assert BAD_LR != CLEAN


def test_optimizer_phase_from_stale_parameters(tmp_path):
    """Finite gradients, NaN update at step 6. The parameter check runs every k-th step on such
    tiny steps, so the next forward's loss detects it; the finding must blame the optimizer and
    the parameter, not the first module that reads it (whose activations are finite)."""
    # the parameter pass every PARAM_MAX_INTERVAL steps whatever the machine's load (its
    # interval adapts to step time: a loaded machine could otherwise check step 6 itself)
    run = _run_script(tmp_path, "import trainprof.probes.nan_watch as nw; nw.PARAM_BUDGET = 1e-12\n"
                      + textwrap.dedent(BAD_LR))
    _, origin, _ = _analyze(run)
    assert len(origin) == 1
    ev = origin[0].evidence
    assert ev["phase"] == "optimizer" and ev["role"] == "parameters" and ev["module"] == "0"
    assert ev["param"] == "0.weight" and ev["value"] == "nan"
    lo, hi = ev["origin_steps"]
    assert lo <= 6 <= hi and ev["step"] == hi + 1  # detected by the next step's forward
    assert "optimizer step" in origin[0].message


def test_replay_peers_are_the_union_of_the_parameter_meshes():
    """FSDP2 over TP: the TP weights live on the 2-D (dp, tp) mesh, the norms on a 1-D dp
    sub-mesh; the replay must run on every rank of either. FSDP1 is refused."""
    import torch

    class Mesh:
        def __init__(self, ranks):
            self.mesh = torch.tensor(ranks)

    class P:  # what _refusal reads of a DTensor parameter
        def __init__(self, ranks):
            self.device_mesh, self._local_tensor = Mesh(ranks), None

    class M(torch.nn.Module):
        def __init__(self, params):
            super().__init__()
            self.fake = params

        def parameters(self, recurse=True):
            return iter(self.fake)

    refusal = nan_watch.NanWatch._refusal
    assert refusal(None, M([P([[0, 1], [4, 5]]), P([0, 4])])) == (None, [0, 1, 4, 5])
    assert refusal(None, M([P([2, 3])])) == (None, [2, 3])
    assert refusal(None, M([P([3])])) == (None, None)        # a one-rank mesh: a local replay
    assert refusal(None, torch.nn.Linear(2, 2)) == (None, None)

    class FullyShardedDataParallel(torch.nn.Module):
        pass

    why, peers = refusal(None, FullyShardedDataParallel())
    assert "FSDP1" in why and peers is None


def test_stale_parameter_check_and_replay_decision_units():
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from trainprof.probes import nan_locate

    class Call:  # what nonfinite_parameters reads of a root call
        def __init__(self, module):
            self.module = module

    m = torch.nn.Linear(2, 2)
    m.register_buffer("mask", torch.full((2, 2), float("-inf")).triu(1))  # a causal mask
    assert nan_locate.nonfinite_parameters([Call(m)], lambda t: None) == []
    with torch.no_grad():
        m.weight[0, 0] = float("nan")
    (bad,) = nan_locate.nonfinite_parameters([Call(m)], lambda t: None)
    assert bad["param"] == "weight" and bad["nan"] == 1

    # coordinated replay: the first proposal stored wins, a later "go" cannot override an abort
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5))
    assert nan_watch.NanWatch._decide(None, store, "p/", "abort", "timed out") == (False, "timed out")
    assert nan_watch.NanWatch._decide(None, store, "p/", "go", None)[0] is False
    assert nan_watch.NanWatch._decide(None, store, "q/", "go", None) == (True, None)


def test_loss_series_with_a_repeated_step_lacking_a_loss():
    # a step recorded twice, once without a loss: ordered by step, never by comparing losses
    recs = {0: [{"kind": "step", "step": 1, "loss": 0.5}, {"kind": "step", "step": 0, "loss": 0.7},
                {"kind": "step", "step": 1, "loss": None}, {"kind": "step", "step": 2, "loss": 0.4}]}
    assert nan_origin.loss_series(recs) == {0: [[0, 0.7], [1, 0.5], [1, None], [2, 0.4]]}
