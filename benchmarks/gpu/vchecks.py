"""The checks of the GPU validation suite: the jobs each one runs, then its criteria.

Sizes: on CUDA a reference model large enough for real kernels and NVML samples yet a few
seconds per job; with --dry-run the smallest model that exercises the same code on CPU (gloo).
Time limits (seconds, per check) keep the whole inside 8 minutes on one GPU with 4 checks at a
time: see docs/gpu-validation.md for the measured times.
"""

from __future__ import annotations

import json
from pathlib import Path

import veval
from vcore import Check, Ctx, Verdict

# ~50M parameters, 32k tokens a step (tens of ms on one GPU: several NVML samples per step at
# 0.05 s); the kernel count per step, hence the trace's size, follows layers and micro-batches
REF_GPU = ["--layers", "4", "--hidden", "1024", "--heads", "8", "--seq-len", "512", "--vocab", "8192",
           "--global-batch", "64", "--micro-batches", "2"]
# the fault runs: a smaller model (faster; a small allocator snapshot)
REF_GPU_SMALL = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq-len", "128", "--vocab", "1024",
                 "--global-batch", "16", "--micro-batches", "2"]
REF_CPU = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--global-batch", "4",
           "--micro-batches", "1"]
# the overhead A/B: a realistic GPU step (~100M-parameter decoder, 16k tokens, bf16)
AB_GPU = ["--rounds", "10", "--block", "8", "--warmup", "3", "--", "--device", "cuda", "--dtype", "bf16",
          "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "512", "--vocab", "32000",
          "--global-batch", "32", "--micro-batches", "2"]
AB_CPU = ["--rounds", "2", "--block", "2", "--warmup", "1", "--", "--device", "cpu", *REF_CPU]
OVERHEAD_LIMIT_PCT = 1.0   # docs/overhead.md: the always-on probes, the NaN watch aside
NAN_WATCH_LIMIT_PCT = OVERHEAD_LIMIT_PCT + 5.0  # the whole set: + the NaN watch's own 5 % (docs/overhead.md)
HTA_TOLERANCE_PP = 0.5          # as benchmarks/hta_crosscheck.py and tests/unit/analyzers/test_hta_numbers.py
SYNCS_PER_STEP, D2H_PER_STEP = 4, 3  # make_trace.py: 3 x loss.item() + 1 x synchronize() a step


def sizes(ctx: Ctx, big: bool = False) -> list:
    return (REF_GPU if big else REF_GPU_SMALL) if ctx.cuda else REF_CPU


def _ref_steps(ctx: Ctx) -> int:
    return 12 if ctx.cuda else 4


def _summary_or_fail(v: Verdict, job, summary) -> bool:
    v.need(f"job exit 0 (got {job.rc}; log {job.log.name})", job.rc == 0)
    return v.need("summary.json written", summary is not None)


# --------------------------------------------------------------------------- the reference job
def check_ref_1rank(ctx: Ctx, v: Verdict, results: dict) -> None:
    steps = _ref_steps(ctx)
    job, run, s = ctx.wrap("ref_1rank", [*ctx.launch1(), *ctx.reference(*sizes(ctx, big=True), "--steps", steps)],
                           env={"TRAINPROF_TELEMETRY_INTERVAL": "0.05", "TRAINPROF_CALIBRATION": "1"},
                           profile="2-3" if ctx.cuda else "1-2", report=ctx.cuda)
    v.data.update(run=str(run), fixture={"check": "ref_1rank", "kwargs": {"steps": steps}})
    if _summary_or_fail(v, job, s):
        veval.eval_reference(v, run, s, ctx.cuda, steps)
        if ctx.cuda:  # the report of a GPU run (the dry run leaves it out: CPU time)
            v.need("report.html written", (run / "report.html").is_file())


