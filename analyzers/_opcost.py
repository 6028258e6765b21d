"""FLOPs and bytes moved per operator, from the shapes and dtypes torch.profiler records
(``record_shapes=True``): the CPU profiler records no FLOPs and GPU ``with_flops`` covers a few
ops only.

Conventions (those of torch.utils.flop_counter.FlopCounterMode where it counts the op):
- matmul family (mm, addmm, bmm, baddbmm, matmul, linear): 2·M·K·N per product; bias ignored.
- convolution: 2 · batch · prod(weight shape) · prod(output spatial dims); backward: once per
  gradient produced (input, weight). Output sizes use the recorded stride/padding/dilation when
  the trace has "Concrete Inputs", else stride 1 with "same" padding.
- scaled-dot-product attention: 2·B·H·Sq·Sk·D (scores) + 2·B·H·Sq·Sk·Dv (weighted values);
  backward twice that. FlopCounterMode ignores causal masking; we count only unmasked entries
  when ``is_causal`` is recorded as True (Σ_i min(i+1, Sk) of Sq·Sk entries ≈ half), and say so
  in ``OpCost.note``.
- elementwise: 1 FLOP per output element (2 for fused multiply-adds: addcmul, addcdiv, lerp);
  norms 5 per element forward, 8 backward; softmax 5 forward, 3 backward; embedding 0.
- bytes: every tensor input read once plus every output written once (no cache reuse), i.e.
  the compulsory traffic of an ideal kernel; attention assumes a fused (flash) kernel that never
  materializes the Sq×Sk score matrix.
``op_cost(name, input_dims, input_types, concrete=None)`` returns an OpCost or None (not costed).
``select_ops(events)`` picks, from a trace's host ops (the events ``Table``), the ones to count
without double counting nested ops (aten::linear → aten::matmul → aten::mm counts once, at mm; a
DTensor's aten::mm with global shapes around the local aten::mm counts once, at the local one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "long": 8,
    "int": 4, "unsigned int": 4, "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1,
    "bool": 1, "c10::complex<float>": 8, "c10::complex<double>": 16, "c10::complex<c10::Half>": 4,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1, "c10::Float8_e8m0fnu": 1,
}
NOT_TENSORS = {"", "Scalar", "ScalarList", "GenericList", "None", "Device", "Layout"}


@dataclass(frozen=True)
class OpCost:
    op_class: str      # matmul | attention | conv | norm | softmax | embedding | elementwise | reduction | memory
    flops: float
    bytes: float
    note: str = ""


# --------------------------------------------------------------------------- shapes
def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _tensor(dims, types, i):
    """(shape, element size) of argument i when it is a tensor, else None."""
    if dims is None or types is None or i >= len(dims) or i >= len(types):
        return None
    t = types[i]
    if t in NOT_TENSORS or t == "TensorList" or t is None:
        return None
    d = dims[i]
    if not isinstance(d, list) or (d and isinstance(d[0], list)):
        return None
    return d, DTYPE_BYTES.get(t, 4)


def _tensors(dims, types) -> list[tuple[list, int]]:
    """All tensor arguments, TensorLists flattened (their element size taken as 4 bytes unless
    a sibling tensor tells otherwise)."""
    out = []
    n = min(len(dims or []), len(types or []))
    for i in range(n):
        if types[i] == "TensorList" and isinstance(dims[i], list):
            out += [(d, None) for d in dims[i] if isinstance(d, list)]
        else:
            t = _tensor(dims, types, i)
            if t is not None:
                out.append(t)
    size = next((s for _, s in out if s), 4)
    return [(d, s or size) for d, s in out]


def input_numel(dims, types) -> int:
    """Elements of an op's tensor inputs (TensorLists flattened); 0 without any."""
    return sum(_numel(d) for d, _ in _tensors(dims, types))


def _bytes(ts) -> int:
    return sum(_numel(d) * s for d, s in ts)


