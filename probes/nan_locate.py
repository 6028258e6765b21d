"""Op-level localization of a non-finite value, run only after the module-level watch tripped.

``replay(module, args, kwargs, grad_outputs, phase)`` re-runs one module call (its hooks
included, so a fault injected by a hook fires again) on saved inputs under ``OpCheckMode``, a
TorchDispatchMode that checks every aten op: the first op whose output is non-finite although
all its tensor inputs were finite *created* the value; later ones only propagate it. It also sees
what module-level checks cannot: a value created and then masked (``where(x > 0, log(x), 0)``:
aten::log makes -inf, aten::where hides it, and the backward turns it into NaN).

Replays are side-effect free for the job: the RNG state is forked, gradients come from
``torch.autograd.grad`` (nothing accumulates into ``.grad``), and a replay is refused if the
module holds DTensor/FSDP state or reaches a collective (a one-rank replay of a collective would
hang its peers).
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose outputs are uninitialized memory or metadata: never a "creation".
SKIP_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
            "set_", "_local_scalar_dense", "detach", "alias", "lift_fresh", "_to_copy", "copy_"}
# Ops that legitimately write -inf as a mask (attention masks): -inf-only outputs are allowed.
MASK_OPS = {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full",
            "scalar_tensor", "index_fill", "index_fill_", "where", "masked_scatter", "clamp", "clamp_min"}
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor", "fsdp"}
MAX_OPS_RECORDED = 4


class ReplayRefused(RuntimeError):
    pass


def local(t):
    """The rank-local tensor of a DTensor (never reduce across ranks), else t."""
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t


def is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def stats(t) -> dict:
    """Evidence for one tensor (a few reductions; called only on the detection path)."""
    t = local(t).detach()
    d = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
    if not is_float(t) or t.numel() == 0:
        return d
    x = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    nan = int(torch.isnan(x).sum())
    posinf = int(torch.isposinf(x).sum())
    neginf = int(torch.isneginf(x).sum())
    fin = x[torch.isfinite(x)]
    d.update(nan=nan, posinf=posinf, neginf=neginf)
    if fin.numel():
        d.update(max_abs=float(fin.abs().max()), min=float(fin.min()), max=float(fin.max()),
                 zeros=int((fin == 0).sum()))
    return d


def value_kind(s: dict) -> str | None:
    kinds = [k for k, on in (("nan", s.get("nan")), ("inf", s.get("posinf")), ("-inf", s.get("neginf"))) if on]
    return "+".join(kinds) or None


def _finite(t) -> bool:
    t = local(t)
    if not is_float(t) or t.numel() == 0:
        return True
    return bool(torch.isfinite(t).all())


def _op_name(func) -> str:
    schema = getattr(func, "_schema", None)
    name = schema.name if schema is not None else str(func)
    return name  # e.g. "aten::log"


def _short(func) -> str:
    return _op_name(func).split("::")[-1]


def _overflow(func, args, kwargs, out_tensors) -> str | None:
    """For an op that produced +-inf from finite inputs: the true magnitude in higher precision."""
    dt = next((t.dtype for t in out_tensors if is_float(t)), None)
    if dt is None or dt.is_complex:
        return None
    wide = torch.float64  # bf16 shares fp32's exponent range: widen past both
    try:
        def up(x):
            return x.to(wide) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        res = func(*tree_map(up, args), **tree_map(up, kwargs))
        vals = [r for r in tree_flatten(res)[0] if isinstance(r, torch.Tensor) and r.is_floating_point()]
        if not vals:
            return None
        peak = max(float(v.abs().max()) for v in vals)
    except Exception:  # noqa: BLE001 - evidence only
        return None
    limit = torch.finfo(dt).max
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dt, str(dt))
    if math.isfinite(peak) and peak > limit:
        return f"{name} overflow: {peak:.2g} > {limit:.6g}"
    return None


class OpCheckMode(TorchDispatchMode):
    """Records, per phase, the ops that created non-finite values from finite inputs, and the
    ops that consumed a non-finite value yet produced a finite one (masking)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.created: list[dict] = []
        self.masked: list[dict] = []
        self.n_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", "aten")
        if ns in COLLECTIVE_NAMESPACES:
            raise ReplayRefused(f"replay reached collective {_op_name(func)}")
        short = _short(func)
        if short in SKIP_OPS:
            return func(*args, **kwargs)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        in_ok = all(_finite(t) for t in ins)  # before the op: in-place ops overwrite inputs
        in_stats = [stats(t) for t in ins if is_float(t)][:4] if in_ok else None
        out = func(*args, **kwargs)
        self.n_ops += 1
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_ok = all(_finite(t) for t in outs)
        if in_ok and not out_ok and len(self.created) < MAX_OPS_RECORDED:
            o = [stats(t) for t in outs if is_float(t)]
            neg_inf_only = all(not s.get("nan") and not s.get("posinf") for s in o)
            if not (short in MASK_OPS and neg_inf_only):
                rec = {"op": _op_name(func), "phase": self.phase, "inputs": in_stats,
                       "output": o[0] if o else None, "value": value_kind(o[0]) if o else None,
                       "index": self.n_ops}
                if any((s.get("posinf") or s.get("neginf")) and not s.get("nan") for s in o):
                    rec["overflow"] = _overflow(func, args, kwargs, outs)
                self.created.append(rec)
        elif not in_ok and out_ok and outs and len(self.masked) < MAX_OPS_RECORDED:
            self.masked.append({"op": _op_name(func), "phase": self.phase, "index": self.n_ops})
        return out


