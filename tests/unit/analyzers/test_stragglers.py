"""stragglers analyzer: hand-built runs of 2, 4, 8 and 1,024 ranks (own time = step − waits,
per-step excess over the other peers, scores hand-computed), the cause named (input, CPU wait,
device throttling, own work on or off the CPU), the waits a straggler causes attributed to it and left out of
exposed communication.

Cases that run multi-process jobs: tests/integration/test_stragglers_jobs.py."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pandas as pd
import pytest

from trainprof.analyzers import (_peer_waits, _straggler_cause, _straggler_judge, collectives,
                                   comm_compute, stragglers)
from trainprof.rundir.files import JsonlWriter, rank_dir
from trainprof.analysis.run import RunDir

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
STEP_MS = 1000.0


def coords(r):  # dp2 · pp2 · tp2, row-major like init_device_mesh
    return {"dp": r // 4, "pp": (r // 2) % 2, "tp": r % 2}


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def make_run(root, busy, data=None, steps=6, nranks=8, mesh=True, sched=None, late=None,
             device=None, buckets=1):
    """busy[rank][step] = ms of work, then the rank enters an all_reduce that ends with the
    step (blocked the rest of the 1000 ms step, less data[rank][step] ms of data wait).
    sched[rank][step]: extra steps.jsonl fields. late[rank][step]: async mode (NCCL-like, the
    host never blocks): `buckets` all_reduces per step enqueued at busy + late ms, blocked
    0.1 ms, every step still 1000 ms. device[rank][step]: device_ms of the step's op."""
    data, sched = data or {}, sched or {}
    group = [{"pg": "0", "ranks": list(range(nranks)), "mesh_dim": None, "backend": "gloo",
              "size": nranks}]
    for r in range(nranks):
        d = rank_dir(root, r)
        d.mkdir(parents=True)
        meta = {"rank": r, "world_size": nranks, "host": f"node{r // 4}"}
        if mesh:
            meta.update(coords=coords(r), pipeline={"stages": [coords(r)["pp"]]})
        (d / "meta.json").write_text(json.dumps(meta))
        st, co, da = [], [], []
        for s in range(steps):
            start = T0 + s * int(STEP_MS * MS)
            st.append({"step": s, "start_ns": start, "end_ns": start + int(STEP_MS * MS),
                       "dur_ms": STEP_MS, "source": "optimizer", **sched.get(r, {}).get(s, {})})
            wait = data.get(r, {}).get(s, 0.0)
            da.append({"step": s, "wait_ms": wait, "batches": 1})
            if late is not None:
                for b in range(buckets):
                    enq = start + int((busy[r][s] + late[r][s] + 10 * b) * MS)
                    co.append({"step": s, "pg": "0", "seq": len(co), "op": "all_reduce",
                               "bytes": 8, "enqueue_ns": enq, "end_ns": enq + 1 * MS,
                               "blocked_ms": 0.1, "async": True, "api": "ddp.bucket", "bucket": b})
                continue
            blocked = STEP_MS - busy[r][s] - wait
            rec = {"step": s, "pg": "0", "seq": len(co), "op": "all_reduce", "bytes": 8,
                   "enqueue_ns": start + int((STEP_MS - blocked) * MS),
                   "end_ns": start + int(STEP_MS * MS), "blocked_ms": blocked}
            if device is not None:
                rec.update(blocked_ms=0.1, device_ms=device[r][s])
            co.append(rec)
        for name, recs in (("steps", st), ("collectives", co), ("data", da), ("groups", group)):
            _write(d / f"{name}.jsonl", recs)
    return RunDir(root)


def add_telemetry(root, rank, steps=6, clock=1980, throttle=()):
    w = JsonlWriter(rank_dir(root, rank) / "telemetry.jsonl")
    for s in range(steps):
        w.write({"t_ns": T0 + s * int(STEP_MS * MS), "step": s, "sm_clock_mhz": clock,
                 "temp_c": 60, "power_w": 300.0, "throttle": ["gpu_idle", *throttle]})
    w.close()


def noisy_busy(seed=0, steps=6, nranks=8, sd=15.0):
    rng = np.random.default_rng(seed)
    return {r: list(500 + rng.normal(0, sd, steps)) for r in range(nranks)}


def loo_median(v, i):
    return float(np.median([x for j, x in enumerate(v) if j != i]))


