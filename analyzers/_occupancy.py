"""Estimated achieved occupancy of a kernel from its launch figures and the device's limits, where
the trace does not carry Kineto's "est. achieved occupancy %" (docs/gpu-overview.md).

Theoretical occupancy (the CUDA occupancy calculator's rule, without the per-block allocation
granularity of shared memory): resident blocks per SM = the least of
  max warps per SM ÷ warps per block,
  registers per SM ÷ (registers per warp, rounded up to 256, × warps per block),
  shared memory per SM ÷ shared memory per block,
  the device's block limit (maxBlocksPerMultiProcessor, else 32);
theoretical = resident blocks × warps per block ÷ max warps per SM.
Estimated achieved (as Kineto estimates it) = min(launched warps per SM ÷ max warps per SM,
theoretical), launched warps per SM = grid blocks × warps per block ÷ SMs: a grid too small to
fill the device cannot reach its theoretical occupancy.
"""

from __future__ import annotations

import numpy as np

REG_ALLOC_UNIT = 256      # registers are allocated per warp in units of 256
DEFAULT_MAX_BLOCKS = 32   # resident blocks per SM on compute capability 5.0 and later (9.0: 32)


def _num(props: dict, key: str):
    v = props.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def estimate(props: dict, grid_blocks, block_threads, regs, smem) -> np.ndarray:
    """Estimated achieved occupancy (0..1) per kernel; NaN where a figure or a device limit is
    missing (registers per thread and block size are needed; shared memory absent counts as 0)."""
    grid_blocks, block_threads, regs, smem = (np.asarray(a, np.float64) for a in
                                              (grid_blocks, block_threads, regs, smem))
    out = np.full(len(grid_blocks), np.nan)
    warp = _num(props, "warpSize") or 32.0
    max_threads, sms = _num(props, "maxThreadsPerMultiprocessor"), _num(props, "numSms")
    regs_sm = _num(props, "regsPerMultiprocessor")
    if not (max_threads and sms and regs_sm):
        return out
    smem_sm = _num(props, "sharedMemPerMultiprocessor") or np.inf
    max_blocks = _num(props, "maxBlocksPerMultiProcessor") or DEFAULT_MAX_BLOCKS
    max_warps = max_threads / warp
    ok = ~np.isnan(block_threads) & ~np.isnan(regs) & ~np.isnan(grid_blocks) & (block_threads > 0)
    if not ok.any():
        return out
    wpb = np.ceil(block_threads[ok] / warp)
    by_warps = np.floor(max_warps / wpb)
    reg_warp = np.ceil(regs[ok] * warp / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    with np.errstate(divide="ignore", invalid="ignore"):
        by_regs = np.where(reg_warp > 0, np.floor(np.floor(regs_sm / reg_warp) / wpb), np.inf)
        sm = np.nan_to_num(smem[ok], nan=0.0)
        by_smem = np.where(sm > 0, np.floor(smem_sm / sm), np.inf)
    blocks = np.minimum(np.minimum(by_warps, by_regs), np.minimum(by_smem, max_blocks))
    theoretical = blocks * wpb / max_warps
    launched = grid_blocks[ok] * wpb / sms / max_warps
    out[ok] = np.minimum(launched, theoretical)
    return out
