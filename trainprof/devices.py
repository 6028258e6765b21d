"""Peak compute and memory bandwidth per device, for the roofline and MFU.

A table of vendor datasheet numbers for common accelerators (dense, i.e. without 2:4 sparsity;
FLOP/s of the tensor/matrix cores for bf16/fp16/tf32, and fp32 as plain FP32 throughput),
chosen by the device name the probes record (``torch.cuda.get_device_name``). Devices not in
the table (and CPUs) use the calibration microbenchmark the probes record in
``meta["calibration"]`` (probes/calibration.py). Pure Python: the calibration probe imports it.
"""

from __future__ import annotations

import re

T = 1e12
# (pattern on the device name, entry); first match wins, so specific names come first.
# Entry: name, dense TFLOP/s per dtype, memory bandwidth TB/s.
TABLE: list[tuple[str, dict]] = [
    (r"H100.*PCIe", {"name": "H100 PCIe", "bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51, "tb_s": 2.0}),
    (r"H100.*NVL", {"name": "H100 NVL", "bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60, "tb_s": 3.9}),
    (r"GH200", {"name": "GH200", "bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "tb_s": 4.0}),
    (r"H200", {"name": "H200", "bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "tb_s": 4.8}),
    (r"H100|H800", {"name": "H100 SXM", "bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "tb_s": 3.35}),
    (r"H20\b", {"name": "H20", "bf16": 148, "fp16": 148, "tf32": 74, "fp32": 44, "tb_s": 4.0}),
    (r"B200", {"name": "B200", "bf16": 2250, "fp16": 2250, "tf32": 1100, "fp32": 75, "tb_s": 8.0}),
    (r"(A100|A800).*PCIE.*40GB|(A100|A800)-PCIE-40GB", {"name": "A100 PCIe 40GB", "bf16": 312, "fp16": 312,
                                                        "tf32": 156, "fp32": 19.5, "tb_s": 1.555}),
    (r"(A100|A800).*PCIe", {"name": "A100 PCIe 80GB", "bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5,
                            "tb_s": 1.935}),
    (r"(A100|A800).*40GB", {"name": "A100 SXM 40GB", "bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5,
                            "tb_s": 1.555}),
    (r"A100|A800", {"name": "A100 SXM 80GB", "bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5, "tb_s": 2.039}),
    (r"V100.*PCIE", {"name": "V100 PCIe", "bf16": None, "fp16": 112, "tf32": None, "fp32": 14, "tb_s": 0.9}),
    (r"V100", {"name": "V100 SXM2", "bf16": None, "fp16": 125, "tf32": None, "fp32": 15.7, "tb_s": 0.9}),
    (r"L40S", {"name": "L40S", "bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6, "tb_s": 0.864}),
    (r"L40\b", {"name": "L40", "bf16": 181, "fp16": 181, "tf32": 90.5, "fp32": 90.5, "tb_s": 0.864}),
    (r"\bL4\b", {"name": "L4", "bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3, "tb_s": 0.3}),
    (r"\bA10\b", {"name": "A10", "bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2, "tb_s": 0.6}),
    (r"\bT4\b", {"name": "T4", "bf16": None, "fp16": 65, "tf32": None, "fp32": 8.1, "tb_s": 0.32}),
    (r"MI325X", {"name": "MI325X", "bf16": 1307, "fp16": 1307, "tf32": 654, "fp32": 163, "tb_s": 6.0}),
    (r"MI300X", {"name": "MI300X", "bf16": 1307, "fp16": 1307, "tf32": 654, "fp32": 163, "tb_s": 5.3}),
    (r"MI250X?", {"name": "MI250X", "bf16": 383, "fp16": 383, "tf32": None, "fp32": 95.7, "tb_s": 3.2}),
]
DTYPES = ("bf16", "fp16", "tf32", "fp32")


def lookup(device_name: str | None) -> dict | None:
    """The table entry for a device name (peak FLOP/s per dtype and bytes/s), or None."""
    if not device_name:
        return None
    for pat, e in TABLE:
        if re.search(pat, device_name, re.IGNORECASE):
            return {"name": e["name"], "bytes_per_s": round(e["tb_s"] * T),
                    "flops_per_s": {d: (round(e[d] * T) if e[d] else None) for d in DTYPES}}
    return None


def compute_dtype(run_info: dict | None) -> str:
    """The dtype the matmuls run in: the job's declared dtype (bf16/fp16 autocast), tf32 when
    the job says it allowed it, else fp32."""
    info = run_info or {}
    d = str(info.get("dtype") or info.get("param_dtype") or "fp32").lower()
    d = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}.get(d, d)
    if d == "fp32" and info.get("tf32"):
        return "tf32"
    return d if d in DTYPES else "fp32"


def peak(device_name: str | None, dtype: str, calibration: dict | None = None) -> dict | None:
    """{"flops_per_s", "bytes_per_s", "basis", "dtype"} for one device: the table where the
    device is known (with the peak of ``dtype``), else the calibration measurement."""
    e = lookup(device_name)
    if e and e["flops_per_s"].get(dtype):
        return {"flops_per_s": e["flops_per_s"][dtype], "bytes_per_s": e["bytes_per_s"],
                "basis": f"datasheet {e['name']} dense {dtype}", "dtype": dtype}
    if calibration:
        mm = calibration.get(f"matmul_{dtype}") or calibration.get("matmul") or {}
        cp = calibration.get("copy") or {}
        if mm.get("flops_per_s") and cp.get("bytes_per_s"):
            return {"flops_per_s": float(mm["flops_per_s"]), "bytes_per_s": float(cp["bytes_per_s"]),
                    "basis": (f"calibration on {calibration.get('device_name') or calibration.get('device')}: "
                              f"{mm.get('dtype', 'fp32')} matmul n={mm.get('n')}, "
                              f"{calibration.get('threads')} thread(s); copy {cp.get('bytes', 0) >> 20} MiB"),
                    "dtype": mm.get("dtype", dtype), "threads": calibration.get("threads")}
    return None