def hand_noise(x: dict, steps) -> float:
    """1.4826 · median |x(s) − x(s−1)| / √2 over every rank's series, pooled."""
    d = [abs(x[r][b] - x[r][a]) for r in x for a, b in zip(steps, steps[1:])]
    return 1.4826 * float(np.median(d)) / math.sqrt(2)


def straggler_findings(res):
    return [f for f in res.findings if f.kind == "straggler"]


def test_straggler_by_hand(tmp_path):
    busy = noisy_busy()
    for s in range(6):
        busy[5][s] += 200
    res = stragglers.analyze(make_run(tmp_path, busy))
    found = straggler_findings(res)
    assert len(found) == 1 and found[0].ranks == [5]
    ev = found[0].evidence
    assert ev["coords"] == {"dp": 1, "pp": 0, "tp": 1} and ev["host"] == "node1"
    assert ev["peers"] == [0, 1, 4]  # the other pp-0 ranks
    # hand computation over the analysed steps 1..5: excess = own − median of the other peers
    steps = range(1, 6)
    groups = {r: [q for q in range(8) if coords(q)["pp"] == coords(r)["pp"]] for r in range(8)}
    x = {r: {s: busy[r][s] - loo_median([busy[q][s] for q in groups[r]], groups[r].index(r))
             for s in steps} for r in range(8)}
    noise = hand_noise(x, list(steps))
    e5 = float(np.median(list(x[5].values())))
    m = res.metrics
    assert m["noise_ms"] == pytest.approx(noise)
    p5 = next(p for p in m["per_rank"] if p["rank"] == 5)
    assert p5["excess_ms"] == pytest.approx(e5)
    assert p5["score"] == pytest.approx(e5 / max(noise, _straggler_judge.FLOOR * STEP_MS))
    assert p5["status"] == "chronic" and p5["straggling_steps"] == [1, 2, 3, 4, 5]
    assert p5["signal"] == "own_time"
    assert m["steps_analysed"] == [1, 2, 3, 4, 5]
    assert m["busy_ms_by_rank"]["5"][0] == pytest.approx(busy[5][1])
    # its peers wait for it: min(their blocked time, its arrival − theirs), median per step
    for q in (0, 1, 4):
        want = np.median([min(STEP_MS - busy[q][s], max(0.0, busy[5][s] - busy[q][s])) for s in steps])
        assert ev["waits_caused_ms"][str(q)] == pytest.approx(want, abs=1e-3)
    assert ev["cause"] == "compute"
    json.dumps(m)


def test_two_ranks_by_hand(tmp_path):
    # two ranks: the excess is the plain difference of the two, the noise its step-to-step
    # variation; rank 1 works 120 ms more per step (12 % of the step) with ±15 ms noise
    busy = noisy_busy(5, steps=12, nranks=2)
    busy[1] = [b + 120 for b in busy[1]]
    res = stragglers.analyze(make_run(tmp_path, busy, steps=12, nranks=2, mesh=False))
    steps = list(range(1, 12))
    x = {1: {s: busy[1][s] - busy[0][s] for s in steps}, 0: {s: busy[0][s] - busy[1][s] for s in steps}}
    noise = hand_noise(x, steps)
    e1 = float(np.median(list(x[1].values())))
    per = {p["rank"]: p for p in res.metrics["per_rank"]}
    assert per[1]["excess_ms"] == pytest.approx(e1) and per[0]["excess_ms"] == pytest.approx(-e1)
    assert per[1]["score"] == pytest.approx(e1 / max(noise, _straggler_judge.FLOOR * STEP_MS))
    assert per[1]["score"] >= _straggler_judge.SCORE
    # arrival lateness on 2 ranks: the difference of the two enqueues
    assert per[1]["late_ms"] == pytest.approx(e1, abs=1e-3)
    (f,) = straggler_findings(res)
    assert f.ranks == [1] and f.evidence["waiters"] == [0]
    want = np.median([min(STEP_MS - busy[0][s], max(0.0, busy[1][s] - busy[0][s])) for s in steps])
    assert f.evidence["waiters_wait_ms"] == pytest.approx(want, abs=1e-3)
    assert f"rank 0 waits {want:.0f} ms/step in all_reduce for rank 1" in f.message


