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
    assert not _imported(mods, HEAVY + ("trainprof.launcher", "trainprof.cli.wrap",
                                        "trainprof.cli.demo", "trainprof.reports.html"))


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