def check_ref_2rank_gloo(ctx: Ctx, v: Verdict, results: dict) -> None:
    delay = 100 if ctx.cuda else 500  # CPU: a large share of a loaded machine's step
    args = [*sizes(ctx), "--dp", "2", "--dp-mode", "replicate", "--backend", "gloo",
            "--steps", 10 if ctx.cuda else 6, "--inject", f"slow_data:rank=1,delay_ms={delay}"]
    job, run, s = ctx.wrap("ref_2rank_gloo", [*ctx.torchrun(2), *ctx.reference(*args)])
    v.data.update(run=str(run), fixture={"check": "ref_2rank_gloo", "kwargs": {"rank": 1}})
    if _summary_or_fail(v, job, s):
        veval.eval_two_ranks(v, run, s, ctx.cuda, rank=1)


# --------------------------------------------------------------------------- DDP on NCCL
def check_ddp(ctx: Ctx, v: Verdict, results: dict) -> None:
    """DDP, world size 1 (NCCL on CUDA): trainprof's recording bucket hook, alone and composed
    with the job's own hook (fp16 compression), leaves the trained parameters bit-identical."""
    job_py, dev, steps = ctx.job_file("ddp_job.py"), "cuda" if ctx.cuda else "cpu", 6
    n_buckets = 0
    for hook in ("none", "fp16"):
        h_bare, h_wrap = ctx.work / f"ddp-{hook}.bare.hash", ctx.work / f"ddp-{hook}.hash"
        args = [job_py, "--device", dev, "--hook", hook, "--steps", steps]
        det = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # cuBLAS alike in both runs whatever the streams
        if not ctx.cuda:  # the dry run saves torchrun's process: env:// of a world of one
            det.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        bare = ctx.run(f"ddp_{hook}_bare", [*ctx.launch1(), *args, "--hash-out", h_bare], env=det)
        job, run, _ = ctx.wrap(f"ddp_{hook}", [*ctx.launch1(), *args, "--hash-out", h_wrap],
                               env=det, analyze=False)
        if not (v.need(f"{hook}: bare run exit 0 (got {bare.rc})", bare.rc == 0)
                and v.need(f"{hook}: wrapped run exit 0 (got {job.rc})", job.rc == 0)):
            continue
        v.need(f"{hook}: parameters bit-identical to the bare run",
               h_bare.is_file() and h_wrap.is_file() and h_bare.read_text() == h_wrap.read_text())
        m = veval.meta(run)
        v.need(f"{hook}: backend {'nccl' if ctx.cuda else 'gloo'} (got {m.get('backend')})",
               m.get("backend") == ("nccl" if ctx.cuda else "gloo"))
        ddp = (m.get("ddp") or [{}])[-1]
        v.need(f"{hook}: bucket hook recording (meta ddp {ddp})", ddp.get("recorded") is True)
        recs = [r for r in veval.read_jsonl(veval.rank_dir(run) / "collectives.jsonl")
                if r.get("api") == "ddp.bucket"]
        v.need(f"{hook}: a bucket all-reduce recorded every step (steps {sorted({r['step'] for r in recs})})",
               sorted({r["step"] for r in recs}) == list(range(steps)))
        want = "fp16_compress_hook" if hook == "fp16" else None
        if want:
            v.need(f"{hook}: the job's hook named ({sorted({str(r.get('hook')) for r in recs})})",
                   {r.get("hook") for r in recs} == {want})
        v.need(f"{hook}: every bucket completed", recs and all(r.get("end_ns") for r in recs))
        n_buckets += len(recs)
    v.number = f"{n_buckets} bucket all-reduces recorded; params identical"


