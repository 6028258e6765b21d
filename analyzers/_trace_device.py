"""What a bare trace says about its device and dtypes: the device name from Kineto's
``deviceProperties`` (the entry of the rank's device where the list names several) and each op's
compute dtype from its recorded input types. A leaf module (roofline, gpu_overview)."""

from __future__ import annotations

# torch.profiler's "Input type" strings -> trainprof.devices dtype names
_DTYPES = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp64",
           "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8", "c10::Float8_e4m3fnuz": "fp8",
           "c10::Float8_e5m2fnuz": "fp8"}


def device_properties(trace) -> dict:
    props = trace.meta.get("deviceProperties")
    if not (isinstance(props, list) and props):
        return {}
    props = [p for p in props if isinstance(p, dict)]
    dist = trace.meta.get("distributedInfo")
    rank = dist.get("rank") if isinstance(dist, dict) else None
    if len(props) > 1 and isinstance(rank, int):
        for p in props:  # several listed: the one with the rank's index (one GPU per rank)
            if p.get("id") == rank % len(props):
                return p
    return props[0] if props else {}


def device_name(trace) -> str | None:
    name = device_properties(trace).get("name")
    return name if isinstance(name, str) and name else None


def op_dtype(types) -> str | None:
    """The compute dtype of an op: its first floating-point input's."""
    if not isinstance(types, (list, tuple)):
        return None
    for t in types:
        d = _DTYPES.get(t) if isinstance(t, str) else None
        if d:
            return d
    return None
