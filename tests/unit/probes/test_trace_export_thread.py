"""The profiler window's trace export (writing + gzipping the collected results, 0.6-2.4 s on
CPU) runs on a thread of ours, not in the job's step; the session's close waits for it, so the
trace is complete when the process ends. Its span of time is recorded (meta.json
overhead_spans), and step statistics leave out the steps it ran beside."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import threading, torch, trainprof
from trainprof.probes import profiler_window as pw
threads = []
write = pw.ProfilerWindow._write
def spy(self, prof):
    threads.append(threading.current_thread().name)
    write(self, prof)
    with open("export_ms.txt", "w") as f:  # (the thread is joined before the process ends)
        f.write(repr(self.export_ms))
pw.ProfilerWindow._write = spy
m = torch.nn.Linear(64, 64); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with trainprof.session("run", profile_steps="1-2"):
    for i in range(5):
        m(torch.randn(32, 64)).sum().backward(); opt.step(); opt.zero_grad()
print("threads", threads)
"""


def test_trace_written_off_the_jobs_thread_and_complete_at_close(tmp_path):
    env = {**os.environ, "TRAINPROF_CALIBRATION": "0", "TRAINPROF_TELEMETRY": "0"}
    res = subprocess.run([sys.executable, "-c", CODE], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "threads ['trainprof-trace-export']" in res.stdout, res.stdout + res.stderr
    from trainprof.rundir.files import profiler_trace_path
    from trainprof.analysis.run import RunDir
    from trainprof.trace import load_trace

    trace = load_trace(profiler_trace_path(tmp_path / "run", 0))
    assert sorted(set(trace.tables.steps["step"].tolist())) == [1, 2]
    assert not list((tmp_path / "run" / "profiler").glob("*.tmp.json.gz"))
    run = RunDir(tmp_path / "run")
    assert run.steps()["step"].tolist() == [0, 1, 2, 3, 4]
    # the export's span: begun after step 2's boundary closed the window, as long as the
    # export measured itself (plus the span's own bookkeeping), closed before the process ended
    ((kind, a, b),) = [(x["kind"], x["start_ns"], x["end_ns"]) for x in run.rank_meta(0)["overhead_spans"]]
    export_ms = float((tmp_path / "export_ms.txt").read_text())
    step = {r["step"]: r for r in run.stream(0, "steps")}
    assert kind == "trace_export" and step[2]["end_ns"] <= a < b
    assert export_ms <= (b - a) / 1e6 <= export_ms + 100
    from trainprof.analyzers import step_time
    overlapped = [s for s, r in step.items() if r["start_ns"] < b and r["end_ns"] > a]
    assert overlapped and step_time.analyze(run).metrics["excluded_steps"]["trace_export"] == overlapped