@pytest.mark.parametrize("seed", range(4))
def test_two_ranks_clean_silent(tmp_path, seed):
    # clean 2-rank CPU runs: one rank systematically ~9 % slower, or slower by 10-50 % in a
    # random half of the steps (another process on its core now and then): no finding
    rng = np.random.default_rng(seed)
    busy = noisy_busy(seed, steps=30, nranks=2, sd=30)
    if seed % 2:
        busy[0] = [b + 90 for b in busy[0]]
    else:
        busy[0] = [b + (rng.uniform(100, 500) if rng.random() < 0.5 else 0) for b in busy[0]]
    res = stragglers.analyze(make_run(tmp_path, busy, steps=30, nranks=2, mesh=False))
    assert not res.findings, [f.message for f in res.findings]
    assert res.metrics["chronic"] == []


def test_transient_and_clean_are_silent(tmp_path):
    busy = noisy_busy(1)
    busy[3][2] += 400  # one bad step only: transient, not a finding
    res = stragglers.analyze(make_run(tmp_path, busy))
    assert not res.findings
    assert res.metrics["transient"] == [3] and res.metrics["chronic"] == []


def test_many_ranks_statistic():
    # 1,024 ranks in one peer group, 12 steps: rank 700 is 15 % of the step behind in every
    # step; ranks 0-99 run 4 % slower throughout (a slower host: a systematic offset, not a
    # straggler). The spread of E over the group joins the scale; only rank 700 is chronic.
    import pandas as pd

    rng = np.random.default_rng(7)
    n, steps = 1024, 12
    x = rng.normal(0, 20, (n, steps))
    x[:100] += 40
    x[700] += 150
    k = pd.DataFrame({"rank": np.repeat(np.arange(n), steps), "step": np.tile(np.arange(steps), n),
                      "group": "all", "excess_ms": x.reshape(-1)})
    per, noise = _straggler_judge.judge(k, "excess_ms", STEP_MS)
    d = np.abs(np.diff(x, axis=1)).reshape(-1)
    assert noise == pytest.approx(1.4826 * np.median(d) / math.sqrt(2))
    e = np.median(x, axis=1)
    spread = 1.4826 * np.median(np.abs(e - np.median(e)))
    scale = max(noise, spread, _straggler_judge.FLOOR * STEP_MS)
    assert per[700]["score"] == pytest.approx(e[700] / scale)
    assert [r for r, p in per.items() if p["status"] == "chronic"] == [700]
    assert per[700]["steps"] == list(range(steps))


def test_many_ranks_run(tmp_path):
    # the same through a run directory (128 ranks): named, and every other rank waits for it
    n, steps = 128, 8
    busy = noisy_busy(7, steps=steps, nranks=n, sd=20)
    busy[100] = [b + 150 for b in busy[100]]
    run = make_run(tmp_path, busy, steps=steps, nranks=n, mesh=False)
    res = stragglers.analyze(run)
    assert [f.ranks for f in straggler_findings(res)] == [[100]]
    assert res.metrics["chronic"] == [100]
    f = straggler_findings(res)[0]
    assert f.evidence["waiters"] == [r for r in range(n) if r != 100]
    assert "ranks 0–99, 101–127 wait" in f.message
    # the evidence keeps the 32 largest per-rank waits, the count and the median of all 127;
    # the exposed-communication judgments still get every rank's wait
    ev, full = f.evidence, stragglers.waits_for_stragglers(run)["wait_ms"]
    assert set(full) == set(range(n)) - {100}
    assert ev["waits_caused_count"] == n - 1 and len(ev["waits_caused_ms"]) == 32
    top = sorted(full.values(), reverse=True)[:32]
    assert sorted(ev["waits_caused_ms"].values(), reverse=True) == pytest.approx(top)
    assert ev["waits_caused_median_ms"] == pytest.approx(float(np.median(list(full.values()))))


def test_whole_stage_slow_is_not_a_straggler(tmp_path):
    busy = noisy_busy(3)
    for r in range(8):
        if coords(r)["pp"] == 1:
            busy[r] = [b + 300 for b in busy[r]]
    assert not stragglers.analyze(make_run(tmp_path, busy)).findings


def test_data_wait_is_starvation_not_straggling(tmp_path):
    busy = noisy_busy(2)
    data = {2: {s: 300.0 for s in range(6)}}
    res = stragglers.analyze(make_run(tmp_path, busy, data))
    assert [f.kind for f in res.findings] == ["data_starvation"]
    f = res.findings[0]
    assert f.ranks == [2] and f.evidence["ranks"]["2"]["data_wait_ms"] == pytest.approx(300)
    # it is late because of its input: the others' waits in the all_reduce are its, reported here
    assert f.evidence["late_for_input"] == [2]
    want = np.median([np.median([busy[2][s] + 300 - busy[q][s] for s in range(1, 6)])
                      for q in range(8) if q != 2])
    assert f"ranks 0, 1, 3–7 wait {want:.0f} ms/step in all_reduce for rank 2" in f.message
    assert stragglers.waits_for_stragglers(RunDir(tmp_path))["late"] == [2]


