"""Host runtime calls on GPU traces, CUDA and HIP (ROCm) alike: the calls that block until the
device catches up, and the calls that enqueue device work. A leaf module: analyzers import it.

ROCm traces record HIP calls under today's category names (cuda_runtime); MTIA traces launch
through ``runFunction - job_prep_and_submit_for_execution`` (HTA's name for it).
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

LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaMemcpyAsync", "cudaMemsetAsync",
    "hipLaunchKernel", "hipExtLaunchKernel", "hipModuleLaunchKernel", "hipExtModuleLaunchKernel",
    "hipMemcpyAsync", "hipMemsetAsync", "hipMemcpyWithStream",
    "runFunction - job_prep_and_submit_for_execution"})
