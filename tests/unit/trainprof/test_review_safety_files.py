"""Review-round safety checks in one process: cached digests and smaller input limits, output-
directory locks, ranks to profile without a trace."""

from __future__ import annotations

import pytest


def test_cached_digest_does_not_bypass_a_smaller_input_limit(tmp_path):
    """A digest cached by an analysis with a larger --max-input-mb was reused for a trace the
    current limit refuses: the trace must be refused (a problem), cached digest or not."""
    from synth import cached, synth_run

    from trainprof import safeio
    from trainprof.rundir.files import profiler_trace_path
    from trainprof.analysis.run import RunDir

    run_dir = synth_run(tmp_path / "run", 1)
    cached(run_dir)  # built under the default limit
    size = profiler_trace_path(run_dir, 0).stat().st_size
    try:
        safeio.set_max_input_mb(size / 4 / (1 << 20))
        run = RunDir(run_dir)
        docs = run.digest_docs(write=True)
        assert 0 not in (docs or {})
        assert any("larger than" in p and "--max-input-mb" in p for p in run.problems), run.problems
    finally:
        safeio.set_max_input_mb(None)
    run = RunDir(run_dir)  # the limit back: the cached digest is used again
    assert 0 in run.digest_docs(write=True)


def test_outdir_lock_is_not_broken_while_its_holder_lives(tmp_path, monkeypatch):
    """A launcher deciding about --out for longer than the stale-lock age (a --force removing
    many files) had its lock broken by a second launcher, both then decided at once, and the
    first removed the second's lock on leaving."""
    import threading
    import time

    from trainprof.launch import outdir

    monkeypatch.setattr(outdir, "LOCK_STALE_S", 0.4)
    inside, overlaps = [], []

    def hold(name, seconds):
        with outdir._Lock(tmp_path):
            if inside:
                overlaps.append((name, list(inside)))
            inside.append(name)
            time.sleep(seconds)
            inside.remove(name)

    a = threading.Thread(target=hold, args=("a", 1.5))
    a.start()
    time.sleep(0.1)
    b = threading.Thread(target=hold, args=("b", 0.1))
    b.start()
    a.join()
    b.join()
    assert overlaps == []
    assert not (tmp_path / outdir.LOCK).exists()


def test_outdir_lock_of_a_dead_holder_is_still_broken(tmp_path, monkeypatch):
    import os
    import time

    from trainprof.launch import outdir

    monkeypatch.setattr(outdir, "LOCK_STALE_S", 0.2)
    lock = tmp_path / outdir.LOCK
    lock.write_text("12345\n")
    old = time.time() - 5
    os.utime(lock, (old, old))
    t0 = time.monotonic()
    with outdir._Lock(tmp_path):
        assert lock.exists()
    assert time.monotonic() - t0 < 5 and not lock.exists()


@pytest.mark.parametrize("profiled", [True, False])
def test_rank_to_profile_without_a_trace_is_a_problem(tmp_path, profiled):
    """A rank that was to record the profiler window but lost its trace was reported as
    "2 of 2 ranks profiled" with no problem; a rank skipped on purpose stays silent."""
    import json

    from synth import synth_run

    from trainprof.analysis.runner import analyze
    from trainprof.rundir.files import profiler_trace_path
    from trainprof.analysis.run import RunDir

    run_dir = synth_run(tmp_path / "run", 2)
    for r in range(2):
        meta = run_dir / "ranks" / f"rank-{r:05d}" / "meta.json"
        doc = json.loads(meta.read_text())
        doc.update(profiled=profiled or r == 0, profile_policy="all" if profiled else "list",
                   profile_ranks="all" if profiled else "0")
        meta.write_text(json.dumps(doc))
    profiler_trace_path(run_dir, 1).unlink()
    problems = analyze(RunDir(run_dir))["problems"]
    lost = [p for p in problems if "left no trace" in p]
    if profiled:
        assert len(lost) == 1 and "ranks 1:" in lost[0], problems
    else:
        assert lost == [], problems