def _refuse_distributed(module) -> None:
    for t in list(module.parameters()) + list(module.buffers()):
        if hasattr(t, "_local_tensor") or hasattr(t, "device_mesh"):
            raise ReplayRefused("module holds DTensor parameters (TP/FSDP): a one-rank replay "
                                "would issue collectives its peers never join")
    for m in module.modules():
        if type(m).__name__.startswith("FSDP") or hasattr(m, "_get_fsdp_state"):
            raise ReplayRefused("module is managed by FSDP: replay would all-gather parameters")


def replay(module, args, kwargs, grad_outputs=None, phase="forward") -> dict:
    """Re-run one module call under OpCheckMode. ``args``/``kwargs`` are the saved inputs (they
    are cloned again here); ``grad_outputs`` (list aligned with the module's floating outputs
    that require grad) drives the backward when phase == "backward"."""
    _refuse_distributed(module)

    def fresh(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_(x.requires_grad) if is_float(y) else y
        return x

    args, kwargs = tree_map(fresh, args), tree_map(fresh, kwargs)
    mode = OpCheckMode()
    devices = [t.device.index for t in tree_flatten(args)[0]
               if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    with torch.random.fork_rng(devices=sorted({d for d in devices if d is not None})):
        with torch.enable_grad(), mode:
            out = module(*args, **kwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            out_finite = all(_finite(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            if phase == "backward" and grad_outputs:
                # grad_outputs[i] belongs to the i-th floating output (None: no gradient seen)
                pairs = [(t, grad_outputs[i] if i < len(grad_outputs) else None)
                         for i, t in enumerate(outs) if t.requires_grad]
                out_t = [t for t, _ in pairs]
                gos = [g if g is not None else torch.zeros_like(t) for t, g in pairs]
                ins = [t for t in tree_flatten((args, kwargs))[0] if is_float(t) and t.requires_grad]
                params = [p for p in module.parameters() if p.requires_grad]
                if out_t:
                    mode.phase = "backward"
                    torch.autograd.grad(out_t, ins + params, grad_outputs=gos, allow_unused=True)
    hidden = [c for c in mode.created if c["phase"] == "forward"] if out_finite else []
    return {"created": mode.created, "masked": mode.masked, "ops": mode.n_ops,
            "forward_output_finite": out_finite, "hidden": hidden}


def summarize(result: dict, phase: str) -> dict:
    """The op to name: a creation hidden by masking in the forward is the root cause of a NaN
    that only shows in the backward; else the first creation in the failing phase."""
    created = result.get("created") or []
    in_phase = [c for c in created if c["phase"] == phase]
    hidden = result.get("hidden") or []
    root = hidden[0] if (phase == "backward" and hidden) else (in_phase[0] if in_phase else
                                                                (created[0] if created else None))
    out = {"op": root["op"] if root else None, "op_phase": root["phase"] if root else None,
           "op_inputs": root.get("inputs") if root else None,
           "op_output": root.get("output") if root else None,
           "op_value": root.get("value") if root else None,
           "overflow": root.get("overflow") if root else None,
           "ops_checked": result.get("ops")}
    if root is not None and root in hidden:
        masked = [m for m in result.get("masked") or [] if m["phase"] == "forward"
                  and m["index"] > root["index"]]
        out["hidden_by"] = masked[0]["op"] if masked else None
        if in_phase:
            out["backward_op"] = in_phase[0]["op"]
            out["backward_value"] = in_phase[0].get("value")
    return out
