"""Why a straggler is late: its extra time per step split into input wait, its own work on the
CPU, CPU wait (host contention) and time off the CPU, with the CPU time and context switches of
its training thread (steps.jsonl, Linux) and NVML telemetry (telemetry.jsonl) against its peers'.

Extra on-CPU time of its training thread (≥ a quarter of the excess) is its own work and named
first. Host contention = its extra CPU wait, less what its extra on-CPU time would wait at its
peers' ratio of CPU wait to CPU time: the cause when it is at least half the excess and the
rank's CPU time did not grow (another process on its cores), a second factor beside its own
extra work otherwise. Extra busy time that is neither on a CPU nor waiting for one is time off
the CPU: sleeping or blocked (I/O, a lock, the OS, the device)."""

from __future__ import annotations

import numpy as np

TELEMETRY_FIELDS = ("sm_clock_mhz", "power_w", "temp_c", "sm_util_pct")
# NVML clock-event reasons that slow a busy GPU down (gpu_idle, app clocks etc. do not)
PERF_THROTTLES = {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
SCHED_FIELDS = ("cpu_ms", "cpu_wait_ms", "nvcsw", "nivcsw")
CAUSE_SHARE = 0.5     # a component explaining ≥ half of the excess names the cause
CLOCK_RATIO = 0.9     # SM clock ≤ 90 % of the peers' median: a slowed device
OFF_CPU_SHARE = 0.25  # extra on-CPU time ≥ 25 % of the excess: its own CPU work, named first;
                      # < 25 % of its extra busy time: the thread was off the CPU


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


def ms(x: float) -> str:
    """A time in ms with the precision its size needs: '128', '3.4', '0.42' (a 4 ms step's
    excess is not '1 ms vs 0 ms')."""
    a = abs(x)
    return f"{x:.0f}" if a >= 10 or a == 0 else f"{x:.1f}" if a >= 1 else f"{x:.2f}"


def _signed_ms(x: float) -> str:
    """'+12' / '-3.4' / '+0.42' / '0' ms."""
    return "0" if abs(x) < 0.005 else ("+" if x > 0 else "") + ms(x)


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


def _peer_median(peers: list[dict], field: str):
    v = [q[field] for q in peers if isinstance(q.get(field), (int, float))]
    return float(np.median(v)) if v else None


def _where_on_cpu(on_cpu: float, ops) -> tuple[str, str]:
    """(where its extra on-CPU time goes, a note on its torch ops): outside torch ops when the
    profiled steps show its torch ops taking (almost) no longer than its peers'."""
    if ops is not None and ops < OFF_CPU_SHARE * on_cpu:
        return ("outside torch ops (Python / host code)",
                f"; its torch ops {ops:+.1f} ms vs its peers' in the profiled steps")
    return "(Python / host code, or torch ops run on the CPU)", ""


def _contention_text(p: dict, cpu_wait: float, nivcsw, also: bool = False) -> str:
    text = (f"its training thread waits {ms(p['cpu_wait_ms'])} ms/step for a CPU"
            if not also else f"it also waits {ms(p['cpu_wait_ms'])} ms/step for a CPU")
    text += f" ({_signed_ms(cpu_wait)} ms vs its peers{', more than its extra work explains' if also else ''})"
    if nivcsw is not None and nivcsw > 0:
        text += (f", {p['nivcsw']:.0f} involuntary context switches per step "
                 f"({_signed(nivcsw)} vs its peers)")
    return text


def explain(p: dict, peers: list[dict], excess: float, ops_ms: dict | None = None) -> dict:
    """The cause of rank ``p``'s excess (ms per step) from per-rank medians (``data_wait_ms``,
    ``busy_ms``, sched fields, ``telemetry``) against its peers' medians:
    {cause: input | compute | host_contention | device_throttling | off_cpu, parts: {...},
    text}. ``ops_ms``: rank -> its torch ops' time per profiled step (CPU traces), which tells
    whether extra on-CPU time is in torch ops or outside them.

    Its own extra on-CPU time (≥ OFF_CPU_SHARE of the excess) is its own work and is named
    first, with a CPU wait beyond what that work explains as a second factor; host contention
    is the cause when its CPU time did not grow that much but it waited for a CPU (beyond what
    its extra work explains, or for most of its longer busy time while its CPU time grew by
    less than OFF_CPU_SHARE of the excess); off_cpu when its busy time grew with its CPU time
    and CPU wait flat (sleeping, blocked)."""
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
    own_time = busy is not None and busy >= CAUSE_SHARE * ex  # the excess is in its own time
    contention_also = False
    if data >= CAUSE_SHARE * ex:
        cause = "input"
        text = (f"input-bound: it waits {ms(p['data_wait_ms'])} ms/step for its data loader "
                f"({_signed_ms(data)} ms vs its peers)")
    elif own_time and on_cpu is not None and on_cpu >= OFF_CPU_SHARE * ex:
        # its own extra work on the CPU, whatever else slows it
        cause = "compute"
        ops = _diff({"ops": (ops_ms or {}).get(p.get("rank"))},
                    [{"ops": (ops_ms or {}).get(q.get("rank"))} for q in peers], "ops")
        where, note = _where_on_cpu(on_cpu, ops)
        text = (f"its own work on the CPU: its training thread spends {ms(on_cpu)} ms/step more "
                f"on the CPU {where} than its peers ({p['cpu_ms']:.1f} vs "
                f"{_peer_median(peers, 'cpu_ms'):.1f} ms per step{note})")
        if unexplained is not None and unexplained >= OFF_CPU_SHARE * ex:
            contention_also = True
            text += ("; " + _contention_text(p, cpu_wait, nivcsw, also=True)
                     + ": other processes compete for its cores too")
    elif unexplained is not None and unexplained >= CAUSE_SHARE * ex:
        # it waits for a CPU more than its extra work explains: another process takes its cores
        cause = "host_contention"
        text = ("host contention: " + _contention_text(p, cpu_wait, nivcsw)
                + ": another process competes for its cores")
    elif _throttled(p.get("telemetry"), peer_tel):
        cause = "device_throttling"
        text = "device throttling: " + telemetry_text(p["telemetry"], peer_tel)
    elif own_time and on_cpu is not None and cpu_wait is not None and cpu_wait >= CAUSE_SHARE * busy \
            and busy - max(on_cpu, 0.0) - cpu_wait < CAUSE_SHARE * busy:
        # hardly more work on the CPU, and most of its longer busy time spent waiting for one
        # (more than its little extra work explains at its peers' ratio, or not): the host.
        # Against the busy time, not the excess: a straggling episode in part of the steps
        # has a median excess (per-step differences) above the difference of its medians
        cause = "host_contention"
        text = ("host contention: " + _contention_text(p, cpu_wait, nivcsw)
                + ": other processes compete for its cores")
    elif own_time and on_cpu is not None and on_cpu < OFF_CPU_SHARE * busy:
        # longer busy time that is neither on a CPU nor waiting for one
        cause = "off_cpu"
        grew = (f"grew by only {ms(on_cpu)} ms" if on_cpu >= 1.0
                else "did not grow")  # less CPU time than its peers' is noise, not a time
        text = (f"off the CPU (sleeping / blocked: I/O, a lock, the OS"
                f"{', the device' if p.get('telemetry') else ''}): its own work takes "
                f"{ms(busy)} ms/step longer than its peers' ({ms(p['busy_ms'])} ms busy per "
                f"step) while its training thread's CPU time {grew} ({p['cpu_ms']:.1f} ms per "
                f"step vs {_peer_median(peers, 'cpu_ms'):.1f} ms for its peers)")
    else:
        cause = "compute"
        if not own_time and busy is not None:
            # lateness without more host time (asynchronous collectives: the host runs ahead)
            text = (f"its host time per step matches its peers' ({ms(p['busy_ms'])} ms busy, "
                    f"{_signed_ms(busy)} ms vs its peers): the delay is in when it issues its "
                    "collectives, e.g. its device work before them")
        else:
            text = "compute-bound: its own work takes longer"
            if busy is not None:
                text += f" ({ms(p['busy_ms'])} ms busy per step, {_signed_ms(busy)} ms vs its peers)"
            if on_cpu is not None and on_cpu > 0:
                text += f"; on-CPU time {_signed_ms(on_cpu)} ms vs its peers"
    if (cause != "host_contention" and not contention_also and cpu_wait is not None
            and cpu_wait >= 0.25 * ex):
        text += (f"; on a busy host its extra work also waits {ms(cpu_wait)} ms/step more than "
                 "its peers' for a CPU")
    if cause != "device_throttling" and p.get("telemetry"):
        tel = telemetry_text(p["telemetry"], peer_tel)
        if tel:
            text += "; " + tel
    return {"cause": cause, "parts": parts, "text": text}