# --------------------------------------------------------------------------- the job's profiler
def check_job_profiler(ctx: Ctx, v: Verdict, results: dict) -> None:
    """tests/fixtures/gpu/make_trace.py runs its own torch.profiler (CUDA activity, NCCL):
    trainprof's window steps aside, the analysis uses the job's trace, whose host syncs are the
    script's (3 x .item() + 1 x synchronize() a step)."""
    from trainprof.analysis.run import RunDir

    tdir = ctx.work / "job_profiler_traces"
    tdir.mkdir(exist_ok=True)
    size = [] if ctx.cuda else ["--width", "64", "--batch", "16"]
    script = ctx.root / "tests" / "fixtures" / "gpu" / "make_trace.py"
    job, run, s = ctx.wrap("job_profiler", [ctx.py, script, "--out", tdir, "--device",
                                            "cuda" if ctx.cuda else "cpu", *size], profile="1-2")
    v.data.update(run=str(run))
    if not _summary_or_fail(v, job, s):
        return
    trace = tdir / "gpu_item_sync.pt.trace.json.gz"
    v.data["trace"] = str(trace)
    jp = veval.meta(run).get("job_profiler") or {}
    v.need(f"trainprof's window skipped for the job's (meta job_profiler {jp})", jp.get("window_skipped") is True)
    used = RunDir(run).profiler_traces().get(0)
    v.need(f"analysis uses the job's trace (got {used})",
           used is not None and trace.is_file() and used.resolve().samefile(trace))
    v.need("summary says the job runs its own profiler",
           any("job runs its own profiler" in p for p in s.get("problems", [])))
    veval.eval_job_trace(v, trace, ctx.cuda, SYNCS_PER_STEP, D2H_PER_STEP)
    v.data["fixture"] = {"check": "job_profiler", "trace": True, "kwargs": {}}


# --------------------------------------------------------------------------- NaN, memory
def _nan(ctx: Ctx, v: Verdict, name: str, spec: str, env: dict) -> None:
    job, run, s = ctx.wrap(name, [*ctx.launch1(), *ctx.reference(*sizes(ctx), "--steps", 5, "--inject", spec)],
                           env=env)
    v.data.update(run=str(run), fixture={"check": name, "kwargs": {}})
    if _summary_or_fail(v, job, s):
        veval.eval_nan(v, run, s, ctx.cuda)


def check_nan(ctx: Ctx, v: Verdict, results: dict) -> None:
    _nan(ctx, v, "nan", "nan:rank=0,step=3,module=layers.1.mlp,phase=forward,value=nan", {})


def check_nan_sync(ctx: Ctx, v: Verdict, results: dict) -> None:
    _nan(ctx, v, "nan_sync", "nan:rank=0,step=2,module=layers.0.attn,phase=forward,value=inf",
         {"TRAINPROF_NAN_SYNC": "1"})


def check_fragmentation(ctx: Ctx, v: Verdict, results: dict) -> None:
    env = {"TRAINPROF_MEMORY_HISTORY": "1", "TRAINPROF_MEMORY_HISTORY_ENTRIES": "200"}  # a small snapshot
    job, run, s = ctx.wrap("fragmentation", [*ctx.launch1(), *ctx.reference(
        *sizes(ctx), "--steps", 4, "--inject", "fragment:rank=0")], env=env)
    v.data.update(run=str(run), fixture={"check": "fragmentation", "kwargs": {}})
    if _summary_or_fail(v, job, s):
        veval.eval_fragmentation(v, run, s, ctx.cuda)


# --------------------------------------------------------------------------- on ref_1rank's run
def _ref_run(v: Verdict, results: dict):
    r = results.get("ref_1rank")
    run = Path(r.data["run"]) if r and r.data.get("run") else None
    if not v.need("ref_1rank's run directory", run and (run / "summary.json").is_file()):
        return None, None
    return run, json.loads((run / "summary.json").read_text())


def check_telemetry(ctx: Ctx, v: Verdict, results: dict) -> None:
    run, s = _ref_run(v, results)
    if run:
        veval.eval_telemetry(v, run, s, ctx.cuda)
        v.data["fixture"] = {"check": "telemetry", "of": "ref_1rank", "kwargs": {}}


def check_mfu(ctx: Ctx, v: Verdict, results: dict) -> None:
    run, s = _ref_run(v, results)
    if run:
        veval.eval_mfu(v, run, s, ctx.cuda)
        v.data["fixture"] = {"check": "mfu", "of": "ref_1rank", "kwargs": {}}