def _concrete(concrete, i):
    if not concrete or i >= len(concrete):
        return None
    v = concrete[i]
    if v in ("", None):
        return None
    if isinstance(v, str):
        s = v.strip()
        if s in ("True", "False"):
            return s == "True"
        try:
            if s.startswith("["):
                items = [x.strip() for x in s.strip("[]").split(",") if x.strip()]
                return [x == "True" if x in ("True", "False") else int(float(x)) for x in items]
            return float(s) if any(c in s for c in ".e") else int(s)
        except ValueError:
            return None
    return v


# --------------------------------------------------------------------------- matmul / conv
def _mm(a, b, extra_reads=()):
    (sa, ea), (sb, eb) = a, b
    m, k = sa[-2], sa[-1]
    n = sb[-1]
    batch = _numel(np.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2]))) if len(sa) > 2 or len(sb) > 2 else 1
    flops = 2 * batch * m * k * n
    by = _numel(sa) * ea + _numel(sb) * eb + batch * m * n * ea + _bytes(extra_reads)
    return OpCost("matmul", flops, by)


def _matmul_generic(dims, types, concrete):
    a, b = _tensor(dims, types, 0), _tensor(dims, types, 1)
    if not a or not b or not a[0] or not b[0]:
        return None
    (sa, ea), (sb, eb) = a, b
    if len(sa) == 1:
        sa = [1, sa[0]]
    if len(sb) == 1:
        sb = [sb[0], 1]
    return _mm((sa, ea), (sb, eb))


def _linear(dims, types, concrete):
    x, w = _tensor(dims, types, 0), _tensor(dims, types, 1)
    if not x or not w or len(w[0]) != 2 or not x[0]:
        return None
    rows = _numel(x[0][:-1])
    out_f, in_f = w[0]
    bias = _tensor(dims, types, 2)
    by = _numel(x[0]) * x[1] + _numel(w[0]) * w[1] + rows * out_f * x[1] + (_bytes([bias]) if bias else 0)
    return OpCost("matmul", 2 * rows * in_f * out_f, by)


def _mm_op(ia, ib, extra=()):
    def f(dims, types, concrete):
        a, b = _tensor(dims, types, ia), _tensor(dims, types, ib)
        if not a or not b or len(a[0]) < 2 or len(b[0]) < 2:
            return None
        reads = [t for t in (_tensor(dims, types, i) for i in extra) if t]
        return _mm(a, b, reads)
    return f


# stride, padding, dilation argument positions per convolution overload
CONV_ARGS = {
    "aten::conv1d": (3, 4, 5), "aten::conv2d": (3, 4, 5), "aten::conv3d": (3, 4, 5),
    "aten::convolution": (3, 4, 5), "aten::_convolution": (3, 4, 5),
    "aten::mkldnn_convolution": (4, 3, 5), "aten::cudnn_convolution": (3, 2, 4),
    "aten::miopen_convolution": (4, 3, 5), "aten::_slow_conv2d_forward": (4, 5, None),
    "aten::thnn_conv2d": (4, 5, None), "aten::slow_conv3d_forward": (4, 5, None),
}


def _conv(name):
    def f(dims, types, concrete):
        x, w = _tensor(dims, types, 0), _tensor(dims, types, 1)
        if not x or not w or len(x[0]) < 3 or len(w[0]) != len(x[0]):
            return None
        spatial, ks = x[0][2:], w[0][2:]
        si, pi, di = CONV_ARGS.get(name, (None, None, None))
        stride = _concrete(concrete, si) if si is not None else None
        pad = _concrete(concrete, pi) if pi is not None else None
        dil = _concrete(concrete, di) if di is not None else None
        note = ""
        if isinstance(stride, list) and isinstance(pad, list):
            dil = dil if isinstance(dil, list) else [1] * len(ks)
            ext = lambda v, i: v[i] if len(v) > i else v[0]  # noqa: E731
            out = [(s + 2 * ext(pad, i) - ext(dil, i) * (k - 1) - 1) // ext(stride, i) + 1
                   for i, (s, k) in enumerate(zip(spatial, ks))]
        else:
            out, note = list(spatial), "stride/padding not recorded: output size assumed = input"
        flops = 2 * x[0][0] * _numel(w[0]) * _numel(out)
        bias = _tensor(dims, types, 2)
        by = _bytes([x, w]) + x[0][0] * w[0][0] * _numel(out) * x[1] + (_bytes([bias]) if bias else 0)
        return OpCost("conv", flops, by, note)
    return f


