"""NaN/Inf origin and loss spikes: single-process scripts with known creations, synthetic loss
series, and the reference workload's injected faults (ground truth from the spec we inject)."""

from __future__ import annotations

import json
import sys
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import run_cli, write_script

from trainprof.analyzers import nan_origin
from trainprof.probes import nan_watch
from trainprof.analysis.run import RunDir

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


# loss spikes: tests/unit/analyzers/test_loss_spike.py


# --------------------------------------------------------------------------- reference


def _reference_origin(reference_run, tmp_path, tag, args, rank, step, module, phase, value, nproc=2):
    """Run the reference with one injected NaN/Inf, analyze it: (run, the nan_origin finding)."""
    spec = f"nan:rank={rank},step={step},module={module},phase={phase},value={value}"
    name = f"nan-{phase}-{value}-r{rank}" if tag == "pp" else f"nan-{tag}-{phase}-{value}-r{rank}"
    run = reference_run(name, nproc=nproc, args=args + ["--inject", spec], wrap_args=["--profile-steps", "none"])
    proc = run_cli(["analyze", run, "--out", tmp_path, "--no-report"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (f,) = [f for f in summary["findings"] if f["kind"] == "nan_origin"]
    return run, f


REF_ARGS = ["--dp", "1", "--pp", "2", "--tp", "1", "--steps", "3"]
CASES = [  # rank, step, module, phase, value, op that creates it in faults._corrupt
    (0, 2, "layers.1.mlp", "forward", "nan", "aten::log"),
    (1, 2, "layers.2.attn", "forward", "inf", "aten::mul"),
    (1, 2, "layers.3.mlp", "backward", "nan", "aten::log"),
]  # an Inf created in the backward: the tensor-parallel case below (aten::mul, layers.2.attn)


@pytest.mark.multiproc
@pytest.mark.parametrize("rank,step,module,phase,value,op", CASES,
                         ids=[f"{c[3]}-{c[4]}-rank{c[0]}" for c in CASES])
def test_reference_injected_nan_found(reference_run, tmp_path, rank, step, module, phase, value, op):
    run, f = _reference_origin(reference_run, tmp_path, "pp", REF_ARGS, rank, step, module, phase, value)
    injected = json.loads((run / "injected.json").read_text())["injections"][0]
    assert injected["params"]["module"] == module  # ground truth as the workload recorded it
    ev = f["evidence"]
    assert f["ranks"] == [rank]
    assert (ev["step"], ev["phase"], ev["module"], ev["op"]) == (step, phase, module, op)
    assert value in ev["value"].split("+") and ev["created"] is True
    assert ev["received_by"] == [1 - rank]   # the other stage inherits it through p2p
    assert f["severity"] == "critical"       # AdamW spreads it into the weights: no recovery


@pytest.mark.multiproc
def test_reference_clean_run_silent(reference_run, tmp_path):
    run = reference_run("clean8")
    proc = run_cli(["analyze", run, "--out", tmp_path, "--no-report"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not [f for f in summary["findings"] if f["kind"] in ("nan_origin", "loss_spike")]
    m = summary["metrics"]["nan_origin"]
    assert m["origin"] is None and m["ranks_watched"] == list(range(8))
    # the last pipeline stage (pp=1: ranks 2, 3, 6, 7) sees the loss at every step
    assert sorted(int(r) for r in m["loss"]) == [2, 3, 6, 7]
    assert all(len(v) == 8 and all(x[1] is not None for x in v) for v in m["loss"].values())


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


TP_ARGS = ["--dp", "1", "--pp", "1", "--tp", "2", "--steps", "3"]
TP_CASES = [  # a fault on one tensor-parallel rank; the peer receives it through the all-reduce
    (1, 1, "layers.1.mlp.up", "forward", "nan", "aten::log"),
]  # the backward case (Inf, aten::mul) runs on the FSDP2-over-TP mesh below


@pytest.mark.multiproc
@pytest.mark.parametrize("rank,step,module,phase,value,op", TP_CASES,
                         ids=[f"tp-{c[3]}-{c[4]}-rank{c[0]}" for c in TP_CASES])
def test_tensor_parallel_nan_found_by_coordinated_replay(reference_run, tmp_path, rank, step, module,
                                                         phase, value, op):
    """DTensor modules: both tensor-parallel ranks replay the step together (agreeing through the
    store first), so the op is named on the rank that created the value, and the peer reports
    that it arrived through the all-reduce."""
    run, f = _reference_origin(reference_run, tmp_path, "tp", TP_ARGS, rank, step, module, phase, value)
    ev = f["evidence"]
    assert f["ranks"] == [rank]
    assert (ev["step"], ev["phase"], ev["module"], ev["op"]) == (step, phase, module, op)
    assert ev["created"] is True and ev["method"] == "replay" and ev["received_by"] == [1 - rank]
    origins = [r for r in RunDir(run).stream(1 - rank, "nan") if r["kind"] == "origin"]
    assert origins and origins[0]["created"] is False and origins[0]["role"] == "collective"
    assert "all_reduce" in origins[0]["op"] and origins[0]["replayed_with"] == [0, 1]


FSDP_ARGS = ["--dp", "2", "--pp", "1", "--tp", "1", "--steps", "3"]
# (FSDP2 over TP on a 2-D mesh was tried by hand on dp2·tp2 and on the demo's dp2·pp2·tp2, see
# docs/nan.md; its peer set, the union of the meshes' ranks, is pinned by the unit test below.)


@pytest.mark.multiproc
def test_fsdp_nan_found_by_coordinated_replay(reference_run, tmp_path):
    """FSDP2 modules replay on both data-parallel ranks (FSDP's all-gathers run): an Inf created
    in rank 0's backward is named with its op; rank 1 reports the gradient reduction. The
    forward replay runs on both ranks too (the lockstep), finite."""
    rank, step, module = 0, 2, "layers.2.attn"
    run, f = _reference_origin(reference_run, tmp_path, "fsdp", FSDP_ARGS, rank, step, module,
                               "backward", "inf")
    ev = f["evidence"]
    assert f["ranks"] == [rank]
    assert (ev["step"], ev["phase"], ev["module"], ev["op"]) == (step, "backward", module, "aten::mul")
    assert ev["created"] is True and ev["method"] == "replay" and ev["received_by"] == [1]
    rd = RunDir(run)
    for r in (0, 1):
        (o,) = [x for x in rd.stream(r, "nan") if x["kind"] == "origin"]
        assert o["replayed_with"] == [0, 1] and o["replayed"] == o["root_calls"] > 0
    (o,) = [x for x in rd.stream(1, "nan") if x["kind"] == "origin"]
    assert o["created"] is False and "gradient reduction" in o["evidence"]
    # the replay's collectives (FSDP all-gathers) are in the log, marked, and out of the job's
    replayed = rd.frame("collectives")
    replayed = replayed[replayed["replay"].eq(True)] if "replay" in replayed else replayed.iloc[:0]
    assert set(replayed["rank"]) == {0, 1} and set(replayed["step"]) == {step}
    assert (replayed["op"] == "all_gather").any()
    assert len(rd.collectives()) == len(rd.frame("collectives")) - len(replayed)  # the job's only
    assert replayed.groupby("rank").size().nunique() == 1  # every peer replays the same calls


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


FSDP_STATE = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from trainprof.probes import nan_locate
from trainprof.probes.nan_values import _Root

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))


def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def state(m):
    return [p.detach().to_local().clone() for p in m.parameters()] + \
        [p.grad.to_local().clone() for p in m.parameters() if p.grad is not None]


replayed, bare = build(), build()  # twins: only the first is replayed, three times
xs = [torch.randn(4, 8) + rank for _ in range(2)]
out = replayed[0](xs[0])
out.retain_grad()
out.sum().backward()
bare[0](xs[0]).sum().backward()
before = state(replayed[0])
gathers = []
real = dist.all_gather_single  # what FSDP2 calls
dist.all_gather_single = lambda *a, **k: gathers.append(1) or real(*a, **k)
names = {m: n for n, m in replayed[0].named_modules()}
results = []
for peers, fail_backward in (([0, 1], False), ([rank], False), ([0, 1], True)):
    # 2nd: peers that exclude the other rank, so FSDP's first all-gather is refused mid-forward;
    # 3rd: a failure inside the replay's backward (after FSDP's pre-backward hooks ran)
    call = _Root(replayed[0], (xs[0],), None, [xs[0]._version], torch.get_rng_state(), None, peers)
    call.grads = {0: out.grad}
    real_check = nan_locate._GradProbe._check
    if fail_backward:
        nan_locate._GradProbe._check = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
    res = nan_locate.locate_step([call], names.get, loss_bad=False, grads_bad=False, coordinated=True)
    nan_locate._GradProbe._check = real_check
    results.append({"replayed": res["replayed"], "ops": res["ops_checked"], "notes": res["notes"],
                    "unchanged": all(torch.equal(a, b) for a, b in zip(before, state(replayed[0])))})
dist.all_gather_single = real
for m, opt in (replayed, bare):  # the job goes on: step, then one more forward/backward/step
    opt.step()
    opt.zero_grad()
    m(xs[1]).sum().backward()
    opt.step()
twins = all(torch.equal(a, b) for a, b in zip(state(replayed[0]), state(bare[0])))
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as fh:
    json.dump({"rank": rank, "results": results, "all_gathers": len(gathers), "twins": twins}, fh)
import gc
dist.barrier()
gc.collect()  # no gloo Work left alive at exit (a torch bug can abort the process there)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_fsdp_replay_leaves_the_job_state_alone(tmp_path):
    """A coordinated replay of an FSDP2 model (forward and backward, FSDP's all-gathers run) does
    not touch the sharded parameters or the gradients the optimizer is about to use — nor does
    one refused inside FSDP's forward hooks or failing inside the backward: the job's next steps
    match a twin model that was never replayed, bit for bit."""
    script = write_script(tmp_path / "fsdp_state.py", FSDP_STATE)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in rows:
        ok, refused, failed = r["results"]
        assert ok["replayed"] == 1 and ok["ops"] > 0, r  # (nothing non-finite to reproduce)
        assert ok["notes"] == ["the replay did not reproduce the non-finite value"], r
        assert "refused" in refused["notes"][0] and "beyond the replaying peers" in refused["notes"][0], r
        assert "replay failed" in failed["notes"][0] and "injected" in failed["notes"][0], r
        assert all(x["unchanged"] for x in r["results"]), r
        assert r["all_gathers"] >= 2 and r["twins"], r


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
