"""False-finding rate of clean jobs, run after run: each framework test job (the scripts of
tests/**/test_frameworks.py, test_frameworks_ray_deepspeed.py, test_pipeline_schedules.py and
the balanced MoE job of test_moe_expert_balance.py), wrapped unmodified, N times each; every
finding on a clean run is false, except a straggler the analysis itself attributes to host
contention (another process took the rank's cores: real on a shared machine), which is counted
apart, as is a `process_group_not_destroyed` warning on ranks whose meta.json says the job left
its gloo group live (true of the job). Target: 0 false findings.

    python benchmarks/bench_clean_runs.py [--runs 20] [--jobs ddp,hf,...] [--json out.json] [--keep DIR]

Prints per job: runs, runs with a false finding (and their kinds and messages), contention
findings; then the overall rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _module(name: str):
    path = next(ROOT.glob(f"tests/**/{name}.py"))
    sys.path.insert(0, str(path.parent))
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def jobs() -> dict:
    """name -> (script text, launch: torchrun | python, env, needs)."""
    fw = _module("test_frameworks")
    out = {"ddp": (fw.SCRIPTS["ddp"], "torchrun", {}, []),
           "hf": (fw.SCRIPTS["hf"], "torchrun", {}, ["transformers"]),
           "accelerate": (fw.SCRIPTS["accelerate"], "torchrun", {}, ["transformers", "accelerate"]),
           "lightning-python": (fw.SCRIPTS["lightning"], "python", {}, ["transformers", "lightning"]),
           "lightning-torchrun": (fw.SCRIPTS["lightning"], "torchrun", {}, ["transformers", "lightning"])}
    rd = _module("test_frameworks_ray_deepspeed")
    out["ray"] = (rd.RAY, "python", {}, ["ray"])
    out["deepspeed"] = (rd.DEEPSPEED, "torchrun", {"DS_ACCELERATOR": "cpu"}, ["deepspeed"])
    pp = _module("test_pipeline_schedules")
    for s in pp.SCHEDULES:
        out[s] = (pp.JOB, "torchrun", {"SCHED": s}, [])
    moe = _module("test_moe_expert_balance")
    out["moe-balanced"] = (moe.JOB, "torchrun", {"SKEW": "0"}, [])
    return out


def _cpu_wait_share(run: Path) -> float | None:
    """The largest share of a rank's steps (≥ 1) it spent runnable but waiting for a CPU
    (schedstat, steps.jsonl cpu_wait_ms): how contended the host was for this run."""
    out = None
    for f in run.glob("ranks/rank-*/steps.jsonl"):
        st = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        st = [x for x in st if x.get("step", 0) > 0 and "cpu_wait_ms" in x and x.get("dur_ms")]
        if st:
            share = sum(x["cpu_wait_ms"] for x in st) / sum(x["dur_ms"] for x in st)
            out = max(out or 0.0, round(share, 3))
    return out


def run_once(name, script, launch, env, root: Path) -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    (d / "train.py").write_text(script)
    job = [*TORCHRUN, str(d / "train.py")] if launch == "torchrun" else [sys.executable, str(d / "train.py")]
    e = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
         "TOKENIZERS_PARALLELISM": "false", **env}
    e.pop("MASTER_PORT", None)
    t0, load = time.monotonic(), os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-m", "trainprof", "wrap", "--out", str(d / "run"), "--",
                           *job, str(d / "job")], cwd=d, env=e, capture_output=True, text=True,
                          timeout=1800)
    s = json.loads((d / "run" / "summary.json").read_text()) if (d / "run" / "summary.json").exists() else {}
    found = s.get("findings", [])
    contention = [f for f in found if f["kind"] == "straggler"
                  and f["evidence"].get("cause") == "host_contention"]
    # a gloo group the job (its framework) leaves live at exit is true of the job, not false
    # (docs/hangs.md#a-process-group-left-live-at-exit): counted apart
    live = [f for f in found if f["kind"] == "process_group_not_destroyed"
            and all(_group_live(d / "run", r) for r in f["ranks"])]
    false = [f for f in found if f not in contention and f not in live]
    # why a run failed: the job's last exception line (e.g. Ray's node not starting under load)
    errors = [x for x in proc.stderr.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", x)]
    return {"exit": proc.returncode, "dir": str(d), "cpu_wait_share": _cpu_wait_share(d / "run"), "wall_s": round(time.monotonic() - t0, 1),
            "load1": round((load + os.getloadavg()[0]) / 2, 2),  # 1-min load average, start/end
            "error": errors[-1][:200] if proc.returncode and errors else None,
            "false": [(f["kind"], f["message"][:240]) for f in false],
            "contention": len(contention), "group_left_live": len(live)}


def _group_live(run: Path, rank: int) -> bool:
    try:
        meta = json.loads((run / "ranks" / f"rank-{rank:05d}" / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return bool((meta.get("process_group_at_exit") or {}).get("live"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--jobs", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", default="", help="keep the run directories here (else a temporary "
                    "directory); `trainprof analyze` can then re-read them")
    a = ap.parse_args()
    all_jobs = jobs()
    names = [n for n in (a.jobs.split(",") if a.jobs else all_jobs)]
    results, total, bad = {}, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        if a.keep:
            Path(a.keep).mkdir(parents=True, exist_ok=True)
            tmp = a.keep
        for name in names:
            script, launch, env, needs = all_jobs[name]
            if any(importlib.util.find_spec(m) is None for m in needs):
                print(f"{name}: skipped ({', '.join(needs)} not installed)", flush=True)
                continue
            rows = [run_once(name, script, launch, env, Path(tmp)) for _ in range(a.runs)]
            ok = [r for r in rows if r["exit"] == 0]
            nfalse = sum(1 for r in ok if r["false"])
            total, bad = total + len(ok), bad + nfalse
            results[name] = rows
            if a.json:  # after each job: a long benchmark stopped midway keeps what it measured
                Path(a.json).write_text(json.dumps(results, indent=1))
            print(f"{name}: {len(ok)} clean runs (of {len(rows)}; wall {sum(r['wall_s'] for r in rows):.0f} s), "
                  f"{nfalse} with a false finding, {sum(r['contention'] for r in ok)} host-contention "
                  f"straggler(s); load {min(r['load1'] for r in rows):.1f}-{max(r['load1'] for r in rows):.1f} "
                  f"on {os.cpu_count()} cores", flush=True)
            for r in ok:
                for kind, msg in r["false"]:
                    print(f"    {kind}: {msg}", flush=True)
            for r in rows:
                if r["exit"] != 0:
                    print(f"    run failed (exit {r['exit']}): {r['error'] or '?'}", flush=True)
    print(f"false-finding rate: {bad}/{total} runs" + (f" = {bad / total:.1%}" if total else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