def _conv_backward(dims, types, concrete):
    go, x, w = (_tensor(dims, types, i) for i in range(3))
    if not go or not x or not w or len(go[0]) < 3:
        return None
    mask = _concrete(concrete, 10)
    grads = sum(1 for m in (mask if isinstance(mask, list) else [1, 1, 0])[:2] if m)
    flops = 2 * go[0][0] * _numel(w[0]) * _numel(go[0][2:]) * grads
    by = _bytes([go, x, w]) + (_bytes([x]) if grads > 0 else 0) + (_bytes([w]) if grads > 1 else 0)
    return OpCost("conv", flops, by)


# --------------------------------------------------------------------------- attention
# (query index, is_causal index) per overload; shapes are logical (B, H, S, D)
SDPA = {
    "aten::scaled_dot_product_attention": (0, 5, False),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 4, False),
    "aten::_scaled_dot_product_flash_attention": (0, 4, False),
    "aten::_scaled_dot_product_efficient_attention": (0, 6, False),
    "aten::_scaled_dot_product_cudnn_attention": (0, 6, False),
    "aten::_scaled_dot_product_fused_attention_overrideable": (0, 5, False),
    "aten::_scaled_dot_product_attention_math": (0, 5, False),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (1, 7, True),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 11, True),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 11, True),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 14, True),
}


def causal_fraction(sq: int, sk: int) -> float:
    """Share of the Sq×Sk scores a top-left causal mask keeps: Σ_i min(i+1, Sk) / (Sq·Sk)."""
    m = min(sq, sk)
    kept = m * (m + 1) // 2 + (sq - m) * sk
    return kept / (sq * sk)


def _sdpa(name):
    qi, ci, backward = SDPA[name]

    def f(dims, types, concrete):
        q, k, v = (_tensor(dims, types, qi + i) for i in range(3))
        if not q or not k or not v or len(q[0]) < 3 or len(k[0]) < 3:
            return None
        sq, d = q[0][-2], q[0][-1]
        sk, dv = k[0][-2], v[0][-1]
        bh = _numel(q[0][:-2])
        flops = 2 * bh * sq * sk * d + 2 * bh * sq * sk * dv
        causal = _concrete(concrete, ci)
        note = "causal mask: unmasked scores only" if causal is True else (
            "is_causal not recorded: full scores counted" if causal is None else "")
        if causal is True:
            flops *= causal_fraction(sq, sk)
        out = bh * sq * dv * q[1]
        if backward:
            go = _tensor(dims, types, 0)
            flops *= 2  # dV, dP, dQ, dK: two products per forward product
            by = _bytes([q, k, v]) * 2 + out + (_bytes([go]) if go else out)  # + dq, dk, dv
        else:
            by = _bytes([q, k, v]) + out
        return OpCost("attention", flops, by, note)
    return f


# --------------------------------------------------------------------------- the rest
def _broadcast(ts):
    try:
        return list(np.broadcast_shapes(*(tuple(d) for d, _ in ts)))
    except ValueError:
        return max((d for d, _ in ts), key=_numel)


def _elementwise(flops_per_el: float, op_class: str = "elementwise"):
    def f(dims, types, concrete, inplace=False):
        ts = _tensors(dims, types)
        if not ts:
            return None
        if types and types[0] == "TensorList":  # foreach: per list element
            lists = [dims[i] for i in range(len(types)) if types[i] == "TensorList"]
            es = ts[0][1]
            out_el = sum(_numel(d) for d in lists[0])
            return OpCost(op_class, flops_per_el * out_el, _bytes(ts) + (0 if inplace else out_el * es))
        out = ts[0][0] if inplace else _broadcast(ts)
        # the output's element size: type promotion lets a 0-dim tensor or a Python scalar (a
        # `double` multiplier of a bf16 tensor) set it only when no dimensioned input exists
        dimmed = [s for d, s in ts if d]
        es = ts[0][1] if inplace else max(dimmed or [s for _, s in ts])
        return OpCost(op_class, flops_per_el * _numel(out), _bytes(ts) + _numel(out) * es)
    return f