# --------------------------------------------------------------------------- overhead, HTA
def _ab(ctx: Ctx, v: Verdict, tag: str, probes_off: str, limit: float | None) -> dict | None:
    """One alternated A/B (benchmarks/bench_probes_ab.py, one process) with TRAINPROF_PROBES_OFF."""
    out = ctx.work / f"overhead_{tag}.json"
    args = AB_GPU if ctx.cuda else AB_CPU
    job = ctx.run(f"overhead_{tag}", [ctx.py, ctx.root / "benchmarks" / "bench_probes_ab.py", "--json", out, *args],
                  env={"TRAINPROF_PROBES_OFF": probes_off} if probes_off else None)
    if not v.need(f"{tag}: A/B benchmark exit 0 (got {job.rc}; {job.tail(300)!r})", job.rc == 0 and out.is_file()):
        return None
    r = json.loads(out.read_text())
    v.data[tag] = r
    rounds, block = int(args[1]), int(args[3])
    v.need(f"{tag}: {rounds} alternated rounds (got {len(r['ratios'])})", len(r["ratios"]) == rounds)
    v.need(f"{tag}: the 'on' blocks ran the probes ({r['step_records_on']} step records)",
           r["step_records_on"] >= rounds * block)
    if limit is None:  # dry run: a shared CPU and a tiny model time nothing to 1 %
        v.need(f"{tag}: overhead measured (got {r['overhead_pct']})", r["overhead_pct"] == r["overhead_pct"])
    else:
        v.need(f"{tag}: overhead <= {limit} % (got {r['overhead_pct']:+.2f} %)", r["overhead_pct"] <= limit)
    return r


def check_overhead(ctx: Ctx, v: Verdict, results: dict) -> None:
    """The always-on probes (the NaN watch aside, as docs/overhead.md's 1 % budget) on a
    realistic GPU step; then the whole set with the NaN watch (its own 5 % budget on top)."""
    r = _ab(ctx, v, "always_on", "nan_watch", OVERHEAD_LIMIT_PCT if ctx.cuda else None)
    nan = _ab(ctx, v, "with_nan_watch", "", NAN_WATCH_LIMIT_PCT) if ctx.cuda else None
    if r:
        lo, hi = r["ci95_pct"]
        v.number = f"{r['overhead_pct']:+.2f} % [{lo:+.1f}, {hi:+.1f}] at {r['median_ms']['off']:.1f} ms" + (
            f"; +NaN watch {nan['overhead_pct']:+.2f} %" if nan else "")
    if not ctx.cuda:
        v.notes.append("(dry run: no limit on a shared CPU; the NaN-watch run only on CUDA)")


def check_hta(ctx: Ctx, v: Verdict, results: dict) -> None:
    import vhta

    vhta.check(ctx, v, results, HTA_TOLERANCE_PP)


CHECKS = [
    Check("ref_1rank", check_ref_1rank, 150, "reference job, 1 rank: clean, device trace, every step"),
    Check("ref_2rank_gloo", check_ref_2rank_gloo, 150, "2 ranks share the GPU over gloo: slow input found"),
    Check("ddp_nccl", check_ddp, 200, "DDP on NCCL: bucket hook recorded, parameters identical"),
    Check("job_profiler", check_job_profiler, 120, "job's own profiler: kept, its trace analysed"),
    Check("nan", check_nan, 150, "injected NaN: module and op (replay)"),
    Check("nan_sync", check_nan_sync, 150, "injected Inf with TRAINPROF_NAN_SYNC=1: module and op"),
    Check("fragmentation", check_fragmentation, 150, "fragment fault: finding + snapshot"),
    Check("telemetry", check_telemetry, 30, "NVML samples joined to steps", after=("ref_1rank",)),
    Check("mfu", check_mfu, 30, "MFU with the device's peak", after=("ref_1rank",)),
    Check("hta", check_hta, 120, "trainprof vs HTA on the same CUDA traces",
          after=("ref_1rank", "job_profiler")),
    Check("overhead", check_overhead, 150, "always-on probes <= 1 %, alternated A/B", exclusive=True),
]
