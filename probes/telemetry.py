"""GPU telemetry: a low-rate NVML sampler per rank, for its own GPU only.

Stream `telemetry` (one record per sample, joined to steps by the `step` field):
    {"t_ns", "step", "sm_util_pct", "mem_util_pct", "mem_used_bytes", "sm_clock_mhz",
     "mem_clock_mhz", "power_w", "power_limit_w", "temp_c", "throttle": ["sw_thermal", ...],
     "ecc_uncorrected", "xid": [13, ...]}
Fields the device does not support are left out. Without a GPU, or without NVML, the probe
records why in meta.json (`telemetry: {"enabled": false, "reason": ...}`) and stays silent.
The sampler starts at the first step boundary, when the job has chosen its device.
Env: TRAINPROF_TELEMETRY=0 turns it off; TRAINPROF_TELEMETRY_INTERVAL (s, default 1.0).
"""

from __future__ import annotations

import os
import threading
import time

from trainprof import settings
from trainprof.probes import runtime


# NVML clock-event (throttle) reason bits -> short names (nvml.h, nvmlClocksEventReason*).
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "app_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
    0x100: "display_clocks",
}
PERFORMANCE_THROTTLES = {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}


def decode_throttle(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class TelemetrySampler:
    """Samples one GPU through an NVML module (pynvml or a stand-in with the same API)."""

    def __init__(self, nvml, handle, writer, step_fn=lambda: None, interval: float = 1.0):
        self.nvml, self.handle, self.writer = nvml, handle, writer
        self.step_fn, self.interval = step_fn, interval
        self._stop = threading.Event()
        self._thread = None
        self._events = None
        try:  # Xid errors arrive as NVML events; poll the set without blocking
            self._events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        except Exception:  # noqa: BLE001 - unsupported (e.g. some cloud GPUs): no Xid field
            self._events = None

    def _get(self, fn, *args):
        try:
            return getattr(self.nvml, fn)(self.handle, *args)
        except Exception:  # noqa: BLE001 - NotSupported and friends: leave the field out
            return None

    def sample(self) -> dict:
        n = self.nvml
        rec: dict = {"t_ns": time.time_ns(), "step": self.step_fn()}
        util = self._get("nvmlDeviceGetUtilizationRates")
        if util is not None:
            rec["sm_util_pct"], rec["mem_util_pct"] = int(util.gpu), int(util.memory)
        mem = self._get("nvmlDeviceGetMemoryInfo")
        if mem is not None:
            rec["mem_used_bytes"] = int(mem.used)
        for key, clock in (("sm_clock_mhz", n.NVML_CLOCK_SM), ("mem_clock_mhz", n.NVML_CLOCK_MEM)):
            v = self._get("nvmlDeviceGetClockInfo", clock)
            if v is not None:
                rec[key] = int(v)
        power = self._get("nvmlDeviceGetPowerUsage")
        if power is not None:
            rec["power_w"] = power / 1000.0
        limit = self._get("nvmlDeviceGetEnforcedPowerLimit")
        if limit is not None:
            rec["power_limit_w"] = limit / 1000.0
        temp = self._get("nvmlDeviceGetTemperature", n.NVML_TEMPERATURE_GPU)
        if temp is not None:
            rec["temp_c"] = int(temp)
        reasons = self._get("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = self._get("nvmlDeviceGetCurrentClocksThrottleReasons")
        if reasons is not None:
            rec["throttle"] = decode_throttle(int(reasons))
        ecc = self._get("nvmlDeviceGetTotalEccErrors", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        n.NVML_VOLATILE_ECC)
        if ecc is not None:
            rec["ecc_uncorrected"] = int(ecc)
        xids = self._poll_xid()
        if xids:
            rec["xid"] = xids
        return rec

    def _poll_xid(self) -> list[int]:
        out = []
        while self._events is not None:
            try:
                data = self.nvml.nvmlEventSetWait(self._events, 0)
            except Exception:  # noqa: BLE001 - timeout: no pending event
                break
            out.append(int(getattr(data, "eventData", 0)))
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainprof-telemetry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        runtime.name_native_thread()
        while not self._stop.is_set():
            try:
                self.writer.write(self.sample())
            except Exception:  # noqa: BLE001
                pass
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)


def _nvml_handle(nvml, device_index: int):
    """The NVML handle of torch's current device, robust to CUDA_VISIBLE_DEVICES remapping."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        try:
            text = str(uuid)
            return nvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
        except Exception:  # noqa: BLE001
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    physical = int(ids[device_index]) if device_index < len(ids) and ids[device_index].isdigit() \
        else device_index
    return nvml.nvmlDeviceGetHandleByIndex(physical)


def attach(session) -> None:
    if not settings.value("TRAINPROF_TELEMETRY"):
        session.update_meta(telemetry={"enabled": False, "reason": "TRAINPROF_TELEMETRY=0"})
        return
    started = {"done": False}

    def start_on_first_step(rec) -> None:
        if started["done"]:
            return
        started["done"] = True
        reason = _start(session)
        session.update_meta(telemetry={"enabled": reason is None, "reason": reason})

    session.on_step(start_on_first_step)


def _start(session) -> str | None:
    """Start sampling; returns why not, or None when running."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "no CUDA device in use"
    try:
        import pynvml as nvml

        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        return f"NVML unavailable: {e}"
    try:
        handle = _nvml_handle(nvml, torch.cuda.current_device())
    except Exception as e:  # noqa: BLE001
        return f"NVML has no handle for this GPU: {e}"
    interval = settings.value("TRAINPROF_TELEMETRY_INTERVAL")
    sampler = TelemetrySampler(nvml, handle, session.stream("telemetry"),
                               step_fn=lambda: session.clock.step, interval=interval)
    sampler.start()
    session.on_close(sampler.stop)
    return None
