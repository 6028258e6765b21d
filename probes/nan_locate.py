"""Op-level localization of a non-finite value, run only after the module-level watch tripped.

``replay(module, args, kwargs, grad_outputs, phase)`` re-runs one module call (its hooks
included, so a fault injected by a hook fires again) on saved inputs under ``OpCheckMode``, a
TorchDispatchMode that checks every aten op: the first op whose output is non-finite although
all its tensor inputs were finite *created* the value; later ones only propagate it. It also sees
what module-level checks cannot: a value created and then masked (``where(x > 0, log(x), 0)``:
aten::log makes -inf, aten::where hides it, and the backward turns it into NaN).

Replays are side-effect free for the job: the RNG state is forked, gradients come from
``torch.autograd.grad`` (nothing accumulates into ``.grad``), and a one-rank replay is refused if
the module holds DTensor/FSDP state or reaches a collective (its peers would never join).
Tensor-parallel modules are replayed by all ranks of their mesh together (``coordinated``, after
an agreement through the store in nan_watch), collectives included.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from trainprof.probes.nan_values import tensors_in

# Ops whose outputs are uninitialized memory or metadata: never a "creation".
SKIP_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
            "set_", "_local_scalar_dense", "detach", "alias", "lift_fresh", "_to_copy", "copy_"}
# Ops that legitimately write -inf as a mask (attention masks): -inf-only outputs are allowed.
MASK_OPS = {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full",
            "scalar_tensor", "index_fill", "index_fill_", "where", "masked_scatter", "clamp", "clamp_min"}
# (FSDP2's "fsdp" ops — all_gather_copy_in, split_with_sizes_copy, chunk_cat — are local copies
# around its c10d collectives: checked like aten ops.)
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor",
                         "_c10d_functional_autograd"}
FUNCOL_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd"}  # out-of-place, waitable
FUNCOL_PLUMBING = {"wait_tensor", "_wrap_tensor_autograd"}
MAX_OPS_RECORDED = 4
TAG = "trainprof_module"  # autograd-node metadata key: the module whose forward made the node


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
    if any(hasattr(t, "_local_tensor") for t in tree_flatten((args, kwargs))[0]):
        return None  # recomputing a DTensor op could redistribute: a collective on one rank only
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

    def __init__(self, tracker=None, peers=()):
        super().__init__()
        self.peers = set(peers)  # coordinated replay: these ranks run the same collectives
        self.phase = "forward"
        self.created: list[dict] = []
        self.masked: list[dict] = []
        self.received: list[dict] = []  # collectives whose result turned non-finite (from peers)
        self.n_ops = 0
        self.quiet = 0          # >0 while the replay's own bookkeeping runs ops
        self.tracker = tracker  # module attribution (forward: module stack; backward: node tag)

    def _where(self):
        if self.tracker is None:
            return None
        if self.phase == "forward":
            return self.tracker.stack[-1] if self.tracker.stack else None
        node = torch._C._current_autograd_node()
        return node.metadata.get(TAG) if node is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", "aten")
        if ns in COLLECTIVE_NAMESPACES:
            if not self.peers:
                raise ReplayRefused(f"replay reached collective {_op_name(func)}")
            return self._collective(func, args, kwargs)
        short = _short(func)
        if short in SKIP_OPS or self.quiet:
            return func(*args, **kwargs)
        ins = _read_tensors(func, args, kwargs)
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
                       "index": self.n_ops, "module": self._where()}
                if any((s.get("posinf") or s.get("neginf")) and not s.get("nan") for s in o):
                    rec["overflow"] = _overflow(func, args, kwargs, outs)
                self.created.append(rec)
        elif not in_ok and out_ok and outs and len(self.masked) < MAX_OPS_RECORDED:
            self.masked.append({"op": _op_name(func), "phase": self.phase, "index": self.n_ops,
                                "module": self._where()})
        return out


    def _collective(self, func, args, kwargs):
        """Run it (every peer does), never call it a creation. The result is waited for here
        (the replay is synchronous anyway; DTensor's AsyncCollectiveTensor would wait below this
        mode, unseen, and FSDP2 waits on its all-gather's Work later): non-finite from finite
        local inputs = received. Functional collectives name their group; c10d ops (FSDP2's
        all-gathers, reduce-scatters) carry the ProcessGroup itself."""
        short = _short(func)
        funcol = func.namespace in FUNCOL_NAMESPACES
        if not funcol and func.namespace != "c10d":
            raise ReplayRefused(f"coordinated replay reached {_op_name(func)} (not a collective it can pair)")
        if short not in FUNCOL_PLUMBING:
            ranks = _group_ranks(args, kwargs) if funcol else _c10d_group_ranks(args, kwargs)
            if ranks is None or not set(ranks) <= self.peers:
                # e.g. a data-parallel all-reduce in a gradient hook: ranks outside the replay
                # would never join. Every peer reaches the same op, so all refuse alike.
                raise ReplayRefused(f"coordinated replay reached {_op_name(func)} over ranks "
                                    f"{ranks} beyond the replaying peers {sorted(self.peers)}")
        if self.quiet or short in FUNCOL_PLUMBING:
            return func(*args, **kwargs)
        ins = _read_tensors(func, args, kwargs)
        in_ok = all(_finite(t) for t in ins)
        out = func(*args, **kwargs)
        self.n_ops += 1
        flat = tree_flatten(out)[0]
        outs = [t for t in flat if isinstance(t, torch.Tensor)]
        if funcol:
            for t in outs:
                torch.ops._c10d_functional.wait_tensor(t)
        else:  # c10d: the op wrote into its tensor arguments; wait for its Work
            for w in flat:
                if isinstance(w, torch.ScriptObject) and "Work" in str(w._type()):
                    torch._C._distributed_c10d.Work.unbox(w).wait()
        if in_ok and not all(_finite(t) for t in outs) and len(self.received) < MAX_OPS_RECORDED:
            bad = next(t for t in outs if not _finite(t))
            self.received.append({"op": _op_name(func), "phase": self.phase, "index": self.n_ops,
                                  "module": self._where(), "output": stats(bad)})
        return out


# c10d ops whose first argument is an output buffer only (uninitialized memory could hold anything)
C10D_OUTPUT_FIRST = {"_allgather_base_", "allgather_", "allgather_coalesced_",
                     "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
                     "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_", "gather_",
                     "scatter_", "recv_", "recv_any_source_"}


def _read_tensors(func, args, kwargs) -> list:
    """The tensor arguments an op reads: not ``out=`` buffers, nor the output buffer of a c10d
    all-gather / reduce-scatter / all-to-all (an in-place op's self and an all-reduce's tensors
    are read)."""
    if func.namespace == "c10d" and _short(func) in C10D_OUTPUT_FIRST:
        args = args[1:]
    if "out" in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]


def _group_ranks(args, kwargs) -> list | None:
    """The global ranks of a functional collective's group (its group_name argument)."""
    name = kwargs.get("group_name")
    if name is None:
        name = next((a for a in reversed(args) if isinstance(a, str)), None)
    if name is None:
        return None
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        return dist.get_process_group_ranks(_resolve_process_group(name))
    except Exception:  # noqa: BLE001
        return None


def _c10d_group_ranks(args, kwargs) -> list | None:
    """The global ranks of a c10d op's ProcessGroup argument (a TorchScript object here)."""
    try:
        import torch.distributed as dist
        from torch._C._distributed_c10d import ProcessGroup

        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                return dist.get_process_group_ranks(ProcessGroup.unbox(a))
    except Exception:  # noqa: BLE001
        return None
    return None


def inputs_unchanged(call) -> bool:
    """The saved inputs of a root call still hold what the call read (no in-place change since)."""
    return call.versions is None or \
        [t._version for t in _tensors(call.kwargs or {}, _tensors(call.args, []))] == call.versions


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


# --------------------------------------------------------------------------- step replay
# Used by the default ("replay") mode of nan_watch: the always-on watch keeps only references to
# each root module call's inputs (and its output-gradients); on the first detection, before the
# optimizer changes the parameters, those calls are re-run here with module-level and op-level
# checks. Everything below runs only after a detection, so its cost does not matter.


def _floats(x, acc):
    return tensors_in(x, acc, torch.Tensor, is_float)


def _tensors(x, acc):
    return tensors_in(x, acc, torch.Tensor)


def _within(path, module) -> bool:
    """path is module or one of its descendants."""
    return isinstance(path, str) and (path == module or path.startswith(module + "."))


class _TagMode(TorchFunctionMode):
    """Tags the autograd nodes each forward creates with the module running (innermost), so a
    backward op can be attributed to the module whose forward made its node."""

    def __init__(self, tracker, leaves: dict | None = None):
        super().__init__()
        self.tracker = tracker
        self.leaves = leaves  # id -> leaf tensor requiring grad that the forward computed with

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.leaves is not None:  # the parameters actually used: under FSDP2 the unsharded
            for t in tree_flatten((args, kwargs))[0]:  # ones, which module.parameters() is not
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf:
                    self.leaves.setdefault(id(t), t)
        out = func(*args, **(kwargs or {}))
        where = self.tracker.stack[-1] if self.tracker.stack else None
        if where is not None:
            todo = [t.grad_fn for t in tree_flatten(out)[0]
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            seen = 0
            while todo and seen < 10_000:  # the nodes this call created, back to tagged ones
                n = todo.pop()
                seen += 1
                if n is None or TAG in n.metadata or type(n).__name__ == "AccumulateGrad":
                    continue
                n.metadata[TAG] = where
                todo.extend(f for f, _ in n.next_functions)
        return out


class _Tracker:
    """Module-level verdicts during a replay. Forward: a module whose floating inputs were finite
    and whose output is not created the value (children finish first: innermost first).
    Backward: one gradient hook per tensor, re-registered so it runs after every hook added since
    (e.g. by a module's forward pre-hook on its input); a module whose output-gradients were
    finite and whose forward was finite, but whose input-gradient is not, created it."""

    def __init__(self, name_of):
        self.name_of = name_of
        self.stack: list[str] = []
        self.handles: list = []
        self.hooked: set = set()
        self.slots: dict = {}
        self.mode = None
        self.fwd: list[dict] = []       # forward creations (first few)
        self.bwd: list[list[dict]] = []  # per gradient-hook call: the modules it convicts

    def __enter__(self):
        from torch.nn.modules import module as nnm

        self.handles.append(nnm.register_module_forward_pre_hook(self._pre))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        for s in self.slots.values():
            if s[1] is not None:
                s[1].remove()
        self.handles, self.slots = [], {}

    def _name(self, mod):
        return self.name_of(mod) or f"<{type(mod).__name__}>"

    def _pre(self, mod, args):
        self.stack.append(self._name(mod))
        if id(mod) not in self.hooked:  # appended now: runs after the module's own forward hooks
            self.hooked.add(id(mod))
            self.handles.append(mod.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def _post(self, mod, args, kwargs, out):
        name = self.stack.pop() if self.stack else self._name(mod)
        self.mode.quiet += 1
        try:
            ins = _floats(kwargs, _floats(args, []))
            outs = _floats(out, [])
            info = {"module": name, "module_class": type(mod).__name__,
                    "in_ok": all(_finite(t) for t in ins), "out_ok": all(_finite(t) for t in outs),
                    "gout_ok": True}
            if info["in_ok"] and not info["out_ok"] and len(self.fwd) < MAX_OPS_RECORDED:
                bad = next(t for t in outs if not _finite(t))
                self.fwd.append({**info, "inputs": [stats(t) for t in ins[:4]], "output": stats(bad)})
            if torch.is_grad_enabled():
                for t in outs:
                    if t.requires_grad:
                        self._slot(t).append(("gout", info))
                for t in ins:
                    if t.requires_grad:
                        self._slot(t).append(("gin", info))
        finally:
            self.mode.quiet -= 1

    def _slot(self, t):
        s = self.slots.get(id(t))
        if s is None or s[2] is not t:
            s = self.slots[id(t)] = [[], None, t]
        elif s[1] is not None:
            s[1].remove()
        s[1] = t.register_hook(lambda g, entries=s[0]: self._grad(entries, g))
        return s[0]

    def _grad(self, entries, g):
        self.mode.quiet += 1
        try:
            ok = _finite(g)
            convicted = []
            for kind, info in sorted(entries, key=lambda e: e[0] != "gin"):  # gin: this module's backward made g
                if kind == "gin":
                    if not ok and info["gout_ok"] and info["in_ok"] and info["out_ok"]:
                        convicted.append(info)
                else:
                    info["gout_ok"] &= ok
            if convicted and len(self.bwd) < MAX_OPS_RECORDED:
                s = stats(g)
                self.bwd.append([{**c, "grad": s} for c in convicted])
        finally:
            self.mode.quiet -= 1
        return None


def _pick_backward(convicted: list[dict], op: dict | None) -> dict:
    """Modules sharing an input tensor share its gradient (attn and its q/k/v): pick the
    innermost one whose forward made the autograd node the creating op ran in; if the op ran in
    a gradient hook on the input (its node belongs to the producer), the outermost."""
    where = op.get("module") if op else None
    mine = [c for c in convicted if _within(where, c["module"])]
    if mine:
        return max(mine, key=lambda c: c["module"].count("."))
    return min(convicted, key=lambda c: c["module"].count("."))


def _op_fields(op: dict | None) -> dict:
    if op is None:
        return {"op": None}
    return {"op": op["op"], "op_phase": op["phase"], "op_module": op.get("module"),
            "op_inputs": op.get("inputs"), "op_output": op.get("output"), "op_value": op.get("value"),
            "overflow": op.get("overflow")}


def replay_call(call, name_of, coordinated: bool = False) -> dict:
    """Re-run one root module call (forward, then backward with the saved output-gradients) with
    module- and op-level checks. Returns {"ops", "forward_finite", "verdict": None | {...}}.

    ``coordinated``: a tensor-parallel module replayed by every rank of its mesh at once (the
    peers agreed through the store first). Its collectives run; the forward and the backward
    both run on every rank whatever the values, so each peer issues the same collectives in the
    same order; a value that first turns non-finite in a collective's result was received."""
    module = call.module
    if type(module).__name__ == "DistributedDataParallel":
        module = module.module  # DDP's own forward may broadcast buffers: replay the wrapped model
    if not coordinated:
        _refuse_distributed(module)
        if not inputs_unchanged(call):
            raise ReplayRefused("the call's inputs were modified in place after the call")
    floats = _floats(call.kwargs or {}, _floats(call.args, []))

    def fresh(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_(x.requires_grad) if is_float(y) else y
        return x

    args, kwargs = tree_map(fresh, call.args), tree_map(fresh, call.kwargs or {})
    tracker = _Tracker(name_of)
    mode = tracker.mode = OpCheckMode(tracker, peers=(call.peers or ()) if coordinated else ())
    devs = sorted({t.device.index for t in floats if t.device.type == "cuda" and t.device.index is not None})
    verdict = None
    with torch.random.fork_rng(devices=devs), tracker:
        if call.rng is not None:
            torch.set_rng_state(call.rng)
        if call.cuda_rng is not None:
            torch.cuda.set_rng_state(call.cuda_rng)
        leaves: dict = {}
        try:
            with torch.enable_grad(), _TagMode(tracker, leaves), mode:
                out = module(*args, **kwargs)
        except BaseException:
            _reset_fsdp(module)  # a refusal or failure inside FSDP's forward hooks
            raise
        ins = _floats(kwargs, _floats(args, []))
        # gradients w.r.t. the parameters the forward used. Under FSDP2 those are the unsharded
        # parameters: torch.autograd.grad returns their gradients without accumulating into
        # .grad, so FSDP's post-backward finds nothing to reduce-scatter into the job's grads.
        in_ids = {id(t) for t in ins}
        params = [t for i, t in leaves.items() if i not in in_ids]
        seen = {id(t) for t in params} | in_ids
        params += [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
        probe = _GradProbe(params)
        outs = _floats(out, [])
        fwd_finite = all(_finite(t) for t in outs)
        fwd_ops = [c for c in mode.created if c["phase"] == "forward"]
        lockstep = None
        if coordinated:  # the backward now, on every peer: its collectives must pair up
            need = [(i, t) for i, t in enumerate(outs) if t.requires_grad]
            if need:
                wrt = [t for t in ins if t.requires_grad] + params
                gos = [call.grads.get(i) if call.grads.get(i) is not None else torch.zeros_like(t)
                       for i, t in need]
                mode.phase = "backward"
                try:
                    with _TagMode(tracker), mode, probe:
                        lockstep = torch.autograd.grad([t for _, t in need], wrt, grad_outputs=gos,
                                                       allow_unused=True)
                except BaseException:
                    _reset_fsdp(module)  # FSDP's final backward callback never ran
                    raise
        verdict = _forward_verdict(tracker, module, fwd_ops, ins, fwd_finite)
        if verdict is None and fwd_finite:
            verdict = _backward_verdict(call, tracker, mode, probe, module, fwd_ops, outs, ins,
                                        params, lockstep)
    verdict = _received_verdict(verdict, mode)
    return {"ops": mode.n_ops, "forward_finite": fwd_finite, "verdict": verdict}


def _forward_verdict(tracker, module, fwd_ops: list, ins: list, fwd_finite: bool) -> dict | None:
    """The replayed forward's verdict: a module that turned finite inputs into a non-finite output
    created the value; a call whose inputs were non-finite received it."""
    verdict = None
    if tracker.fwd:  # a module turned finite inputs into a non-finite output
        m = tracker.fwd[0]
        op = next((c for c in fwd_ops if _within(c.get("module"), m["module"])), fwd_ops[0] if fwd_ops else None)
        verdict = {"created": True, "phase": "forward", "role": "output", "module": m["module"],
                   "module_class": m["module_class"], "inputs": m["inputs"], "output": m["output"],
                   "value": value_kind(m["output"]), **_op_fields(op)}
    elif not fwd_finite:
        bad = [stats(t) for t in ins if not _finite(t)][:4]
        verdict = {"created": False, "phase": "forward", "role": "inputs", "module": tracker._name(module),
                   "inputs": bad, "value": value_kind(bad[0]) if bad else None,
                   "evidence": "the call's inputs were already non-finite (received)"}
    return verdict


def _backward_verdict(call, tracker, mode, probe, module, fwd_ops: list, outs: list, ins: list,
                      params: list, lockstep) -> dict | None:
    """The replayed backward's verdict (with the output-gradients saved from the job's step): a
    non-finite gradient w.r.t. the call's output (received from another rank, or created by the
    loss), else the module or parameter gradients the backward turned non-finite."""
    verdict = None
    if call.grads:
        pairs = [(t, call.grads.get(i)) for i, t in enumerate(outs) if t.requires_grad]
        pairs = [(t, g) for t, g in pairs if g is not None]
        bad = [g for _, g in pairs if not _finite(g)]
        if bad:
            s = stats(bad[0])
            if call.grad_explicit:  # handed to backward by another rank (pipeline p2p)
                verdict = {"created": False, "phase": "backward", "role": "grad_output",
                           "module": tracker._name(module), "grad": s, "value": value_kind(s),
                           "evidence": "the gradient w.r.t. the call's output arrived non-finite"}
            else:  # from this rank's loss, whose backward made it
                verdict = {"created": True, "phase": "backward", "role": "grad_output",
                           "module": "<loss>", "grad": s, "value": value_kind(s), "op": None,
                           "evidence": "finite model output, the loss's gradient w.r.t. it is not: "
                                       "created by the loss computation's backward"}
        elif pairs:
            wrt = [t for t in ins if t.requires_grad] + params
            mode.phase = "backward"
            if lockstep is not None:  # ran already (zeros for outputs without a gradient)
                gs = lockstep
            else:
                with _TagMode(tracker), mode, probe:
                    gs = torch.autograd.grad([t for t, _ in pairs], wrt,
                                             grad_outputs=[g for _, g in pairs], allow_unused=True)
            bwd_ops = [c for c in mode.created if c["phase"] == "backward"]
            bad_p = [p for p in params if id(p) in probe.bad]
            op = bwd_ops[0] if bwd_ops else None
            if tracker.bwd:
                m = _pick_backward(tracker.bwd[0], op)
                verdict = {"created": True, "phase": "backward", "role": "grad_input",
                           "module": m["module"], "module_class": m["module_class"], "grad": m["grad"],
                           "value": value_kind(m["grad"]),
                           "evidence": "gradient w.r.t. the module's outputs finite, w.r.t. its inputs not"}
            elif bad_p or op is not None:
                where = op.get("module") if op else None
                verdict = {"created": True, "phase": "backward", "role": "parameter_grads",
                           "module": where or tracker._name(module), "params_nonfinite": len(bad_p),
                           "evidence": "input-gradients finite, parameter gradients not"}
                if bad_p:
                    verdict["grad"] = probe.bad[id(bad_p[0])]
                    verdict["value"] = value_kind(verdict["grad"])
            if verdict is not None:
                # a creation hidden by masking in the forward of this module is the root cause
                hidden = [c for c in fwd_ops if _within(c.get("module"), verdict["module"])]
                if hidden:
                    h = hidden[0]
                    masked = [x for x in mode.masked if x["phase"] == "forward" and x["index"] > h["index"]]
                    verdict.update(_op_fields(h))
                    verdict["hidden_by"] = masked[0]["op"] if masked else None
                    if op is not None:
                        verdict["backward_op"], verdict["backward_value"] = op["op"], op.get("value")
                else:
                    verdict.update(_op_fields(op))
    return verdict


def _received_verdict(verdict: dict | None, mode) -> dict | None:
    """On a tensor-parallel peer: what a collective brought in before any local op created it was
    received, not created."""
    if verdict is not None and verdict.get("created") and mode.received:
        # on a tensor-parallel peer: what a collective brought in before any local op created it
        ph = verdict["phase"]
        got = [r for r in mode.received if r["phase"] == ph]
        made = [c for c in mode.created if c["phase"] == ph]
        if got and (not made or got[0]["index"] < made[0]["index"]):
            r = got[0]
            verdict = {"created": False, "phase": ph, "role": "collective",
                       "module": r.get("module") or verdict.get("module"), "op": r["op"],
                       "output": r["output"], "value": value_kind(r["output"]),
                       "evidence": f"arrived through {r['op']} from the tensor-parallel peers; "
                                   f"what this rank contributed was finite"}
    return verdict


class _GradProbe:
    """Tensor hooks on the parameters of a replayed backward: each gradient is checked as it is
    computed (stats kept when non-finite) and handed on as a zero-stride zero view, so
    torch.autograd.grad holds no parameter gradients — under FSDP2 they would be the whole
    unsharded model's at once. The hooks run before autograd.grad captures its inputs' grads."""

    def __init__(self, params):
        self.params = params
        self.bad: dict = {}
        self.handles: list = []

    def __enter__(self):
        for p in self.params:
            self.handles.append(p.register_hook(lambda g, i=id(p): self._check(i, g)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _check(self, key, g):
        if not _finite(g) and key not in self.bad:
            self.bad[key] = stats(g)
        return _zeros_like_view(g)


def _zeros_like_view(g):
    """A zero tensor of g's shape that owns one element (None: keep g)."""
    if type(g) is torch.Tensor:
        return torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
    lt = getattr(g, "_local_tensor", None)
    if lt is not None:  # a DTensor gradient (TP): the same placements around a zero view
        try:
            from torch.distributed.tensor import DTensor

            z = torch.zeros((), dtype=lt.dtype, device=lt.device).expand(lt.shape)
            return DTensor.from_local(z, g.device_mesh, g.placements, run_check=False,
                                      shape=g.shape, stride=g.stride())
        except Exception:  # noqa: BLE001
            return None
    return None


def _reset_fsdp(module) -> None:
    """After an exception inside a replay's forward or backward: FSDP2's documented recovery
    (reset_iter_state on the root: reshard every group, clear the iteration trackers), so the
    job's next forward all-gathers the updated parameters again. Nothing to do without FSDP."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        try:
            m.reset_iter_state()  # the root: the first FSDP module in module order
            return
        except Exception:  # noqa: BLE001 - not the root, or a torch without it
            continue
    for m in fsdp:  # best effort: at least no stale unsharded parameters
        try:
            m.reshard()
        except Exception:  # noqa: BLE001
            pass


def nonfinite_parameters(calls, param_name) -> list[dict]:
    """Parameters of this step's root modules that are non-finite now (before the optimizer
    step): {"param", "module", **stats}. Only at a detection: one pass per tensor. Buffers are
    left out: a -inf causal mask is legitimate, and running statistics are written by the very
    forward that may have created the value."""
    out, seen = [], set()
    for c in calls:
        if id(c.module) in seen:
            continue
        seen.add(id(c.module))
        for path, t in c.module.named_parameters():
            x = local(t).detach()
            if is_float(x) and x.numel() and not _finite(x):
                name = param_name(t) or path
                out.append({"param": name, "module": name.rpartition(".")[0] or "<root>", **stats(x)})
    return out


def locate_step(calls, name_of, loss_bad: bool, grads_bad: bool, max_calls: int = 32,
                coordinated: bool = False) -> dict:
    """Replay this step's root calls in execution order (each forward, then its backward) until
    one shows where the value was created or that it arrived from elsewhere. Coordinated (tensor
    parallel): every call is replayed whatever the verdict, as the peers do."""
    out = {"created": False, "phase": None, "module": None, "op": None, "replayed": 0, "ops_checked": 0,
           "notes": []}
    all_fwd_finite = bool(calls)
    found = None
    for i, c in enumerate(calls[:max_calls]):
        try:
            r = replay_call(c, name_of, coordinated=coordinated)
        except ReplayRefused as e:
            out["notes"].append(f"call {i}: replay refused: {e}")
            all_fwd_finite = False
            continue
        except Exception as e:  # noqa: BLE001 - a failing replay must not hide the detection
            out["notes"].append(f"call {i}: replay failed: {type(e).__name__}: {e}")
            all_fwd_finite = False
            if coordinated:  # the peers may still be in this call's collectives: go no further
                break
            continue
        out["replayed"] += 1
        out["ops_checked"] += r["ops"]
        all_fwd_finite &= r["forward_finite"]
        if r["verdict"] is not None and found is None:
            found = dict(r["verdict"], call=i)
            if not coordinated:
                break
    if found is not None:
        out.update(found)
        return out
    if len(calls) > max_calls:
        out["notes"].append(f"only the first {max_calls} of {len(calls)} calls replayed")
    if not calls:
        out["notes"].append("no root module call captured this step")
    elif loss_bad and all_fwd_finite:
        out.update(created=True, phase="forward", role="loss", module="<loss>",
                   evidence="every module output finite, the loss not: created by the loss computation")
    elif grads_bad and out["replayed"] == min(len(calls), max_calls):
        out.update(phase="backward", role="parameter_grads",
                   evidence="the replayed forward and backward are finite: the non-finite gradients "
                            "arrived through a gradient reduction (data parallel) or outside the module calls")
    else:
        out["notes"].append("the replay did not reproduce the non-finite value")
    return out
