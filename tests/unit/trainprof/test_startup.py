"""Start-up imports: each command imports only what it uses (checked on sys.modules, not timed).

`trainprof analyze` on a small trace is mostly interpreter start-up and imports, so a module that
a verb does not need must not be imported when it starts: no torch, matplotlib or scipy for
analyze --no-report, no numpy/pandas for --version and --help, no launcher for analyze."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

HEAVY = ("torch", "matplotlib", "scipy")

# Runs the CLI in this process and prints the modules imported by then.
SNIPPET = """
import json, sys
from trainprof.cli import main
try:
    main(sys.argv[1:], prog_name="trainprof")
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _modules_after(*args: str) -> tuple[int, set[str]]:
    r = subprocess.run([sys.executable, "-c", SNIPPET, *map(str, args)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    return doc["code"], set(doc["modules"])


def _imported(modules: set[str], names) -> list[str]:
    return sorted(n for n in names if n in modules or any(m.startswith(n + ".") for m in modules))


def _tiny_trace(path):
    """One ProfilerStep with a few CPU ops and a gloo collective: a small but real analysis."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
           "ts": 1000.0, "dur": 500.0}]
    for i in range(20):
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                   "ts": 1001.0 + 20 * i, "dur": 10.0,
                   "args": {"Input Dims": [[8, 16], [16, 16]], "Input type": ["float", "float"]}})
    doc = {"distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 1},
           "traceEvents": ev}
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_version_and_help_import_no_analysis_stack():
    for args in (["--version"], ["--help"], ["analyze", "--help"], ["compare", "--help"]):
        code, mods = _modules_after(*args)
        assert code == 0, args
        assert not _imported(mods, HEAVY + ("numpy", "pandas", "rich", "trainprof.analyzers",
                                            "trainprof.reports", "trainprof.trace")), args


def test_analyze_imports_neither_launcher_nor_plotting(tmp_path):
    trace = _tiny_trace(tmp_path / "rank-0.pt.trace.json.gz")
    code, mods = _modules_after("analyze", trace, "--no-report", "-q")
    assert code == 0
    assert (tmp_path / "rank-0.pt.trace.json.gz.summary.json").is_file()
    assert "trainprof.trace._frames" in mods  # it did parse the trace
    assert not _imported(mods, HEAVY + ("trainprof.launch.launcher", "trainprof.cli.wrap",
                                        "trainprof.cli.demo", "trainprof.reports.html"))


def _gpu_trace(path, steps: int = 2):
    """A small GPU trace: ProfilerSteps of CPU ops, each launching a kernel (correlated through
    cudaLaunchKernel), a host-to-device copy and an NCCL all-reduce on a second stream."""
    ev, corr = [], 0

    def kernel(name, cat, ts, dur, stream, launch_ts, args=None):
        nonlocal corr
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                   "tid": 1, "ts": launch_ts, "dur": 4.0, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts,
                   "dur": dur, "args": {"correlation": corr, "stream": stream, "device": 0,
                                        **(args or {})}})

    for s in range(steps):
        t0 = 1000.0 + 1000.0 * s
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s + 1}", "pid": 1,
                   "tid": 1, "ts": t0, "dur": 900.0})
        for i in range(4):
            t = t0 + 10 + 100 * i
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                       "ts": t, "dur": 20.0, "args": {"Input Dims": [[64, 128], [128, 256]],
                                                      "Input type": ["float", "float"]}})
            kernel("ampere_sgemm_64x64_nn", "kernel", t + 30, 50.0, 7, t + 5,
                   {"grid": [4, 4, 1], "block": [128, 1, 1]})
        kernel("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", t0 + 500, 20.0, 7, t0 + 495,
               {"bytes": 1 << 20})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1,
                   "ts": t0 + 600, "dur": 10.0,
                   "args": {"Collective name": "allreduce", "In msg nelems": 1024,
                            "Out msg nelems": 1024, "Group size": 1, "dtype": "Float",
                            "Process Group Name": "0", "Process Group Ranks": "[0]"}})
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
               "kernel", t0 + 620, 60.0, 13, t0 + 605)
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
           "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "computeMajor": 9,
                                 "computeMinor": 0, "numSms": 132,
                                 "totalGlobalMem": 85_000_000_000}],
           "traceEvents": ev}
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_analyze_traces_never_imports_pandas(tmp_path):
    """A folder of bare traces is analyzed on numpy alone: no pandas (a quarter of a second of
    start-up) nor numpy.ma (np.median's first call), with --no-report and with the report and the terminal summary, and without an
    analyzer failing for want of it."""
    d = tmp_path / "traces"
    d.mkdir()
    _gpu_trace(d / "rank-0.pt.trace.json.gz")
    for args, out in ((["--no-report", "-q"], tmp_path / "quiet"), ([], tmp_path / "full")):
        code, mods = _modules_after("analyze", d, "--out", out, *args)
        assert code == 0, args
        assert "trainprof.trace._frames" in mods  # it did parse the trace
        assert not _imported(mods, ("pandas", "scipy", "numpy.ma") + HEAVY), args
        summary = json.loads((out / "summary.json").read_text())
        assert summary["errors"] == [], summary["errors"]
        assert summary["metrics"].get("comm_compute"), sorted(summary["metrics"])
        assert (out / "report.html").is_file() == (not args)


def test_finding_traces_imports_no_frames():
    r = subprocess.run([sys.executable, "-c",
                        "import sys, trainprof.trace._discover, trainprof.trace\n"
                        "print(sorted(m for m in ('numpy', 'pandas', 'trainprof.trace._frames')"
                        " if m in sys.modules))"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_trace_api_names_resolve_lazily():
    import trainprof.trace as trace

    assert trace.Trace.__name__ == "Trace" and callable(trace.load_traces)
    assert issubclass(trace.TraceError, Exception)
    assert set(trace.__all__) <= set(dir(trace))