def test_async_collectives_lateness(tmp_path):
    # NCCL-like: the host never blocks in a collective (0.1 ms), every step takes 1000 ms;
    # rank 2 issues its three gradient buckets 150 ms after the others: only arrival
    # lateness shows it
    rng = np.random.default_rng(11)
    busy = {r: [400.0] * 8 for r in range(4)}
    late = {r: list(rng.normal(0, 5, 8) + (150 if r == 2 else 0)) for r in range(4)}
    res = stragglers.analyze(make_run(tmp_path, busy, steps=8, nranks=4, mesh=False, late=late,
                                      buckets=3))
    (f,) = straggler_findings(res)
    assert f.ranks == [2] and f.evidence["signal"] == "lateness"
    per = {p["rank"]: p for p in res.metrics["per_rank"]}
    assert per[2]["late_ms"] == pytest.approx(150, abs=10)
    assert abs(per[2]["excess_ms"]) < 1  # own time tells nothing here
    assert "issues its collectives" in f.message and "not in the collective log" in f.message


def _set_blocked(root, nranks, blocked_of):
    for r in range(nranks):
        path = rank_dir(root, r) / "collectives.jsonl"
        recs = [json.loads(x) for x in path.read_text().splitlines()]
        for c in recs:
            c["blocked_ms"] = blocked_of(r)
        _write(path, recs)


@pytest.mark.parametrize("peers_wait_longer", [False, True])
def test_lateness_needs_the_host_waits_to_agree(tmp_path, peers_wait_longer):
    """Rank 2 issues its collectives 150 ms after its peers every step, and the host blocks in
    them (300 ms a step). If every rank waits the same 300 ms nobody waits for rank 2 (its
    previous collective completed later: shared cores), so no straggler; if its peers wait
    150 ms longer than it does, it is one."""
    rng = np.random.default_rng(11)
    busy = {r: [400.0] * 8 for r in range(4)}
    late = {r: list(rng.normal(0, 5, 8) + (150 if r == 2 else 0)) for r in range(4)}
    make_run(tmp_path, busy, steps=8, nranks=4, mesh=False, late=late, buckets=1)
    _set_blocked(tmp_path, 4, lambda r: 150.0 if (peers_wait_longer and r == 2) else 300.0)
    res = stragglers.analyze(RunDir(tmp_path))
    per = {p["rank"]: p for p in res.metrics["per_rank"]}
    assert per[2]["late_ms"] == pytest.approx(150, abs=10)
    if peers_wait_longer:
        (f,) = straggler_findings(res)
        assert f.ranks == [2] and "lateness_unconfirmed" not in per[2]
    else:
        assert straggler_findings(res) == [] and per[2]["status"] == "ok"
        assert per[2]["lateness_unconfirmed"] == {"late_ms": pytest.approx(150, abs=10),
                                                  "wait_ms": 300.0, "peer_wait_ms": 300.0}


def test_device_waits_and_throttling(tmp_path):
    # GPU-like: the host is not blocked; on the device ranks 0, 1, 2 spin 250 ms per step in
    # the all_reduce for rank 3, whose GPU is thermally throttled
    busy = {r: [700.0] * 6 for r in range(4)}
    device = {r: [5.0 + (0 if r == 3 else 250 + 3 * r)] * 6 for r in range(4)}
    make_run(tmp_path, busy, nranks=4, mesh=False, device=device)
    for r in range(4):  # gpu_idle is not a throttle
        add_telemetry(tmp_path, r, clock=1410 if r == 3 else 1980,
                      throttle=("sw_thermal",) if r == 3 else ())
    res = stragglers.analyze(RunDir(tmp_path))
    (f,) = straggler_findings(res)
    assert f.ranks == [3] and f.evidence["cause"] == "device_throttling"
    assert "sw_thermal" in f.message and "1410 vs 1980 MHz" in f.message
    per = {p["rank"]: p for p in res.metrics["per_rank"]}
    assert per[0]["blocked_ms"] == pytest.approx(250)  # device wait: 255 − 5
    assert "throttle" not in per[0]["telemetry"]
    assert f.evidence["waits_caused_ms"] == {"0": pytest.approx(250), "1": pytest.approx(253),
                                             "2": pytest.approx(256)}
    assert "ranks 0–2 wait 253 ms/step in all_reduce for rank 3" in f.message
    json.dumps(res.metrics)


