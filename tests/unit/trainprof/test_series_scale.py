"""Reads of a wide run cost a file check per rank, not per rank and per read
(trainprof/rundir/series.py): the analysis' window and detail budget depend on how many ranks
wrote the bounded format, which used to be counted again, one stat per rank, at every rank's
table and ring read (ranks² checks: ~12,000 at 64 ranks, seconds of the end-of-job analysis)."""

from __future__ import annotations

import json

from trainprof.analysis.run import RunDir
from trainprof.rundir import compact as fmt
from trainprof.rundir import detail, series


def _run(tmp_path, ranks: int, compact: int) -> RunDir:
    for r in range(ranks):
        d = tmp_path / "ranks" / f"rank-{r:05d}"
        (d / fmt.COMPACT_DIR).mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"rank": r, "world_size": ranks, "host": "h"}))
        if r < compact:
            (d / fmt.COMPACT_DIR / f"steps{fmt.TABLE_SUFFIX}").write_bytes(b"")
        (d / "collectives.jsonl").write_text(
            json.dumps({"step": 0, "pg": "0", "seq": 1, "op": "all_reduce"}) + "\n")
    return RunDir(tmp_path)


def test_ring_and_window_reads_check_each_rank_once(tmp_path, monkeypatch):
    ranks = 48
    run = _run(tmp_path, ranks, compact=40)
    checks = []
    real = RunDir.rank_file
    monkeypatch.setattr(RunDir, "rank_file", lambda self, rank, name: (
        checks.append((rank, name)), real(self, rank, name))[1])
    for r in run.ranks:  # what every rank's table and ring read asks
        assert series.window_steps(run) == series.ANALYSIS_ROWS // 40
        recs, _ = detail.ring_tail(run, r, "collectives")
        assert [x["op"] for x in recs] == ["all_reduce"]
    compact_checks = [c for c in checks if c[1].startswith(fmt.COMPACT_DIR)]
    assert len(compact_checks) == ranks, len(compact_checks)  # was 2 x 48 x 48 = 4,608
    # the detail budget divides among the ranks that wrote the bounded format
    assert series.compact_ranks(run) == 40
