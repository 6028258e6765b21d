"""Why a straggler is late: its extra time per step split into input wait, CPU wait (host
contention) and its own work, with the CPU time and context switches of its training thread
(steps.jsonl, Linux) and NVML telemetry (telemetry.jsonl) against its peers'.

Host contention = its extra CPU wait, less what its extra on-CPU time would wait at its peers'
ratio of CPU wait to CPU time, is at least half its excess: another process on its cores. A
rank with more work on an oversubscribed host waits for a CPU too, in proportion to its extra
on-CPU time: that is its own work."""

from __future__ import annotations

import numpy as np

TELEMETRY_FIELDS = ("sm_clock_mhz", "power_w", "temp_c", "sm_util_pct")
# NVML clock-event reasons that slow a busy GPU down (gpu_idle, app clocks etc. do not)
PERF_THROTTLES = {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
SCHED_FIELDS = ("cpu_ms", "cpu_wait_ms", "nvcsw", "nivcsw")
CAUSE_SHARE = 0.5     # a component explaining ≥ half of the excess names the cause
CLOCK_RATIO = 0.9     # SM clock ≤ 90 % of the peers' median: a slowed device
OFF_CPU_SHARE = 0.25  # on-CPU time explains < 25 % of extra own work: the thread was off the CPU


def telemetry(run, kept) -> dict[int, dict]:
    """rank -> medians of the NVML samples taken in the analysed steps (+ throttle reasons)."""
    out = {}
    for r in run.ranks:
        recs = [x for x in run.stream(r, "telemetry") if x.get("step") in kept]
        if not recs:
            continue
        d = {}
        for f in TELEMETRY_FIELDS:
            v = [float(x[f]) for x in recs if isinstance(x.get(f), (int, float))]
            if v:
                d[f] = float(np.median(v))
        thr = [x for x in recs if set(x.get("throttle") or []) & PERF_THROTTLES]
        if thr:
            d["throttle"] = sorted({t for x in thr for t in x["throttle"]} & PERF_THROTTLES)
            d["throttled_frac"] = len(thr) / len(recs)
        if d:
            out[r] = d
    return out


def telemetry_text(mine: dict, peers: list[dict]) -> str:
    """'GPU throttled (sw_thermal) in 80 % of samples, SM clock 1410 vs 1980 MHz ...'."""
    parts = []
    if mine.get("throttle"):
        parts.append(f"GPU throttled ({', '.join(mine['throttle'])}) in "
                     f"{100 * mine.get('throttled_frac', 0):.0f} % of samples")
    for f, label, unit in (("sm_clock_mhz", "SM clock", "MHz"), ("temp_c", "temperature", "°C"),
                           ("power_w", "power", "W")):
        peer = [q[f] for q in peers if isinstance(q.get(f), (int, float))]
        if isinstance(mine.get(f), (int, float)) and peer:
            parts.append(f"{label} {mine[f]:.0f} vs {np.median(peer):.0f} {unit} for its peers")
    return ", ".join(parts)


def _throttled(mine: dict | None, peers: list[dict]) -> bool:
    if not mine:
        return False
    if mine.get("throttle") and not any(q.get("throttle") for q in peers):
        return True
    clk = [q["sm_clock_mhz"] for q in peers if isinstance(q.get("sm_clock_mhz"), (int, float))]
    return (isinstance(mine.get("sm_clock_mhz"), (int, float)) and bool(clk)
            and mine["sm_clock_mhz"] <= CLOCK_RATIO * float(np.median(clk)))


def _signed(x: float) -> str:
    """'+12' / '-3' / '0' ms without a '-0'."""
    v = round(x)
    return f"{v:+d}" if v else "0"


def _diff(p: dict, peers: list[dict], field: str):
    peer = [q[field] for q in peers if isinstance(q.get(field), (int, float))]
    if not isinstance(p.get(field), (int, float)) or not peer:
        return None
    return float(p[field] - np.median(peer))


def _unexplained_wait(p: dict, peers: list[dict], cpu_wait: float, on_cpu) -> float:
    """Its extra CPU wait beyond what its extra on-CPU time would wait at its peers' ratio of
    CPU wait to CPU time (on an oversubscribed host more work also waits more)."""
    if on_cpu is None or on_cpu <= 0:
        return cpu_wait
    run = [q["cpu_ms"] for q in peers if isinstance(q.get("cpu_ms"), (int, float))]
    wait = [q["cpu_wait_ms"] for q in peers if isinstance(q.get("cpu_wait_ms"), (int, float))]
    ratio = float(np.median(wait)) / float(np.median(run)) if run and wait and np.median(run) > 0 else 0.0
    return cpu_wait - ratio * on_cpu


def explain(p: dict, peers: list[dict], excess: float) -> dict:
    """The cause of rank ``p``'s excess (ms per step) from per-rank medians (``data_wait_ms``,
    ``busy_ms``, sched fields, ``telemetry``) against its peers' medians:
    {cause: input | host_contention | device_throttling | compute, parts: {...}, text}."""
    data = _diff(p, peers, "data_wait_ms") or 0.0
    cpu_wait = _diff(p, peers, "cpu_wait_ms")
    on_cpu = _diff(p, peers, "cpu_ms")
    nivcsw = _diff(p, peers, "nivcsw")
    busy = _diff(p, peers, "busy_ms")
    unexplained = _unexplained_wait(p, peers, cpu_wait, on_cpu) if cpu_wait is not None else None
    parts = {"input_ms": data, "cpu_wait_ms": cpu_wait, "cpu_wait_beyond_work_ms": unexplained,
             "cpu_ms": on_cpu, "busy_ms": busy, "nivcsw": nivcsw}
    ex = max(float(excess), 1e-9)
    peer_tel = [q["telemetry"] for q in peers if "telemetry" in q]
    if data >= CAUSE_SHARE * ex:
        cause = "input"
        text = (f"input-bound: it waits {p['data_wait_ms']:.0f} ms/step for its data loader "
                f"({_signed(data)} ms vs its peers)")
    elif unexplained is not None and unexplained >= CAUSE_SHARE * ex:
        # it waits for a CPU more than its extra work explains: another process takes its cores
        cause = "host_contention"
        text = (f"host contention: its training thread waits {p['cpu_wait_ms']:.0f} ms/step for a "
                f"CPU (+{cpu_wait:.0f} ms vs its peers)")
        if nivcsw is not None and nivcsw > 0:
            text += (f", {p['nivcsw']:.0f} involuntary context switches per step "
                     f"({_signed(nivcsw)} vs its peers)")
        text += ": another process competes for its cores"
    elif _throttled(p.get("telemetry"), peer_tel):
        cause = "device_throttling"
        text = "device throttling: " + telemetry_text(p["telemetry"], peer_tel)
    else:
        cause = "compute"
        if busy is not None and busy < CAUSE_SHARE * ex:
            # lateness without more host time (asynchronous collectives: the host runs ahead)
            text = (f"its host time per step matches its peers' ({p['busy_ms']:.0f} ms busy, "
                    f"{_signed(busy)} ms vs its peers): the delay is in when it issues its "
                    "collectives, e.g. its device work before them")
        else:
            text = "compute-bound: its own work takes longer"
            if busy is not None:
                text += f" ({p['busy_ms']:.0f} ms busy per step, {_signed(busy)} ms vs its peers)"
        if on_cpu is not None and busy is not None and busy > 0:
            if on_cpu < OFF_CPU_SHARE * busy:
                text += (f"; its training thread is off the CPU for most of the extra time "
                         f"(on-CPU {_signed(on_cpu)} ms): sleeping, blocked on I/O, a lock or the device")
            else:
                text += f"; on-CPU time {_signed(on_cpu)} ms vs its peers"
    if cause != "host_contention" and cpu_wait is not None and cpu_wait >= 0.25 * ex:
        text += (f"; on a busy host its extra work also waits {cpu_wait:.0f} ms/step more than "
                 "its peers' for a CPU")
    if cause != "device_throttling" and p.get("telemetry"):
        tel = telemetry_text(p["telemetry"], peer_tel)
        if tel:
            text += "; " + tel
    return {"cause": cause, "parts": parts, "text": text}
