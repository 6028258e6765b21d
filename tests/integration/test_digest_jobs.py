"""trainprof.analysis.reduce under torchrun: the ranks' digests split across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from digest_checks import garble_keeping_stamp, metrics
from synth import synth_run
from trainprof.analysis import digest
from trainprof.analysis.run import RunDir
from trainprof.rundir.files import profiler_trace_path


@pytest.mark.multiproc
def test_reduce_under_torchrun_splits_the_ranks(tmp_path):
    run_dir = synth_run(tmp_path / "run", 4)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "trainprof.analysis.reduce", str(run_dir)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = sorted(line for line in proc.stdout.splitlines() if line.startswith("trainprof.analysis.reduce"))
    assert len(said) == 2
    assert "process 0/2: 2 trace(s): 2 digested" in said[0] and said[0].endswith("ranks 0, 2")
    assert "process 1/2: 2 trace(s): 2 digested" in said[1] and said[1].endswith("ranks 1, 3")
    assert sorted(p.name for p in (run_dir / digest.DIGESTS_DIR).iterdir()) == \
        [f"rank-{r:05d}.json" for r in range(4)]
    for r in range(4):  # the analysis uses them: no trace is parsed again
        garble_keeping_stamp(profiler_trace_path(run_dir, r))
    assert metrics(RunDir(run_dir))["comm_compute"]["job"]["ranks"] == 4
    again = subprocess.run([sys.executable, "-m", "trainprof.analysis.reduce", str(run_dir)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 digested, 4 already current" in again.stdout
