"""A rank stopped for 30 s that then recovered is a stall naming the rank, where and how long.

tests/fixtures/stopped-rank-run.tar.gz was recorded with
`trainprof wrap --hang-timeout 10 --profile-steps none -- torchrun --nproc-per-node 2 -m
trainprof.reference --dp 2 --steps 8 --layers 2 --hidden 64 --inject straggler:rank=0,delay_ms=1500`
and `kill -STOP` of rank 1 after its third step, `kill -CONT` 30 s later: both ranks ran all 8
steps, the watchdog fired once and rank 1 did not answer its dump in time."""

from __future__ import annotations

import json
import tarfile
from paths import FIXTURES

from helpers import run_cli

FIXTURE = FIXTURES / "stopped-rank-run.tar.gz"


def test_a_stopped_rank_that_recovered_is_named_with_where_and_how_long(tmp_path):
    with tarfile.open(FIXTURE) as tf:
        tf.extractall(tmp_path, filter="data")
    run = tmp_path / "stopped-rank"
    proc = run_cli(["analyze", run, "--out", tmp_path / "out", "--no-report"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    (hang,) = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["severity"] == "warning" and hang["ranks"] == [1]
    msg = hang["message"]
    assert msg.startswith("Stall (the job recovered): rank 1 stopped progressing for 30.7 s in step 3")
    assert "after all_gather #102 of group 0" in msg and "rank 0 waited for it in reduce_scatter #107" in msg
    assert "did not answer the hang watchdog's stack dump in time" in msg
    assert "uneven inputs" not in msg and "never reached" not in msg
    assert hang["evidence"]["stall"]["stalled_s"] == 30.7
