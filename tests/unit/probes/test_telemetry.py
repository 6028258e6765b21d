"""The NVML telemetry sampler, exercised on CPU through a stand-in NVML module with pynvml's
function names and return shapes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pynvml

from trainprof.probes.telemetry import TelemetrySampler, decode_throttle
from trainprof.rundir.files import JsonlWriter
from trainprof.analysis.run import RunDir


class FakeNVML:
    """pynvml's API surface the sampler uses; values scripted per call."""

    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, ecc_supported=True):
        self.pending_xids = [79]
        self.ecc_supported = ecc_supported

    def nvmlEventSetCreate(self):
        return "evset"

    def nvmlDeviceRegisterEvents(self, handle, types, evset):
        assert handle == "h0" and types == pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait(self, evset, timeout_ms):
        if not self.pending_xids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError,
                               eventData=self.pending_xids.pop(0))

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=97, memory=41)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 << 30, free=10 << 30, used=70 << 30)

    def nvmlDeviceGetClockInfo(self, h, clock):
        return {pynvml.NVML_CLOCK_SM: 1410, pynvml.NVML_CLOCK_MEM: 1593}[clock]

    def nvmlDeviceGetPowerUsage(self, h):
        return 398_500  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 400_000

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 84

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        if not self.ecc_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 0


def test_sample_fields_and_units(tmp_path):
    s = TelemetrySampler(FakeNVML(), "h0", JsonlWriter(tmp_path / "t.jsonl"), step_fn=lambda: 7)
    rec = s.sample()
    assert rec["step"] == 7 and rec["sm_util_pct"] == 97 and rec["mem_util_pct"] == 41
    assert rec["mem_used_bytes"] == 70 << 30
    assert rec["sm_clock_mhz"] == 1410 and rec["mem_clock_mhz"] == 1593
    assert rec["power_w"] == 398.5 and rec["power_limit_w"] == 400.0 and rec["temp_c"] == 84
    assert sorted(rec["throttle"]) == ["sw_power_cap", "sw_thermal"]
    assert rec["ecc_uncorrected"] == 0 and rec["xid"] == [79]
    assert "xid" not in s.sample()  # each Xid event is reported once


def test_unsupported_fields_are_left_out(tmp_path):
    s = TelemetrySampler(FakeNVML(ecc_supported=False), "h0", JsonlWriter(tmp_path / "t.jsonl"))
    assert "ecc_uncorrected" not in s.sample()


def test_thread_writes_samples_and_stops(tmp_path):
    w = JsonlWriter(tmp_path / "t.jsonl")
    s = TelemetrySampler(FakeNVML(), "h0", w, interval=0.02)
    s.start()
    time.sleep(0.2)
    s.stop()
    n = len((tmp_path / "t.jsonl").read_text().splitlines())
    time.sleep(0.1)
    assert n >= 3 and len((tmp_path / "t.jsonl").read_text().splitlines()) == n


def test_decode_throttle_matches_pynvml_constants():
    mask = pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonGpuIdle
    assert sorted(decode_throttle(mask)) == ["gpu_idle", "hw_thermal"]


def test_no_gpu_is_recorded_and_silent(tmp_path):
    res = subprocess.run([sys.executable, "-c", """
import torch, trainprof
m = torch.nn.Linear(4, 4); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with trainprof.session("run", profile_steps="none"):
    for _ in range(3):
        m(torch.randn(2, 4)).sum().backward(); opt.step()
"""], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "trainprof:" not in res.stderr, res.stderr
    meta = RunDir(tmp_path / "run").rank_meta(0)
    assert meta["telemetry"] == {"enabled": False, "reason": "no CUDA device in use"}
    assert not (tmp_path / "run/ranks/rank-00000/telemetry.jsonl").exists()