def test_host_contention_named(tmp_path):
    # rank 1 waits for a CPU (schedstat run delay) 200 ms per step more than rank 0: that
    # is its whole excess
    busy = noisy_busy(9, steps=10, nranks=2)
    busy[1] = [b + 200 for b in busy[1]]
    sched = {r: {s: {"cpu_ms": busy[0][s] - 20, "cpu_wait_ms": 15.0 + (200 if r else 0),
                     "nvcsw": 10, "nivcsw": 40 if r else 5} for s in range(10)} for r in range(2)}
    res = stragglers.analyze(make_run(tmp_path, busy, steps=10, nranks=2, mesh=False, sched=sched))
    (f,) = straggler_findings(res)
    assert f.ranks == [1] and f.evidence["cause"] == "host_contention"
    assert f.evidence["cpu_wait_ms"] == pytest.approx(215)
    assert "waits 215 ms/step for a CPU (+200 ms vs its peers)" in f.message
    assert "40 involuntary context switches per step (+35 vs its peers)" in f.message


def test_more_work_on_a_busy_host_is_not_host_contention(tmp_path):
    # 8 ranks on 2 cores: every rank waits 1.6 ms for a CPU per ms on it; rank 1 does 80 ms
    # more CPU work, which waits 128 ms more (+208 ms own time): its own work, not contention
    busy = noisy_busy(9, steps=10, nranks=2)
    busy[1] = [b + 208 for b in busy[1]]
    sched = {r: {s: {"cpu_ms": 100.0 + (80 if r else 0), "cpu_wait_ms": 160.0 + (128 if r else 0),
                     "nvcsw": 10, "nivcsw": 50} for s in range(10)} for r in range(2)}
    res = stragglers.analyze(make_run(tmp_path, busy, steps=10, nranks=2, mesh=False, sched=sched))
    (f,) = straggler_findings(res)
    assert f.evidence["cause"] == "compute"
    assert "on a busy host its extra work also waits 128 ms/step" in f.message


def test_off_cpu_straggler(tmp_path):
    # the same extra 200 ms, but neither on a CPU nor waiting for one: a sleep, I/O, a lock
    busy = noisy_busy(9, steps=10, nranks=2)
    busy[1] = [b + 200 for b in busy[1]]
    sched = {r: {s: {"cpu_ms": 480.0, "cpu_wait_ms": 15.0, "nvcsw": 10, "nivcsw": 5}
                 for s in range(10)} for r in range(2)}
    res = stragglers.analyze(make_run(tmp_path, busy, steps=10, nranks=2, mesh=False, sched=sched))
    (f,) = straggler_findings(res)
    assert f.evidence["cause"] == "off_cpu", f.message
    assert "off the CPU (sleeping / blocked: I/O, a lock, the OS)" in f.message
    assert "compute-bound" not in f.message
    assert "CPU time did not grow (480.0 ms per step vs 480.0 ms for its peers)" in f.message


def test_off_cpu_straggler_with_less_cpu_time_than_its_peers(tmp_path):
    # a sleeping rank whose thread is on the CPU 2 ms less than its peer's (measurement noise):
    # no negative time in the message
    busy = noisy_busy(9, steps=10, nranks=2)
    busy[1] = [b + 200 for b in busy[1]]
    sched = {r: {s: {"cpu_ms": 480.0 - (2 if r else 0), "cpu_wait_ms": 15.0, "nvcsw": 10,
                     "nivcsw": 5} for s in range(10)} for r in range(2)}
    res = stragglers.analyze(make_run(tmp_path, busy, steps=10, nranks=2, mesh=False, sched=sched))
    (f,) = straggler_findings(res)
    assert f.evidence["cause"] == "off_cpu" and f.evidence["cause_parts"]["cpu_ms"] == pytest.approx(-2)
    assert "did not grow (478.0 ms per step vs 480.0 ms for its peers)" in f.message
    assert not re.search(r"(?<![\w.])-\d", f.message), f.message


