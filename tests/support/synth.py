"""Synthetic run directories and traces shared by several tests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import paths
from trainprof.analysis.runner import analyze
from trainprof.rundir.files import profiler_trace_path, write_json_atomic
from trainprof.analysis.run import RunDir


FIXTURES = paths.FIXTURES


GPU_RUN = FIXTURES / "gpu" / "h100_hang_run"


def synth_run(out: Path, n: int, src: Path = GPU_RUN) -> Path:
    """A run directory of ``n`` ranks made of rank 0 of ``src``: its meta.json (rank and world
    size rewritten), its streams and its profiler trace copied to every rank."""
    out.mkdir(parents=True)
    man = json.loads((src / "manifest.json").read_text())
    man.update(world_size=n, ranks_seen=n, ranks=[])
    (out / "manifest.json").write_text(json.dumps(man))
    (out / "profiler").mkdir()
    for r in range(n):
        d = out / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        for f in ("steps.jsonl", "memory.jsonl", "collectives.jsonl", "groups.jsonl"):
            if (src / "ranks/rank-00000" / f).exists():
                shutil.copy(src / "ranks/rank-00000" / f, d / f)
        meta = json.loads((src / "ranks/rank-00000/meta.json").read_text())
        meta.update(rank=r, world_size=n, local_rank=r)
        (d / "meta.json").write_text(json.dumps(meta))
        shutil.copy(profiler_trace_path(src, 0), profiler_trace_path(out, r))
    return out


def cached(run_dir: Path) -> RunDir:
    """A RunDir whose digests are built and written as `trainprof analyze RUN` does."""
    run = RunDir(run_dir)
    run.digest_docs(write=True)
    return run


def _write_run(root: Path, ranks: dict[int, list[dict]], status="ok", end_ns=None):
    man = {"schema_version": 1, "status": status}
    if end_ns:
        man["end_time"] = {"ns": end_ns}
    write_json_atomic(root / "manifest.json", man)
    for r, hbs in ranks.items():
        d = root / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        write_json_atomic(d / "meta.json", {"rank": r, "world_size": len(ranks)})
        (d / "heartbeat.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hbs))
    return root


STEP_US = 30_000


BASE_US = 1_000_000_000_000


def ev(name, cat, ts, dur, tid=100):
    return {"ph": "X", "name": name, "cat": cat, "ts": BASE_US + ts, "dur": dur, "pid": 100,
            "tid": tid, "args": {}}


def rank_events(late: str | None, steps: int = 4, profiler_steps: bool = True,
                wait_us: int = 22_000, mm_us: int = 5_000, early_us: int = 0) -> list:
    """One rank's events for ``steps`` iterations of STEP_US each. ``late``: how this rank
    spends 20 ms at the start of each iteration ("sleep": in `<built-in function sleep>` under
    a Python frame, as with_stack records it; "host": in a Python function with no call under
    it, as a busy loop; "compute": in aten::mm; "idle": in no event, as a sleep or a busy loop
    without with_stack), then ``mm_us`` of aten::mm and a 2 ms all-reduce; None: a peer that
    computes 5 ms and then waits ``wait_us`` in the all-reduce (``early_us``: after an all-reduce
    of that long at the start of the iteration, one compute could hide)."""
    # a whole-trace window runs from the trace's first event: every rank starts with one
    out = [] if profiler_steps else [ev("aten::empty", "cpu_op", 0, 10)]
    for i in range(steps):
        t = i * STEP_US
        if profiler_steps:
            out.append(ev(f"ProfilerStep#{i}", "user_annotation", t, STEP_US))
        if late is None:
            if early_us:
                out += [ev("c10d::allreduce_", "cpu_op", t, early_us),
                        ev("gloo:all_reduce", "user_annotation", t, early_us, tid=200)]
            mm, comm = (t + early_us, 5_000), (t + early_us + 5_000, wait_us)
        else:
            if late == "sleep":  # with_stack: the frame, and the call in it
                out += [ev("train.py(12): <module>", "python_function", t, 27_000),
                        ev("<built-in function sleep>", "python_function", t, 20_000)]
            elif late == "host":
                out.append(ev("train.py(30): spin", "python_function", t, 20_000))
            elif late == "compute":
                out.append(ev("aten::mm", "cpu_op", t, 20_000))
            mm, comm = (t + 20_000, mm_us), (t + 20_000 + mm_us, 2_000)
        out += [ev("aten::mm", "cpu_op", *mm), ev("c10d::allreduce_", "cpu_op", *comm),
                ev("gloo:all_reduce", "user_annotation", *comm, tid=200)]
    return out


def write_job(folder: Path, per_rank: list[list]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    world = len(per_rank)
    for rank, events in enumerate(per_rank):
        doc = {"schemaVersion": 1,
               "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world,
                                   "pg_count": 1,
                                   "pg_config": [{"pg_name": "0", "pg_desc": "default_pg",
                                                  "backend_config": "cpu:gloo,cuda:gloo",
                                                  "pg_size": world, "ranks": list(range(world))}]},
               "traceEvents": events}
        (folder / f"host_{100 + rank}.{rank + 1}.pt.trace.json").write_text(json.dumps(doc))
    return folder


def summary_of(folder: Path) -> dict:
    return analyze(RunDir(folder))


EVIL = '<script>alert("x")</script>'


def summary_by_hand() -> dict:
    by_rank = {"0": [900.0, 100.0, 101.0, 99.0, 100.0, 102.0, 98.0, 100.0],
               "1": [905.0, 130.0, 131.0, 129.0, 130.0, 132.0, 128.0, 130.0]}
    return {
        "schema_version": 1, "trainprof_version": "0.1.0", "generated_at": "2026-11-23T10:00:00+00:00",
        "run": {"dir": "runs/" + EVIL, "command": ["torchrun", "train.py", "--name", EVIL],
                "exit_code": 0, "signal": None, "world_size": 2, "mesh": {"dp": 2, "pp": 1, "tp": 1},
                "device": "cpu", "backend": "gloo", "torch_version": "2.13.0+cpu",
                "ranks": [{"rank": 0, "host": "node-a", "coords": {"dp": 0, "pp": 0, "tp": 0}},
                          {"rank": 1, "host": EVIL, "coords": {"dp": 1, "pp": 0, "tp": 0}}]},
        "metrics": {
            "step_time": {
                "job": {"steps": 7, "median_ms": 130.0, "p90_ms": 131.4, "mean_ms": 130.0,
                        "tokens_per_step": 4096, "tokens_per_s": 31507.7},
                "per_rank": [{"rank": 0, "steps": 7, "median_ms": 100.0, "p90_ms": 101.4,
                              "min_ms": 98.0, "max_ms": 102.0, "spread_pct": 1.4},
                             {"rank": 1, "steps": 7, "median_ms": 130.0, "p90_ms": 131.4,
                              "min_ms": 128.0, "max_ms": 132.0, "spread_pct": 1.08}],
                "per_step": [{"step": s, "max_ms": by_rank["1"][s]} for s in range(1, 8)],
                "step_ms_by_rank": by_rank, "first_step": 0,
                "excluded_steps": {"warmup": [0], "profiler": []}},
            # no section module for this name: the generic renderer shows it
            "zz_custom": {"total": 3, "label": EVIL,
                          "rows": [{"name": f"op{i}", "ms": float(i)} for i in range(500)]},
        },
        "findings": [{"kind": "straggler", "severity": "warning", "ranks": [1],
                      "message": f"rank 1 is 30 % slower {EVIL}", "analyzer": "stragglers",
                      "evidence": {"median_ms": 130.0, "peer_median_ms": 100.0, "note": EVIL}}],
        "problems": [f"runs/x/ranks/rank-00001/steps.jsonl:7: malformed line {EVIL}"],
        "errors": [{"analyzer": "pipeline", "error": f"ValueError: {EVIL}"}],
    }


STRAGGLER = 773  # named by the stragglers finding


SLOWEST = 301  # the largest median step time, named by no finding


PER_HOST = 8


def host(r: int) -> str:
    return f"node{r // PER_HOST:03d}"


def coords(r: int) -> dict:
    return {"dp": r // 4, "pp": (r // 2) % 2, "tp": r % 2}


def scale_summary(n: int) -> dict:
    """A summary of an n-rank run in the analyzers' schema: one chronic straggler (STRAGGLER,
    when there is such a rank) and, with n > SLOWEST, one rank (SLOWEST) with the largest
    median step time."""
    ranks = range(n)
    strag = STRAGGLER if n > STRAGGLER else n - 1
    wiggle = lambda r: (r * 37 % 11) / 10  # noqa: E731 - a deterministic per-rank jitter (0..1 ms)
    median = {r: 100.0 + wiggle(r) + (60.0 if r == strag else 0) + (80.0 if r == SLOWEST else 0)
              for r in ranks}
    steps = list(range(1, 10))
    others = [r for r in ranks if r != strag]
    scattered = [r for r in ranks if r % 3 == 0]
    return {
        "schema_version": 1, "trainprof_version": "0.1.0", "generated_at": "2026-11-25T10:00:00+00:00",
        "run": {"dir": "runs/big", "command": ["torchrun", "train.py"], "exit_code": 0,
                "world_size": n, "mesh": {"dp": max(1, n // 4), "pp": 2, "tp": 2}, "device": "cpu",
                "backend": "gloo",
                "ranks": [{"rank": r, "host": host(r), "local_rank": r % PER_HOST, "coords": coords(r)}
                          for r in ranks]},
        "metrics": {
            "step_time": {
                "job": {"steps": 9, "median_ms": 160.0, "p90_ms": 170.0, "ranks_reporting": n},
                "per_rank": [{"rank": r, "steps": 9, "median_ms": median[r], "p90_ms": median[r] + 2,
                              "min_ms": median[r] - 2, "max_ms": median[r] + 3, "spread_pct": 2.0}
                             for r in ranks],
                "step_ms_by_rank": {str(r): [900.0] + [median[r]] * 9 for r in ranks},
                "first_step": 0, "excluded_steps": {"warmup": [0], "profiler": []}},
            "stragglers": {
                "steps": steps, "steps_analysed": steps, "chronic": [strag], "transient": [],
                "median_step_ms": 160.0, "thresholds": {"score": 1.5, "min_excess": 0.1, "chronic": 0.5},
                "per_rank": [{"rank": r, "group": "pp0", "coords": coords(r), "host": host(r),
                              "own_ms": median[r], "peer_own_ms": 100.0, "excess_ms": median[r] - 100,
                              "score": (median[r] - 100) / 2 if r == strag else wiggle(r) / 5,
                              "busy_ms": median[r], "blocked_ms": 60.0, "status":
                              "chronic" if r == strag else "ok"} for r in ranks],
                "busy_ms_by_rank": {str(r): [median[r]] * 9 for r in ranks},
                "wait_ms_by_rank": {str(r): [0.0 if r == strag else 60.0 + wiggle(r)] * 9 for r in ranks},
                "data_ms_by_rank": {str(r): [0.5] * 9 for r in ranks}},
            "comm_compute": {
                "job": {"trace_kind": "cpu", "ranks": n, "compute_fraction": 0.5},
                "per_rank": [{"rank": r, "coords": coords(r), "step_window_ms": median[r],
                              "compute_fraction": 0.5, "exposed_comm_fraction": 0.3 + wiggle(r) / 100,
                              "other_fraction": 0.2 - wiggle(r) / 100} for r in ranks],
                "per_step": [{"rank": r, "step": s, "compute_ms": 50.0, "exposed_comm_ms": 30.0 + wiggle(r)}
                             for r in ranks for s in (3, 4)]},
            "collectives": {
                "records": 10 * n, "ranks": n, "groups": 3,
                "lateness": {"per_rank": [{"rank": r, "n": 100, "mean_ms": 9.0 if r == strag else wiggle(r),
                                           "p90_ms": 12.0 if r == strag else 1.0 + wiggle(r)}
                                          for r in ranks]}},
            "memory": {
                "job": {"peak_metric": "peak_allocated_bytes", "max_peak_bytes": 2 ** 31},
                "per_rank": [{"rank": r, "coords": coords(r), "peak_allocated_bytes": 2 ** 30 + r,
                              "measured": {"params_bytes": 2 ** 20}, "expected": {"params_bytes": 2 ** 20}}
                             for r in ranks],
                "timeline": {str(r): {"step": steps, "allocated_bytes": [2 ** 30 + r] * 9} for r in ranks}},
            "hang": {
                "hung": True, "message": "rank " + str(strag) + " never reached the all_reduce that "
                "ranks " + ", ".join(map(str, others)) + " wait in",
                "ranks": [{"rank": r, "state": "running" if r == strag else "in_collective", "step": 7,
                           "waiting_in": None if r == strag else {"op": "all_reduce", "seq": 9, "pg": "0",
                                                                  "source": "log"},
                           "frame": "train.py:12", "stalled_s": 30.0} for r in ranks],
                "stack_groups": [{"ranks": others, "majority": True, "in_collective": True,
                                  "frame": "all_reduce", "frames": []},
                                 {"ranks": [strag], "majority": False, "in_collective": False,
                                  "frame": "forward", "frames": []}]},
        },
        "findings": [
            {"kind": "straggler", "severity": "warning", "ranks": [strag], "analyzer": "stragglers",
             "message": f"rank {strag} is a chronic straggler; its peers ranks "
                        + ", ".join(map(str, others)) + " wait for it",
             "evidence": {"rank": strag, "waits_caused_ms": {str(r): 60.0 + wiggle(r) for r in others}}},
            {"kind": "exposed_comm", "severity": "warning", "ranks": others, "analyzer": "comm_compute",
             "message": "communication not hidden", "evidence": {"per_rank": {str(r): 0.3 for r in ranks}}},
            {"kind": "scattered", "severity": "info", "ranks": scattered, "analyzer": "x",
             "message": "every third rank"},
        ],
        "problems": [], "errors": [],
    }