def _first_input(flops_per_el: float, op_class: str, reads: int = 1, writes: int = 1):
    """Ops whose traffic is `reads` reads + `writes` writes of the first input's size."""
    def f(dims, types, concrete):
        x = _tensor(dims, types, 0)
        if not x:
            return None
        n = _numel(x[0])
        extra = _bytes([t for t in _tensors(dims, types)[1:] if _numel(t[0]) < n])  # weights, stats
        return OpCost(op_class, flops_per_el * n, (reads + writes) * n * x[1] + extra)
    return f


def _embedding(dims, types, concrete):
    w, idx = _tensor(dims, types, 0), _tensor(dims, types, 1)
    if not w or not idx or len(w[0]) != 2:
        return None
    out = _numel(idx[0]) * w[0][1]
    return OpCost("embedding", 0, 2 * out * w[1] + _bytes([idx]))


def _embedding_backward(dims, types, concrete):
    g, idx = _tensor(dims, types, 0), _tensor(dims, types, 1)
    if not g or not idx:
        return None
    rows = _concrete(concrete, 2)
    table = (rows * g[0][-1] * g[1]) if isinstance(rows, int) else 0
    return OpCost("embedding", _numel(g[0]), _bytes([g, idx]) + table)


def _reduction(dims, types, concrete):
    x = _tensor(dims, types, 0)
    if not x:
        return None
    return OpCost("reduction", _numel(x[0]), _numel(x[0]) * x[1])


def _copy(dims, types, concrete):
    ts = _tensors(dims, types)
    if not ts:
        return None
    if len(ts) >= 2:  # copy_(dst, src): read src, write dst
        return OpCost("memory", 0, _bytes(ts[:2]))
    return OpCost("memory", 0, 2 * _bytes(ts[:1]))


def _fill(dims, types, concrete):
    x = _tensor(dims, types, 0)
    return OpCost("memory", 0, _numel(x[0]) * x[1]) if x else None


def _cat(dims, types, concrete):
    ts = _tensors(dims, types)
    return OpCost("memory", 0, 2 * _bytes(ts)) if ts else None


ELEMENTWISE_1 = ("add", "sub", "mul", "div", "neg", "abs", "relu", "gelu", "silu", "tanh",
                 "sigmoid", "exp", "log", "sqrt", "rsqrt", "pow", "reciprocal", "clamp",
                 "clamp_min", "clamp_max", "maximum", "minimum", "where", "masked_fill", "sin",
                 "cos", "square", "gelu_backward", "silu_backward", "threshold_backward",
                 "sigmoid_backward", "tanh_backward", "mse_loss", "native_dropout", "erf",
                 "hardtanh", "leaky_relu", "eq", "ne", "lt", "gt", "le", "ge", "logical_not",
                 "bitwise_and", "sign", "floor", "ceil", "round", "remainder", "fmod", "rsub")
ELEMENTWISE_2 = ("addcmul", "addcdiv", "lerp")