def test_own_cpu_work_named_before_contention(tmp_path):
    # rank 1 runs 220 ms more Python per step, and on a busy host also waits 240 ms more for
    # a CPU (its peer, blocked in the all_reduce, hardly waits): its own work first, the
    # contention as a second factor
    busy = noisy_busy(9, steps=10, nranks=2)
    busy[1] = [b + 460 for b in busy[1]]
    sched = {r: {s: {"cpu_ms": 40.0 + (220 if r else 0), "cpu_wait_ms": 2.0 + (240 if r else 0),
                     "nvcsw": 10, "nivcsw": 10 if r else 2} for s in range(10)} for r in range(2)}
    res = stragglers.analyze(make_run(tmp_path, busy, steps=10, nranks=2, mesh=False, sched=sched))
    (f,) = straggler_findings(res)
    assert f.evidence["cause"] == "compute", f.message
    assert "host contention:" not in f.message and "compute-bound" not in f.message
    own = f.message.index("its training thread spends 220 ms/step more on the CPU")
    assert own < f.message.index("it also waits 242 ms/step for a CPU (+240 ms vs its peers") \
        < f.message.index("other processes compete for its cores too")
    assert "(Python / host code, or torch ops run on the CPU)" in f.message  # no trace to tell


def test_own_cpu_work_outside_torch_ops_from_the_traces():
    # the profiled steps (CPU traces) show its torch ops taking no longer: outside torch ops
    p = {"rank": 1, "busy_ms": 48.8, "cpu_ms": 26.1, "cpu_wait_ms": 24.3, "nivcsw": 10.0,
         "data_wait_ms": 0.0}
    q = {"rank": 0, "busy_ms": 4.6, "cpu_ms": 3.8, "cpu_wait_ms": 0.1, "nivcsw": 2.0,
         "data_wait_ms": 0.0}
    why = _straggler_cause.explain(p, [q], 44.1, {0: 1.6, 1: 1.7})
    assert why["cause"] == "compute"
    assert ("its training thread spends 22 ms/step more on the CPU outside torch ops "
            "(Python / host code) than its peers") in why["text"]
    assert "its torch ops +0.1 ms vs its peers' in the profiled steps" in why["text"]
    # torch ops that take longer too: not claimed to be outside them
    why = _straggler_cause.explain(p, [q], 44.1, {0: 1.6, 1: 21.6})
    assert "outside torch ops" not in why["text"]
    # its CPU time did not grow but it waited for a CPU: host contention, as before
    why = _straggler_cause.explain({**p, "cpu_ms": 3.9, "cpu_wait_ms": 44.0}, [q], 44.1)
    assert why["cause"] == "host_contention" and why["text"].startswith("host contention:")


def test_exposed_comm_leaves_out_waits_for_a_straggler(tmp_path):
    # 4 ranks: rank 2 works 700 ms, the others 300 ms and wait 700 ms in the all_reduce:
    # 70 % of their step blocked, all of it waiting for rank 2
    rng = np.random.default_rng(3)
    busy = {r: list((700.0 if r == 2 else 300.0) + rng.normal(0, 5, 8)) for r in range(4)}
    run = make_run(tmp_path, busy, steps=8, nranks=4, mesh=False)
    res = collectives.analyze(run)
    assert not [f for f in res.findings if f.kind == "exposed_comm"]
    blocked = res.metrics["blocked"]
    assert blocked["median_fraction"] > 0.6 > 0.35 > blocked["median_fraction_excl_late_ranks"]
    w = stragglers.waits_for_stragglers(run)
    assert w["late"] == [2] and set(w["wait_ms"]) == {0, 1, 3}
    # comm_compute (trace based) leaves the same waits out of the ranks' exposed fractions
    # the others' last collective is exposed 30 % of the step (rank 2's: all of its 28 %):
    # the rest, 42 %, is what overlap could hide, were it not waiting for rank 2
    per_rank = [{"rank": r, "exposed_comm_fraction": 0.72 if r != 2 else 0.28,
                 "compute_fraction": 0.28 if r != 2 else 0.72,
                 "tail_exposed_fraction": 0.3 if r != 2 else 0.28, "step_window_ms": STEP_MS, "by_dim_ms_per_step": {}, "comm_by_type_ms_per_step":
                 {"all_reduce": 720.0}, "sync_fraction": 0.0} for r in range(4)]
    late = _peer_waits.late_waits(run, per_rank, comm_compute.NAME)
    assert late["late"] == [2]
    assert late["adjusted"][0] == pytest.approx(0.72 - w["wait_ms"][0] / STEP_MS, abs=1e-4)
    assert not [f for f in comm_compute._findings(per_rank, 0.72, late) if f.kind == "exposed_comm"]
    # without the straggler the same fractions are exposed communication
    (f,) = [f for f in comm_compute._findings(per_rank, 0.72, None) if f.kind == "exposed_comm"]
    assert f.ranks == [0, 1, 3]


