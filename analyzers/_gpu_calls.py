"""Host runtime calls on GPU traces, CUDA and HIP (ROCm) alike: the calls that block until the
device catches up. A leaf module: analyzers import it.

ROCm traces record HIP calls under today's category names (cuda_runtime).
"""

from __future__ import annotations

# what .item(), .cpu(), .tolist() and explicit synchronize() do; cudaStreamWaitEvent /
# hipStreamWaitEvent are device-side waits and not among them
CUDA_SYNC = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                       "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyFromSymbol", "cuCtxSynchronize",
                       "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2"})
HIP_SYNC = frozenset({"hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize",
                      "hipMemcpy", "hipMemcpy2D", "hipMemcpyFromSymbol", "hipMemcpyDtoH",
                      "hipMemcpyWithStream", "hipCtxSynchronize"})
SYNC_CALLS = CUDA_SYNC | HIP_SYNC

# asynchronous copies: into pageable host memory they block like a synchronous one
ASYNC_COPIES = ("cudaMemcpyAsync", "hipMemcpyAsync")