# Kernels: costed where they run. Wrappers: composite ops costed only when nothing inside them
# is (a trace that recorded the wrapper but not its kernels).
KERNELS: dict = {
    "aten::mm": _mm_op(0, 1), "aten::addmm": _mm_op(1, 2, (0,)), "aten::bmm": _mm_op(0, 1),
    "aten::baddbmm": _mm_op(1, 2, (0,)), "aten::_addmm_activation": _mm_op(1, 2, (0,)),
    "aten::_scaled_mm": _mm_op(0, 1),
    "aten::convolution_backward": _conv_backward,
    "aten::native_layer_norm": _first_input(5, "norm"),
    "aten::native_layer_norm_backward": _first_input(8, "norm", reads=2),
    "aten::native_group_norm": _first_input(5, "norm"),
    "aten::native_group_norm_backward": _first_input(8, "norm", reads=2),
    "aten::native_batch_norm": _first_input(5, "norm"),
    "aten::native_batch_norm_backward": _first_input(8, "norm", reads=2),
    "aten::_fused_rms_norm": _first_input(4, "norm"),
    "aten::_fused_rms_norm_backward": _first_input(6, "norm", reads=2),
    "aten::_softmax": _first_input(5, "softmax"),
    "aten::_log_softmax": _first_input(5, "softmax"),
    "aten::_softmax_backward_data": _first_input(3, "softmax", reads=2),
    "aten::_log_softmax_backward_data": _first_input(3, "softmax", reads=2),
    "aten::embedding": _embedding,
    "aten::embedding_dense_backward": _embedding_backward,
    "aten::sum": _reduction, "aten::mean": _reduction, "aten::linalg_vector_norm": _reduction,
    "aten::amax": _reduction, "aten::norm": _reduction,
    "aten::copy_": _copy, "aten::fill_": _fill, "aten::zero_": _fill, "aten::cat": _cat,
}
for _n in ("aten::mkldnn_convolution", "aten::cudnn_convolution", "aten::miopen_convolution",
           "aten::_slow_conv2d_forward", "aten::slow_conv3d_forward"):
    KERNELS[_n] = _conv(_n)
for _n, _spec in SDPA.items():
    if _n not in ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math"):
        KERNELS[_n] = _sdpa(_n)
for _base, _f in [(b, 1) for b in ELEMENTWISE_1] + [(b, 2) for b in ELEMENTWISE_2]:
    _fn = _elementwise(_f)
    KERNELS[f"aten::{_base}"] = _fn
    KERNELS[f"aten::{_base}_"] = (lambda fn: lambda d, t, c: fn(d, t, c, inplace=True))(_fn)
    KERNELS[f"aten::_foreach_{_base}"] = _fn
    KERNELS[f"aten::_foreach_{_base}_"] = (lambda fn: lambda d, t, c: fn(d, t, c, inplace=True))(_fn)

WRAPPERS: dict = {
    "aten::matmul": _matmul_generic, "aten::linear": _linear,
    "aten::scaled_dot_product_attention": _sdpa("aten::scaled_dot_product_attention"),
    "aten::_scaled_dot_product_attention_math": _sdpa("aten::_scaled_dot_product_attention_math"),
    "aten::layer_norm": _first_input(5, "norm"), "aten::group_norm": _first_input(5, "norm"),
    "aten::batch_norm": _first_input(5, "norm"), "aten::rms_norm": _first_input(4, "norm"),
    "aten::softmax": _first_input(5, "softmax"), "aten::log_softmax": _first_input(5, "softmax"),
    "aten::embedding_backward": _embedding_backward, "aten::_to_copy": _copy,
}
for _n in ("aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution", "aten::_convolution"):
    WRAPPERS[_n] = _conv(_n)


def op_cost(name: str, input_dims, input_types, concrete=None) -> OpCost | None:
    """FLOPs and bytes of one recorded op, or None when the op is not costed or its shapes were
    not recorded."""
    f = KERNELS.get(name) or WRAPPERS.get(name)
    if f is None or input_dims is None or input_types is None:
        return None
    try:
        return f(list(input_dims), list(input_types), concrete)
    except (TypeError, ValueError, IndexError, ZeroDivisionError):
        return None  # a malformed record: not costed rather than a crash


# --------------------------------------------------------------------------- trace selection
COSTED = frozenset(KERNELS) | frozenset(WRAPPERS)


