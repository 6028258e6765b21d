"""Trace dialects: the event categories of other profilers' and older PyTorch versions' Chrome
traces, mapped onto the categories the rest of trainprof reads (today's Kineto names).

- PyTorch 1.8-1.10 (Kineto's first releases): ``Kernel``, ``Runtime``, ``Operator``, ``Memcpy``,
  ``Memset`` (and the lower-case ``runtime``/``operator``/``memcpy``/``memset`` the TensorBoard
  plugin also takes); the launching op's id is ``external id`` (lower case) on kernels and runtime
  calls, and shapes are ``Input dims`` — the decoder reads them where ``External id`` / ``Input
  Dims`` are absent.
- MTIA: ``mtia_runtime`` (host calls) and ``mtia_ccp_events`` (device work), as HTA reads them.
- XPU / PrivateUse1 backends: ``xpu_runtime``, ``privateuse1_runtime``.
- CUPTI range-profiler traces: ``cuda_profiler_range`` spans are device time (a kernel or a range
  of kernels measured by the range profiler).
- AMD ROCm traces already use today's names (``kernel``, ``cuda_runtime``) with ``hip*`` calls;
  the call names are in analyzers/_gpu_calls.py.

A trace's ``meta["dialect"]`` lists the categories renamed ({original: canonical}); empty for a
trace in today's names. Events keep their original category nowhere else: analyzers read
canonical names only.
"""

from __future__ import annotations

CANONICAL = {
    "Kernel": "kernel", "Runtime": "cuda_runtime", "runtime": "cuda_runtime",
    "Operator": "cpu_op", "operator": "cpu_op",
    "Memcpy": "gpu_memcpy", "memcpy": "gpu_memcpy", "Memset": "gpu_memset", "memset": "gpu_memset",
    "Driver": "cuda_driver",
    "mtia_runtime": "cuda_runtime", "mtia_ccp_events": "kernel",
    "xpu_runtime": "cuda_runtime", "privateuse1_runtime": "cuda_runtime",
    "cuda_profiler_range": "kernel",
}

# device-side categories after mapping (trainprof.trace.GPU_CATS) and the host calls that launch
# them: what makes a trace a device trace
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def canonical(values: list) -> tuple[list, dict]:
    """(the category values with dialect names replaced, {original: canonical} of those
    replaced)."""
    renamed = {v: CANONICAL[v] for v in values if v in CANONICAL}
    if not renamed:
        return values, {}
    return [CANONICAL.get(v, v) for v in values], renamed
