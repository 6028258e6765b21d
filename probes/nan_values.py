"""Values and records the NaN watch's parts share: module call and root call records, the finite
test, tensors in nested arguments, fp32 gradient norms, the per-step resolver."""

from __future__ import annotations

import math


WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


MAX_CANDIDATES = 8


MAX_ROOT_CALLS = 64


def clean_path(path: str) -> str:
    for p in WRAPPER_PREFIXES:
        path = path.replace(p, "")
    return path


def _finite(v) -> bool:
    return v is None or math.isfinite(v)


def tensors_in(x, acc: list, tensor_cls, keep=None) -> list:
    """Append to acc the tensors (those keep() accepts) found in nested tuples, lists and dicts."""
    if isinstance(x, tensor_cls):
        if keep is None or keep(x):
            acc.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            tensors_in(y, acc, tensor_cls, keep)
    elif isinstance(x, dict):
        for y in x.values():
            tensors_in(y, acc, tensor_cls, keep)
    return acc


def _is_floating(t) -> bool:
    return t.is_floating_point()


def fp32_norms(torch, ts: list, order) -> list:
    """Per-tensor ``order``-norms of ts as fp32 0-dim tensors, in ts's order: one pass over the
    values (non-finite in, non-finite out). ``_foreach_norm(dtype=float32)`` reads fp32 in place
    and keeps fp16 from overflowing at 65504; bf16 on CPU is normed in bf16 (torch accumulates it
    in fp32, and bf16 has fp32's range) and only the result is cast, because there dtype=float32
    converts the whole tensor first (2-6x the time, 8.4M values)."""
    bf16 = torch.bfloat16
    if ts[0].device.type != "cpu" or not any(t.dtype is bf16 for t in ts):
        return torch._foreach_norm(ts, order, dtype=torch.float32)
    out = [None] * len(ts)
    low = [i for i, t in enumerate(ts) if t.dtype is bf16]
    rest = [i for i, t in enumerate(ts) if t.dtype is not bf16]
    for i, n in zip(low, torch._foreach_norm([ts[i] for i in low], order)):
        out[i] = n.float()
    if rest:
        for i, n in zip(rest, torch._foreach_norm([ts[i] for i in rest], order, dtype=torch.float32)):
            out[i] = n
    return out


class _Call:
    """One module call: what the resolver and a replay need."""

    __slots__ = ("name", "module", "args", "kwargs", "versions", "in_ok", "out_ok", "gout_ok",
                 "gouts", "__weakref__")

    def __init__(self, name, module):
        self.name, self.module = name, module
        self.args = self.kwargs = self.versions = None
        self.in_ok = self.out_ok = True
        self.gout_ok = True
        self.gouts: dict = {}


class _Root:
    """One root module call of the current step (a module called outside any other module): what a
    replay needs, by reference (no copies in the hot path)."""

    __slots__ = ("module", "args", "kwargs", "versions", "rng", "cuda_rng", "grads", "outs",
                 "held", "grad_explicit", "peers")

    def __init__(self, module, args, kwargs, versions, rng, cuda_rng, peers=None):
        self.module, self.args, self.kwargs, self.versions = module, args, kwargs, versions
        self.peers = peers  # mesh ranks a replay must run with (DTensor parameters: TP, FSDP2)
        self.rng, self.cuda_rng = rng, cuda_rng
        self.grads: dict = {}    # floating output index -> gradient w.r.t. it (from a grad hook)
        self.outs: list = []     # weakrefs to the floating outputs
        self.held: list = []     # (index, output) with retain_grad(), until its gradient is taken
        self.grad_explicit = False  # an output was a backward root with an explicit gradient (p2p)


class _NoHandle:
    @staticmethod
    def remove():
        pass


class _Resolver:
    """Consumes one step's events in execution order (values already floats)."""

    def __init__(self, watch, step):
        self.w, self.step = watch, step
        self.first = None
        self.fwd_bad = False
        self.n_candidates = 0
        self.seen = set()

    def feed(self, kind, call, vals, tensors=None, t_ns=None):
        created = False
        if kind == "fwd":
            in_v, out_v = vals
            call.in_ok = all(_finite(v) for v in in_v)
            bad = not all(_finite(v) for v in out_v)
            call.out_ok = not bad
            created = bad and call.in_ok
            self.fwd_bad |= bad
            phase, role = "forward", "output"
        elif kind == "gout":
            bad = not _finite(vals[0])
            call.gout_ok &= not bad
            phase, role = "backward", "grad_output"
        elif kind == "gin":
            bad = not _finite(vals[0])
            # a backward can only create what its forward did not already carry
            created = bad and call.gout_ok and call.in_ok and call.out_ok
            phase, role = "backward", "grad_input"
        elif kind == "loss":
            bad = not _finite(vals[0])
            created = bad and not self.fwd_bad and self.w.modules_on
            self.fwd_bad |= bad
            phase, role = "forward", "loss"
        elif kind == "grads":
            bad = not _finite(vals[0])
            created = bad and self.first is None and self.w.modules_on
            phase, role = "backward", "parameter_grads"
        else:  # params after the optimizer step
            bad = not _finite(vals[0])
            created = bad and self.first is None
            phase, role = "optimizer", "parameters"
        if not bad:
            return
        first = self.first is None
        late = self.w.detected_step is not None and self.step > self.w.detected_step
        key = (getattr(call, "name", kind), kind)
        if created and not first and key in self.seen:
            return  # the same module again (another micro-batch)
        if first or (created and not late and self.n_candidates < MAX_CANDIDATES):
            self.seen.add(key)
            rec = self.w._nonfinite_record(self.step, kind, phase, role, call, vals, tensors,
                                           created, first, t_ns)
            if first:
                self.first = rec
            if created:
                self.n_candidates += 1
                self.w._candidate(rec, call, kind, tensors)


def value_kind_of(s: dict) -> str:
    # lazy: breaks a cycle probes.nan_values<->probes.nan_locate
    from trainprof.probes.nan_locate import value_kind

    return value_kind(s) or "non-finite"


def _jsonable(x):
    """Non-finite floats as the strings "nan"/"inf"/"-inf" (strict JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