def select_ops(events) -> list[tuple[int, OpCost]]:
    """(row, cost) of the host ops to count, rows being positions in the events ``Table``
    (``trace.tables.events``), in row order. An op of another class inside a costed kernel is
    part of that kernel (addmm's bias copy); one of the same class replaces it (tensor subclass
    dispatch: global shapes outside, local inside); a wrapper counts only when no costed op
    runs inside it."""
    rows = _candidates(events)
    costs = _row_costs(events, rows)
    if costs is None:
        return []
    order = np.lexsort((-events["dur_ns"][rows], events["ts_ns"][rows], events["tid"][rows]))
    out = _nest(events, rows[order], [costs[k] for k in order.tolist()])
    return sorted(out, key=lambda x: x[0])


def _candidates(events) -> np.ndarray:
    """Rows of the host ops (cat cpu_op) whose name op_cost knows, in row order."""
    known = events["name"].isin(COSTED)
    if "cat" in events:
        known &= events["cat"].eq("cpu_op")
    return np.flatnonzero(known)


def _row_costs(events, rows: np.ndarray) -> list | None:
    """op_cost of each row (None when not costed), evaluated once per distinct signature
    (name, shapes, dtypes, concrete inputs): shapes repeat every layer and step. None when no
    row is costed."""
    if not len(rows) or "input_dims" not in events or "input_types" not in events:
        return None
    dims, types = events["input_dims"][rows], events["input_types"][rows]
    shaped = np.flatnonzero(~(np.equal(dims, None) | np.equal(types, None)))
    if not len(shaped):
        return None  # shapes not recorded
    names = events["name"]
    codes = names.codes[rows[shaped]].tolist()
    conc = events["concrete_inputs"][rows[shaped]] if "concrete_inputs" in events else [None] * len(shaped)
    memo: dict = {}
    out: list = [None] * len(rows)
    for i, code, d, t, c in zip(shaped.tolist(), codes, dims[shaped], types[shaped], conc):
        key = (code, repr((d, t, c)))  # lists are unhashable; their text is the signature
        cost = memo.get(key, memo)
        if cost is memo:
            cost = memo[key] = op_cost(names.values[code], d, t, c)
        out[i] = cost
    return out if any(c is not None for c in memo.values()) else None


def _nest(events, rows: np.ndarray, costs: list) -> list[tuple[int, OpCost]]:
    """Walk each thread's ops (rows sorted by tid, start, longest first) with a stack of the
    open ones; (row, cost) of those that count, in no particular order."""
    names = events["name"]
    kernel = names.value_mask(KERNELS.__contains__)[names.codes[rows]].tolist()
    tids = events["tid"][rows].tolist()
    starts = events["ts_ns"][rows].tolist()
    ends = events["end_ns"][rows].tolist()
    out: list[tuple[int, OpCost]] = []
    stack: list[list] = []  # [end_ns, is_kernel, has_costed_child, row, cost]
    thread = None
    for row, tid, ts, end, is_kernel, cost in zip(rows.tolist(), tids, starts, ends, kernel, costs):
        if tid != thread:
            _close(stack, 0, out)
            stack, thread = [], tid
        k = len(stack)
        while k and stack[k - 1][0] <= ts:
            k -= 1
        _close(stack, k, out)
        if cost is not None:
            outer = next((s for s in reversed(stack) if s[1] and s[4] is not None), None)
            if outer is not None:
                if outer[4].op_class == cost.op_class:
                    # the same work dispatched again inside (a tensor subclass such as DTensor
                    # records global shapes outside, local shapes inside): count the inner op
                    outer[4] = None
                else:
                    cost = None  # a helper of the outer kernel (addmm's bias copy)
            if cost is not None:
                for s in stack:
                    s[2] = True
        stack.append([end, is_kernel, False, row, cost])
    _close(stack, 0, out)
    return out


def _close(stack: list, keep: int, out: list) -> None:
    """Pop the stack down to ``keep`` entries; each popped op that counts goes to ``out``: a
    costed kernel, or a costed wrapper with no costed op inside."""
    for _end, is_kernel, child, row, cost in stack[keep:]:
        if cost is not None and (is_kernel or not child):
            out.append((row, cost))
    del stack[keep:]
