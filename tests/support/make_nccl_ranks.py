"""Make tests/fixtures/gpu/nccl_late_rank/: a 3-rank NCCL job's profiler traces, one rank late.

    python tests/support/make_nccl_ranks.py [--out DIR]

Derived from the real H100 trace tests/fixtures/gpu/h100_item_sync.pt.trace.json.gz (torch
2.11, NCCL process group of one rank: its all_reduces launch no kernel), ProfilerStep#2 and #3
kept. Per rank, a copy in which:

- distributedInfo says rank r of 3, process group "0" of ranks [0, 1, 2];
- every ``record_param_comms`` all_reduce carries what PyTorch 2.x writes for a 3-rank group
  ("Group size", "Process Group Ranks", and "Seq": its sequence number in the group), and
  launches an NCCL kernel (a ``cudaLaunchKernel`` inside its ``nccl:all_reduce``, a
  ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` kernel on NCCL's stream 20) whose args are those
  of a real NCCL kernel of a 2-rank A100 trace (HTA's nccl_parser_config fixture: "Collective
  name", "In msg nelems", "Out msg nelems", "Group size", "dtype", "Process Group Name",
  "Process Group Description", "Process Group Ranks") plus "Seq";
- the same collective's kernels end together on every rank: TRANSFER_US after the last
  rank's kernel started;
- rank LATE runs LATE_US of host work ("late host work", a cpu_op) just before the first
  all_reduce of ProfilerStep#3 (its sequence number: the first of that step): everything
  after it on that rank is LATE_US later. The other ranks' kernels of that collective wait for
  it (they start on time and last LATE_US longer). Every rank's host waits in a
  ``cudaStreamSynchronize`` right after that collective until its kernel ends, and goes on from
  there: after it, the ranks are alike again;
- each rank's timestamps are its own host's clock: rank r's are CLOCK_US[r] off rank 0's.

So the ground truth: the collective LATE_SEQ's last arrival is rank LATE; the step's critical
path runs through its late host work; clocks put back by the kernels' ends are CLOCK_US.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "fixtures" / "gpu" / "h100_item_sync.pt.trace.json.gz"
OUT = ROOT / "tests" / "fixtures" / "gpu" / "nccl_late_rank"
RANKS = 3
LATE = 2
LATE_US = 3000.0
TRANSFER_US = 20.0
CLOCK_US = {0: 0.0, 1: 250.0, 2: -400.0}
KEEP_STEPS = ("ProfilerStep#2", "ProfilerStep#3")
NCCL_STREAM = 20
KERNEL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
PG_RANKS = "[" + ", ".join(str(r) for r in range(RANKS)) + "]"


def jitter_us(rank: int, seq: int) -> float:
    """When rank's kernel of collective seq starts after the plan's time: 0-4 µs, a different
    value on each of the 3 ranks, so that every collective has one last arrival."""
    return float((rank * 7 + seq * 3) % 5)


def last_to_arrive(seq: int, late_seq: int) -> int:
    """The ground truth: the rank whose kernel of collective seq starts last."""
    return LATE if seq == late_seq else max(range(RANKS), key=lambda r: jitter_us(r, seq))


def _load() -> dict:
    return json.loads(gzip.decompress(SOURCE.read_bytes()))


def _window(doc: dict) -> tuple[float, float]:
    steps = [e for e in doc["traceEvents"] if e.get("name") in KEEP_STEPS and e.get("cat") == "user_annotation"]
    return min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)


def _kept(doc: dict, lo: float, hi: float) -> list[dict]:
    """Events of the kept steps (host events starting in them, GPU ops launched in them) and
    the metadata events."""
    ev = doc["traceEvents"]
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in ev
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for e in ev:
        if e.get("ph") == "M":
            out.append(e)
            continue
        if "ts" not in e:
            continue
        corr = e.get("args", {}).get("correlation")
        t = launch_ts.get(corr, e["ts"]) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "ac2g") else e["ts"]
        if lo <= t <= hi and e.get("cat") != "ac2g":
            out.append(e)
    return out


def _collectives(events: list[dict]) -> list[tuple[dict, dict]]:
    """(record_param_comms, its nccl:all_reduce annotation) in time order."""
    rpc = sorted((e for e in events if e.get("name") == "record_param_comms"
                  and e.get("args", {}).get("Collective name") == "allreduce"), key=lambda e: e["ts"])
    ann = sorted((e for e in events if e.get("name") == "nccl:all_reduce"), key=lambda e: e["ts"])
    out = []
    for r in rpc:
        a = next(x for x in ann if r["ts"] <= x["ts"] <= r["ts"] + r["dur"] and x["tid"] == r["tid"])
        out.append((r, a))
    return out


def first_seq_of_step3(colls, step3) -> int:
    return next(i for i, (r, _) in enumerate(colls) if r["ts"] >= step3["ts"])


def make(out: Path = OUT) -> list[Path]:
    src = _load()
    lo, hi = _window(src)
    base = _kept(src, lo, hi)
    colls = _collectives(base)
    step3 = next(e for e in base if e.get("name") == "ProfilerStep#3" and e.get("cat") == "user_annotation")
    late_seq = first_seq_of_step3(colls, step3)
    corr0 = max(e.get("args", {}).get("correlation", 0) for e in base) + 1000
    # the collectives' times as recorded (rank 0, before any shift): launch and kernel start
    plan = []
    for i, (r, a) in enumerate(colls):
        launch = a["ts"] + max(1.0, a["dur"] - 6.0)
        plan.append({"seq": i, "rpc": r, "ann": a, "launch": launch, "kstart": launch + 8.0})
    t_late = colls[late_seq][0]["ts"]  # where the late rank's extra work goes
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(RANKS):
        ev = copy.deepcopy(base)
        late = rank == LATE
        # the collectives' CPU ops and annotations, matched by position in the copy
        cp_colls = _collectives(ev)

        def shift_after(t0: float, d: float, keep: set) -> None:
            for e in ev:
                if id(e) in keep or "ts" not in e or e.get("ph") == "M":
                    continue
                if e["ts"] >= t0:
                    e["ts"] += d
                elif e.get("ph") == "X" and e["ts"] + e.get("dur", 0) > t0:
                    e["dur"] += d  # spans across t0: ProfilerStep#3 on host and GPU

        added = []
        for p, (rpc, ann) in zip(plan, cp_colls):
            rpc["args"].update({"Group size": RANKS, "Process Group Ranks": PG_RANKS, "Seq": p["seq"]})
            corr = corr0 + p["seq"]
            j = jitter_us(rank, p["seq"])
            launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": rpc["pid"],
                      "tid": rpc["tid"], "ts": p["launch"] + j, "dur": 4.0,
                      "args": {"External id": rpc["args"].get("External id"), "cbid": 211,
                               "correlation": corr}}
            kern = {"ph": "X", "cat": "kernel", "name": KERNEL, "pid": 0, "tid": NCCL_STREAM,
                    "ts": p["kstart"] + j, "dur": TRANSFER_US,
                    "args": {"External id": rpc["args"].get("External id"), "queued": 0, "device": 0,
                             "context": 1, "stream": NCCL_STREAM, "correlation": corr,
                             "registers per thread": 96, "shared memory": 87568,
                             "blocks per SM": 0.074074, "warps per SM": 1.259259, "grid": [8, 1, 1],
                             "block": [544, 1, 1], "est. achieved occupancy %": 0,
                             "Collective name": "allreduce",
                             "In msg nelems": rpc["args"]["In msg nelems"],
                             "Out msg nelems": rpc["args"]["Out msg nelems"], "Group size": RANKS,
                             "dtype": rpc["args"]["dtype"], "In split size": "[]", "Out split size": "[]",
                             "Process Group Name": "0", "Process Group Description": "default_pg",
                             "Process Group Ranks": PG_RANKS, "Seq": p["seq"]}}
            added.append((p["seq"], launch, kern))
        for sq, _, k in added:  # the kernels end together: TRANSFER_US after the last start
            last = plan[sq]["kstart"] + max(jitter_us(x, sq) for x in range(RANKS))
            k["dur"] = last + TRANSFER_US - k["ts"]
        ev.extend(x for _, l, k in added for x in (l, k))
        pid, tid = colls[0][0]["pid"], colls[0][0]["tid"]
        if late:
            shift_after(t_late, LATE_US, set())
            ev.append({"ph": "X", "cat": "cpu_op", "name": "late host work", "pid": pid, "tid": tid,
                       "ts": t_late, "dur": LATE_US, "args": {}})
        # every rank synchronizes right after the collective: the kernels end together, TRANSFER_US
        # after the late rank's started, and every host goes on from there
        _, launch, kern = added[late_seq]
        rpc = cp_colls[late_seq][0]
        end = plan[late_seq]["kstart"] + jitter_us(LATE, late_seq) + LATE_US + TRANSFER_US
        kern["dur"] = end - kern["ts"]
        sync_at = rpc["ts"] + rpc["dur"]
        sync = {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": pid,
                "tid": tid, "ts": sync_at + 0.5, "dur": end + 3.0 - (sync_at + 0.5),
                "args": {"cbid": 131, "correlation": corr0 + 900}}
        assert sync["dur"] > 0
        orig_end = colls[late_seq][0]["ts"] + colls[late_seq][0]["dur"]
        shift_after(sync_at, (end + 3.5 - orig_end) - (LATE_US if late else 0.0), {id(launch), id(kern)})
        ev.append(sync)
        for e in ev:  # this host's clock
            if "ts" in e and e.get("ph") != "M":
                e["ts"] = round(e["ts"] + CLOCK_US[rank], 3)
        doc = {k: v for k, v in src.items() if k != "traceEvents"}
        doc["distributedInfo"] = dict(src["distributedInfo"], rank=rank, world_size=RANKS,
                                      pg_config=[dict(src["distributedInfo"]["pg_config"][0],
                                                      pg_size=RANKS, ranks=list(range(RANKS)))])
        doc["traceEvents"] = sorted(ev, key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
        p = out / f"rank-{rank}.pt.trace.json.gz"
        p.write_bytes(gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), 9, mtime=0))
        paths.append(p)
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=OUT)
    for p in make(ap.parse_args().out):
        print(p, p.stat().st_size)
