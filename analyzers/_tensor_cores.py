"""Tensor (matrix) cores on GPU traces (docs/gpu-overview.md): which kernels use them, by name,
and which ops could, by op name — the TensorBoard plugin's tensor_core.py lists (after NVIDIA
PyProf) with today's names added."""

from __future__ import annotations

import re

import numpy as np

from trainprof.analyzers._kernel_ops import launch_op_rows

# the plugin's allowlist (after NVIDIA PyProf) plus today's names: CUTLASS tensorop, Hopper
# wgmma, flash attention, and AMD's MFMA Tensile kernels (..._MI32x32x8...)
TC_KERNEL = re.compile(
    r"h884|s884|h1688|s1688|hmma|i8816|16816|dgrad_1x1_stride_2x2|first_layer_wgrad_kernel|"
    r"conv1x1|conv2d_c1_k1|direct_group|xmma_implicit_gemm|xmma_sparse_conv|"
    r"xmma_warp_specialized_implicit_gemm|xmma_gemm|xmma_sparse_gemm|c1688|tensorop|wgmma|gmma|"
    r"flash_fwd|flash_bwd|fmha|_MI\d+x\d+x\d+")
# ops that can run on tensor cores: the plugin's TC_OP_Allowlist's forward names plus today's
# attention and convolution-backward ops (backward GEMMs are aten::mm/addmm/bmm today)
TC_OPS = frozenset({
    "aten::_convolution", "aten::_convolution_nogroup", "aten::conv1d", "aten::conv2d",
    "aten::conv3d", "aten::conv_tbc", "aten::conv_transpose1d", "aten::conv_transpose2d",
    "aten::conv_transpose3d", "aten::convolution", "aten::cudnn_convolution",
    "aten::cudnn_convolution_transpose", "aten::convolution_backward", "aten::prelu",
    "aten::addmm", "aten::addmv", "aten::addr", "aten::matmul", "aten::mm", "aten::mv",
    "aten::linear", "aten::addbmm", "aten::baddbmm", "aten::bmm", "aten::chain_matmul",
    "aten::linalg_multi_dot", "aten::_thnn_fused_lstm_cell", "aten::_thnn_fused_gru_cell",
    "aten::lstm_cell", "aten::gru_cell", "aten::rnn_tanh_cell", "aten::rnn_relu_cell",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
    "aten::_flash_attention_backward", "aten::_efficient_attention_forward",
    "aten::_efficient_attention_backward", "aten::_scaled_mm", "aten::cudnn_convolution_backward",
    "aten::cudnn_convolution_backward_input", "aten::cudnn_convolution_backward_weight",
    "aten::miopen_convolution"})
_FP32 = ("float", "c10::Float")


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 4)


def tensor_core_shares(ev, kernel_rows) -> dict:
    """Shares of kernel time: in tensor-core kernels (of all kernel time); launched by
    tensor-core-eligible ops, and by those on fp32 inputs (of kernel time launched by any op)."""
    dur = ev["dur_ns"][kernel_rows].astype(np.float64)
    total = float(dur.sum())
    tc = ev["name"].mask(lambda n: TC_KERNEL.search(n) is not None)[kernel_rows]
    op = launch_op_rows(ev)[kernel_rows]
    has = op >= 0
    launched = float(dur[has].sum())
    names = ev["name"]
    eligible = np.zeros(len(kernel_rows), bool)
    eligible[has] = names.isin(TC_OPS)[op[has]]
    types = ev["input_types"]
    fp32 = np.zeros(len(kernel_rows), bool)
    for i in np.flatnonzero(eligible):
        t = types[op[i]]
        fp32[i] = bool(t) and any(isinstance(x, str) and x in _FP32 for x in t)
    return {"tensor_core_kernel_share": round(float(dur[tc].sum()) / total, 4) if total else None,
            "tc_eligible_op_share": round(float(dur[eligible].sum()) / launched, 4) if launched else None,
            "tc_eligible_fp32_share": round(float(dur[fp32].sum()) / launched, 4) if launched else None,
            "kernel_ms_launched_by_ops": _ms(launched)}