def test_exposed_comm_without_straggler_still_found(tmp_path):
    busy = noisy_busy(4, steps=8, nranks=4, sd=5)
    busy = {r: [b - 250 for b in v] for r, v in busy.items()}  # 250 ms work, 750 ms blocked
    res = collectives.analyze(make_run(tmp_path, busy, steps=8, nranks=4, mesh=False))
    (f,) = [f for f in res.findings if f.kind == "exposed_comm"]
    assert "late rank" not in f.message


def test_p2p_waits_are_waits(tmp_path):
    busy = noisy_busy(4)
    make_run(tmp_path, busy)
    # rank 3 blocks 40 ms per step in a pipeline recv, besides its all_reduce
    w = JsonlWriter(rank_dir(tmp_path, 3) / "collectives.jsonl")
    for s in range(6):
        start = T0 + s * int(STEP_MS * MS)
        w.write({"step": s, "pg": "9", "seq": s, "op": "recv", "bytes": 8, "peer": 1,
                 "enqueue_ns": start, "end_ns": start + 40 * MS, "blocked_ms": 40.0})
    w.close()
    per = {p["rank"]: p for p in stragglers.analyze(RunDir(tmp_path)).metrics["per_rank"]}
    assert per[3]["p2p_ms"] == pytest.approx(40.0) and per[2]["p2p_ms"] == 0.0
    # the recv is time blocked too: rank 3's busy time drops by 40 ms
    assert per[3]["busy_ms"] == pytest.approx(np.median(busy[3][1:]) - 40.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux only")
def test_step_records_carry_scheduler_counters(tmp_path):
    import threading
    import time

    from trainprof.probes.steps import StepClock

    w = JsonlWriter(tmp_path / "steps.jsonl")
    clock = StepClock(w)
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.03:  # 30 ms on the CPU
        pass
    time.sleep(0.03)  # 30 ms off it: a voluntary switch
    rec = clock.close_step()
    assert 25 <= rec["cpu_ms"] <= rec["dur_ms"] and rec["cpu_wait_ms"] >= 0
    assert rec["nvcsw"] >= 1 and rec["nivcsw"] >= 0
    # a step closed on another thread: no counters (they are per thread), a new baseline there
    out = []
    th = threading.Thread(target=lambda: out.append(clock.close_step()))
    th.start()
    th.join()
    assert "cpu_ms" not in out[0]
    w.close()


DATA_SCRIPT = r"""
import json, sys, time
from pathlib import Path
import torch
from torch.utils.data import DataLoader, Dataset
from trainprof.probes import dataloader
from trainprof.rundir.files import JsonlWriter

class Clock:
    step = 0

class Session:  # the parts of ProbeSession the probe uses
    def __init__(s, d):
        s.d, s.clock, s.steps, s.closes, s.w = Path(d), Clock(), [], [], {}
    def stream(s, n):
        return s.w.setdefault(n, JsonlWriter(s.d / f"{n}.jsonl"))
    def on_step(s, f): s.steps.append(f)
    def on_close(s, f): s.closes.append(f)

class Slow(Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        time.sleep(0.03)
        return torch.zeros(2)

session = Session(sys.argv[1])
it = iter(DataLoader(Slow(), batch_size=2))  # 60 ms per batch
next(it)  # before the probe: not timed
dataloader.attach(session)
for step, n in enumerate([1, 2, 0, 1]):  # batches drawn in each step
    Clock.step = step
    for _ in range(n):
        next(it)
    time.sleep(0.01)  # the step's own work: not data wait
    for f in session.steps:
        f({"step": step})
for f in session.closes:
    f()
"""


def test_dataloader_probe_times_waits(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "data.py"
    script.write_text(DATA_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(x) for x in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert [(r["step"], r["batches"]) for r in recs] == [(0, 1), (1, 2), (2, 0), (3, 1)]
    assert recs[2]["wait_ms"] == 0  # the step's own 10 ms of work is not data wait
    for r in recs:  # 60 ms per batch, plus scheduling noise on a loaded host
        assert 60 * r["batches"] <= r["wait_ms"] < 60 * r["batches"] + 150


def test_lateness_of_a_lone_member_is_nan_not_an_index_error():
    """A collective instance seen by one rank only, last in sort order: no peer, no lateness."""
    from trainprof.analyzers._lateness import lateness

    df = pd.DataFrame({"group": ["a", "a", "b"], "ordinal": [0, 0, 0], "t_enq": [1.0, 3.0, 5.0],
                       "rank": [0, 1, 0], "complete": [True, True, True]})
    out = lateness(df).tolist()
    assert out[:2] == [-2.0, 2.0] and np.isnan(out[2])


def test_small_times_keep_their_precision_in_the_cause():
    """A 4 ms step's straggler: its numbers are not rounded to '1 ms vs 0 ms', and a second
    factor is never stated as '0 ms'."""
    from trainprof.analyzers import _straggler_cause as cause

    assert [cause.ms(x) for x in (128.4, 12.0, 3.44, 0.424, 0.0)] == ["128", "12", "3.4", "0.42", "0"]
    p = {"rank": 1, "busy_ms": 4.2, "cpu_ms": 4.18, "cpu_wait_ms": 0.62, "nivcsw": 1.0}
    peers = [{"rank": 0, "busy_ms": 3.2, "cpu_ms": 3.24, "cpu_wait_ms": 0.1, "nivcsw": 1.0}]
    why = cause.explain(p, peers, excess=1.0)
    assert why["cause"] == "compute"
    assert "spends 0.94 ms/step more on the CPU" in why["text"]
    assert "it also waits 0.62 ms/step for a CPU (+0.52 ms vs its peers" in why["text"]
    assert " 0 ms" not in why["text"]


def test_longer_busy_time_spent_waiting_for_a_cpu_is_host_contention_not_off_cpu():
    # a clean DDP job on 2 cores at load 30-100 (bench_clean_runs): rank 1's own time is 48 ms
    # a step longer, 7.7 ms of it more CPU time and 38.7 ms more waiting for a CPU; only 1.5 ms
    # is neither (sleeping, blocked). At its peer's 2.9 ms of wait per ms on the CPU its extra
    # work explains 22 of those 38.7 ms: not beyond half the excess, but the time is the host's
    p = {"rank": 1, "busy_ms": 164.9, "cpu_ms": 37.5, "cpu_wait_ms": 126.2, "nivcsw": 12.0,
         "data_wait_ms": 0.0}
    q = {"rank": 0, "busy_ms": 117.0, "cpu_ms": 29.8, "cpu_wait_ms": 87.5, "nivcsw": 10.0,
         "data_wait_ms": 0.0}
    why = _straggler_cause.explain(p, [q], 50.7)
    assert why["cause"] == "host_contention", why["text"]
    assert why["text"].startswith("host contention:") and "off the CPU" not in why["text"]
    # the same longer busy time with the CPU wait flat: off the CPU, as before
    why = _straggler_cause.explain({**p, "cpu_wait_ms": 87.5}, [q], 50.7)
    assert why["cause"] == "off_cpu"


def test_an_episode_mostly_waiting_for_a_cpu_is_host_contention():
    # a clean accelerate job on 2 cores at load ~14 (bench_clean_runs): rank 1 straggles in 4 of
    # 7 steps, median excess 72 ms (per-step differences); over all 7 steps its busy time is
    # 40.3 ms longer than its peer's, 33 ms of them waiting for a CPU and 3.6 ms more on it.
    # 33 ms is under half the 72 ms excess but 82 % of its longer busy time: the host's
    p = {"rank": 1, "busy_ms": 119.7, "cpu_ms": 28.2, "cpu_wait_ms": 88.0, "nivcsw": 9.0,
         "data_wait_ms": 0.46}
    q = {"rank": 0, "busy_ms": 79.4, "cpu_ms": 24.6, "cpu_wait_ms": 55.0, "nivcsw": 13.0,
         "data_wait_ms": 0.46}
    why = _straggler_cause.explain(p, [q], 72.0)
    assert why["cause"] == "host_contention", why["text"]
    # the same longer busy time but only a third of it waiting for a CPU: off the CPU
    why = _straggler_cause.explain({**p, "cpu_wait_ms": 55.0 + 13.0}, [q], 72.0)
    assert why["cause"] == "off_cpu", why["text"]
