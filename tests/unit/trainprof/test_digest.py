"""Per-rank trace digests (trainprof/analysis/digest.py): built once per trace in a process pool, cached
in RUN/digests/, reused without parsing the trace again, rebuilt when stale or malformed, and
giving the same numbers as the traces themselves.

Cases that run multi-process jobs: tests/integration/test_digest_jobs.py."""

from __future__ import annotations

from synth import FIXTURES, GPU_RUN, cached, synth_run
import json
import os
import shutil

import pytest

from trainprof.analysis import digest, pool
from trainprof.analysis.runner import analyze, analyze_and_write
from trainprof.analyzers import _comm_breakdown, comm_compute, roofline
from trainprof.rundir.files import profiler_trace_path
from trainprof.analysis.run import RunDir
from trainprof.trace import load_trace
from digest_checks import garble_keeping_stamp, metrics


def test_digest_written_reused_without_parsing_and_rebuilt_when_stale(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(GPU_RUN, run_dir)
    cold = metrics(cached(run_dir))
    p = digest.digest_path(run_dir, 0)
    doc = json.loads(p.read_text())
    assert digest.check(doc) is None and doc["schema_version"] == digest.SCHEMA_VERSION
    assert doc["rank"] == 0 and doc["trace"]["path"] == "profiler/rank-00000.pt.trace.json.gz"
    assert doc["trace"]["size"] == profiler_trace_path(run_dir, 0).stat().st_size
    assert {"comm_compute", "roofline", "memory"} <= set(doc["sections"])
    assert all("data" in s for s in doc["sections"].values())
    # the trace replaced by zeros of the same size and mtime: the digest is used, not the trace
    trace = profiler_trace_path(run_dir, 0)
    original = trace.read_bytes()
    garble_keeping_stamp(trace)
    warm_run = RunDir(run_dir)
    assert metrics(warm_run) == cold
    assert not [x for x in warm_run.problems if "trace" in x and "rank-00000.pt" in x]
    # a changed trace (new mtime) invalidates it: rebuilt from the trace, which now fails
    trace.write_bytes(original[:1000])
    stale = RunDir(run_dir)
    assert metrics(stale)["comm_compute"] == {}
    assert any("rank-00000.pt.trace.json.gz" in x for x in stale.problems)
    # the real trace back (new mtime again): rebuilt, same numbers
    trace.write_bytes(original)
    assert metrics(cached(run_dir)) == cold
    assert json.loads(p.read_text())["trace"]["mtime_ns"] == trace.stat().st_mtime_ns


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]),
                                     json.dumps({"kind": digest.KIND, "schema_version": 1, "rank": 0,
                                                 "trace": {"size": "big"}, "facts": {},
                                                 "sections": {}})])
def test_malformed_digest_is_rebuilt_with_a_problem(tmp_path, content):
    run_dir = tmp_path / "run"
    shutil.copytree(GPU_RUN, run_dir)
    cold = metrics(cached(run_dir))
    p = digest.digest_path(run_dir, 0)
    p.write_text(content)
    run = cached(run_dir)
    assert metrics(run) == cold
    (said,) = [x for x in run.problems if "malformed trace digest" in x]
    assert str(p) in said and "rebuilt" in said
    assert digest.check(json.loads(p.read_text())) is None  # rewritten whole


def test_pool_digests_equal_in_process_and_trace_numbers(tmp_path):
    """4 ranks digested by a pool of 2 processes, and again in one process: the same digests,
    and the same numbers as computed from the parsed traces directly."""
    run_dir = synth_run(tmp_path / "run", 4)
    rep = digest.build(run_dir, workers=2)
    assert rep["built"] == [0, 1, 2, 3] and rep["failed"] == {}
    pooled = {r: json.loads(digest.digest_path(run_dir, r).read_text())["sections"] for r in range(4)}
    shutil.rmtree(run_dir / digest.DIGESTS_DIR)
    assert digest.build(run_dir, workers=1)["built"] == [0, 1, 2, 3]
    single = {r: json.loads(digest.digest_path(run_dir, r).read_text())["sections"] for r in range(4)}
    assert pooled == single
    assert digest.build(run_dir)["reused"] == [0, 1, 2, 3]
    tr = load_trace(profiler_trace_path(run_dir, 2))
    rows, hta, kind = _comm_breakdown.rank_breakdown(tr, {})
    d = pooled[2]["comm_compute"]["data"]
    assert (d["kind"], d["hta"]) == (kind, hta) and len(d["rows"]) == len(rows)
    assert [r["compute_ms"] for r in d["rows"]] == [r["compute_ms"] for r in rows]
    cls, facts = roofline.op_classes(tr)
    assert pooled[2]["roofline"]["data"] == json.loads(json.dumps({"classes": cls, "facts": facts}))
    m = metrics(RunDir(run_dir))
    assert m["comm_compute"]["job"]["ranks"] == 4 and len(m["roofline"]["per_rank"]) == 4


def test_build_only_the_ranks_given(tmp_path):
    run_dir = synth_run(tmp_path / "run", 3)
    assert digest.build(run_dir, ranks=[1])["built"] == [1]
    assert sorted(p.name for p in (run_dir / digest.DIGESTS_DIR).iterdir()) == ["rank-00001.json"]


def test_summary_identical_with_and_without_cached_digests(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(GPU_RUN, run_dir)
    elsewhere = analyze_and_write(run_dir, tmp_path / "out", report=False)[0]
    assert not (run_dir / digest.DIGESTS_DIR).exists()  # --out elsewhere: the run is not touched
    cold = analyze_and_write(run_dir, report=False)[0]  # trainprof analyze RUN: digests cached
    assert (run_dir / digest.DIGESTS_DIR / "rank-00000.json").exists()
    garble_keeping_stamp(profiler_trace_path(run_dir, 0))
    warm = analyze_and_write(run_dir, report=False)[0]
    for s in (cold, elsewhere):
        assert warm["metrics"] == s["metrics"] and warm["findings"] == s["findings"]
        assert warm["problems"] == s["problems"] and warm["errors"] == s["errors"] == []


def test_failing_section_is_an_error_of_that_section_only(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(GPU_RUN, run_dir)

    def broken(run, rank, trace):
        raise ValueError("no roofline today")

    monkeypatch.setattr(roofline, "trace_digest", broken)  # one trace: digested in-process
    run = cached(run_dir)
    s = analyze(run)
    doc = json.loads(digest.digest_path(run_dir, 0).read_text())
    assert "no roofline today" in doc["sections"]["roofline"]["error"]
    assert "data" in doc["sections"]["comm_compute"] and s["metrics"]["comm_compute"]
    assert any("roofline" in p and "failed on rank(s) 0" in p for p in s["problems"])
    assert [e["analyzer"] for e in s["errors"]] == ["roofline"]
    monkeypatch.undo()  # an error is not trusted as final: the next build retries it
    assert digest.build(run_dir)["built"] == [0]
    assert "data" in json.loads(digest.digest_path(run_dir, 0).read_text())["sections"]["roofline"]


def test_job_rows_relabel_groups_the_job_names_differently():
    """A trace alone may label a group differently from the whole job (another rank's trace
    names it): the row's by_dim is rebuilt from the per-group split."""
    d = {"rows": [{"step": 1, "by_dim": {"pg 7": {"comm_ms": 2.0, "exposed_ms": 1.0}}}],
         "by_pg": [{"7": {"comm_ms": 2.0, "exposed_ms": 1.0}, "": {"comm_ms": 0.5, "exposed_ms": 0.5}}],
         "pg_dims": {"7": "pg 7"}}
    assert comm_compute._job_rows(d, {}) is d["rows"]
    (row,) = comm_compute._job_rows(d, {"7": "tp"})
    assert row["by_dim"] == {"tp": {"comm_ms": 2.0, "exposed_ms": 1.0},
                             "unknown": {"comm_ms": 0.5, "exposed_ms": 0.5}}


def test_bare_trace_folder_is_left_untouched(tmp_path):
    folder = tmp_path / "traces"
    shutil.copytree(FIXTURES / "hta" / "trace_filter", folder)
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}
    run = RunDir(folder)
    assert run.ranks == [0, 1]
    m = metrics(run)
    assert m["comm_compute"]["job"]["ranks"] == 2
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}
    assert after == before
    # the digests (in memory) hold what the trace gives
    tr = load_trace(folder / "sampled_rank-1.json.gz")
    _, hta, _ = _comm_breakdown.rank_breakdown(tr)
    assert run.trace_digests("comm_compute")[1]["hta"] == hta
    with pytest.raises(Exception, match="not a trainprof run directory"):
        digest.build(folder)


def test_share_splits_traced_ranks_evenly():
    from trainprof.analysis.reduce import share

    ranks = [0, 8, 16, 24, 32]  # one profiled rank per node of 8
    assert [share(ranks, r, 2) for r in range(2)] == [[0, 16, 32], [8, 24]]
    assert sum((share(ranks, r, 3) for r in range(3)), []) == [0, 24, 8, 32, 16]


def test_digests_never_written_through_a_symlinked_digests_folder(tmp_path):
    """RUN/digests a symlink to a folder outside the run: analysis overwrote the files there
    (rank-00000.json of someone else); now the digests are used, not cached, and it is said."""
    run_dir = synth_run(tmp_path / "run", 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank-00000.json").write_text("not trainprof's\n")
    (run_dir / "digests").symlink_to(elsewhere)
    run = RunDir(run_dir)
    docs = run.digest_docs(write=True)
    assert 0 in docs and docs[0]["sections"]
    assert (elsewhere / "rank-00000.json").read_text() == "not trainprof's\n"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["rank-00000.json"]
    assert any("trace digests are not cached there" in p for p in run.problems), run.problems


def test_default_pool_is_bounded_by_the_available_memory(tmp_path, monkeypatch):
    """By default the pool had as many workers as CPUs, each parsing a whole trace: on a node
    with many CPUs and large traces that exhausts the memory. Bounded now by the memory
    available for the largest trace's parse; an explicit worker count is kept."""
    run_dir = synth_run(tmp_path / "run", 3)
    jobs = [("run", str(run_dir), r, str(profiler_trace_path(run_dir, r)), None, None, [], 1)
            for r in range(3)]
    size = profiler_trace_path(run_dir, 0).stat().st_size
    need = pool.PARSE_FACTOR * size * pool.GZIP_RATIO_EST + pool.WORKER_BASE
    monkeypatch.delenv(pool.WORKERS_ENV, raising=False)
    monkeypatch.setattr(pool.settings, "available_cpus", lambda: 128)
    monkeypatch.setattr(pool, "_mem_available", lambda: int(2.5 * need / pool.MEMORY_SHARE))
    assert pool.memory_bound(jobs) == 2
    seen = []
    monkeypatch.setattr(pool, "ProcessPoolExecutor",
                        lambda max_workers, **kw: seen.append(max_workers) or (_ for _ in ()).throw(
                            RuntimeError("stop")))
    with pytest.raises(RuntimeError):
        digest.run_jobs(jobs)
    assert seen == [2]
    monkeypatch.setattr(pool, "_mem_available", lambda: need // 10)
    out = digest.run_jobs(jobs[:2], run=None)  # one worker: in-process, no pool
    assert seen == [2] and all(doc is not None for _, doc, _ in out)
    with pytest.raises(RuntimeError):
        digest.run_jobs(jobs, workers=3)  # explicit: kept
    assert seen == [2, 3]


def _dies_on_rank_1(monkeypatch):
    parse = digest._parse

    def dying(path, rank, pieces):
        if rank == 1:
            os._exit(137)  # as the out-of-memory killer ends a worker
        return parse(path, rank, pieces)

    monkeypatch.setattr(digest, "_parse", dying)  # the pool's workers are forked: they see it


def test_a_worker_killed_costs_only_its_own_rank(tmp_path, monkeypatch):
    """One worker killed (out of memory) broke the pool and every rank not finished yet was
    lost with it (4 of 4 failed); now only the rank whose trace kills its worker fails."""
    run_dir = synth_run(tmp_path / "run", 4)
    _dies_on_rank_1(monkeypatch)
    rep = digest.build(run_dir, workers=2)
    assert rep["built"] == [0, 2, 3] and list(rep["failed"]) == [1]
    assert "worker process failed" in rep["failed"][1]


def test_launcher_digests_never_in_its_own_process(tmp_path, monkeypatch):
    """wrap reduces its node's traces after the job: with one worker that ran in the launcher
    itself, so a parse killed for memory killed the launcher, and the job's exit status with
    it. isolate=True (what wrap passes) runs even one trace in a child process."""
    run_dir = synth_run(tmp_path / "run", 2)
    _dies_on_rank_1(monkeypatch)
    rep = digest.build(run_dir, workers=1, isolate=True)  # this test process survives
    assert rep["built"] == [0] and list(rep["failed"]) == [1]
    from trainprof.cli.wrap import reduce_local_ranks
    from trainprof.launch.launcher import JobResult

    monkeypatch.setenv(digest.WORKERS_ENV, "1")
    shutil.rmtree(run_dir / "digests")
    notes = []
    reduce_local_ranks(run_dir, JobResult(0, None, local_ranks=[1]), notes)  # survives too
    assert notes == [] and not (run_dir / "digests" / "rank-00001.json").exists()


def test_cached_digest_of_a_gzip_trace_respects_a_smaller_inflate_limit(tmp_path, monkeypatch):
    """A cached digest of a .gz trace was reused whenever the compressed file was within
    --max-input-mb / TRAINPROF_MAX_INPUT_MB, though a parse of that trace now refuses the JSON it
    inflates to. The digest records how large its trace's JSON was (trace_bytes), and is reused
    only where a fresh parse would read the trace; otherwise the trace is refused, named."""
    import gzip

    from trainprof import safeio

    run_dir = synth_run(tmp_path / "run", 1)
    trace = profiler_trace_path(run_dir, 0)
    json_bytes = len(gzip.decompress(trace.read_bytes()))
    cached(run_dir)
    assert json_bytes > 4 * trace.stat().st_size
    for how in ("option", "env"):  # a limit above the file, below its JSON
        mb = (trace.stat().st_size + json_bytes) / 2 / (1 << 20)
        if how == "option":
            safeio.set_max_input_mb(mb)
        else:
            monkeypatch.setenv(safeio.ENV, f"{mb:.6f}")
        try:
            run = RunDir(run_dir)
            assert 0 not in run.digest_docs(write=True)
            said = [p for p in run.problems if str(trace) in p and "inflates past" in p]
            assert said and "--max-input-mb" in said[0], run.problems
            # the same refusal as a parse without any cached digest
            (tmp_path / how).mkdir()
            shutil.copy(trace, tmp_path / how / trace.name)
            bare = RunDir(tmp_path / how)
            assert not bare.digest_docs()
            assert any("inflates past" in p and trace.name in p for p in bare.problems)
        finally:
            safeio.set_max_input_mb(None)
            monkeypatch.delenv(safeio.ENV, raising=False)
    doc = json.loads(digest.digest_path(run_dir, 0).read_text())
    assert doc["trace_bytes"] == json_bytes
    # the limit back: the cached digest is reused (the trace itself is not read again)
    garble_keeping_stamp(trace)
    run = RunDir(run_dir)
    assert 0 in run.digest_docs(write=True)
    assert not [p for p in run.problems if str(trace) in p]


def test_cached_digest_without_its_json_size_is_rebuilt(tmp_path):
    """A digest that does not say how large its trace's JSON was cannot be checked against the
    limit: rebuilt, not trusted."""
    run_dir = synth_run(tmp_path / "run", 1)
    cached(run_dir)
    p = digest.digest_path(run_dir, 0)
    doc = json.loads(p.read_text())
    del doc["trace_bytes"]
    p.write_text(json.dumps(doc))
    assert digest.build(run_dir)["built"] == [0]
    assert isinstance(json.loads(p.read_text())["trace_bytes"], int)


_FORKS_WITH_THREADS: list = []
_WATCH_FORKS: list = []


def _record_fork():
    import threading

    if _WATCH_FORKS and threading.active_count() > 1:
        _FORKS_WITH_THREADS.append(threading.active_count())


os.register_at_fork(before=_record_fork)


class _ThreadRunning:
    """A thread that runs meanwhile, as the launcher's node heartbeat does."""

    def __enter__(self):
        import threading

        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stop.wait, daemon=True)
        self.thread.start()
        _WATCH_FORKS.append(1)
        return self

    def __exit__(self, *exc):
        _WATCH_FORKS.clear()
        self.stop.set()
        self.thread.join()


def test_pool_never_forks_a_process_that_has_threads(tmp_path):
    """wrap reduces its ranks' traces while the launcher has threads (node heartbeat, hang
    watchdog): its pool forked the launcher then (a child forked while another thread holds a
    lock, the import lock or an allocator's, can deadlock). A process with threads now runs the
    pool in a fresh single-threaded child; the digests are the same."""
    run_dir = synth_run(tmp_path / "run", 3)
    _FORKS_WITH_THREADS.clear()
    progress = []
    with _ThreadRunning():
        rep = digest.build(run_dir, workers=2, isolate=True, progress=progress.append)
    assert _FORKS_WITH_THREADS == []
    assert rep["built"] == [0, 1, 2] and rep["failed"] == {}
    assert progress[-1] == "trace digests 3/3"
    child = {r: json.loads(digest.digest_path(run_dir, r).read_text())["sections"]
             for r in range(3)}
    shutil.rmtree(run_dir / digest.DIGESTS_DIR)
    assert digest.build(run_dir, workers=1)["built"] == [0, 1, 2]  # in this process
    assert child == {r: json.loads(digest.digest_path(run_dir, r).read_text())["sections"]
                     for r in range(3)}


_DIE_ON_RANK = """
import os
if os.environ.get("TEST_DIGEST_DIE_ON_RANK"):
    import trainprof.analysis.digest as _d
    _parse = _d._parse

    def _dying(path, rank, pieces):
        if rank == int(os.environ["TEST_DIGEST_DIE_ON_RANK"]):
            os._exit(137)  # as the out-of-memory killer ends a worker
        return _parse(path, rank, pieces)

    _d._parse = _dying
"""


def test_a_worker_killed_in_the_pool_process_costs_only_its_own_rank(tmp_path, monkeypatch):
    """The pool run in a fresh child (this process has a thread): one worker killed costs its
    rank only, and this process survives."""
    run_dir = synth_run(tmp_path / "run", 3)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_DIE_ON_RANK)  # the child's workers die on rank 1
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    monkeypatch.setenv("TEST_DIGEST_DIE_ON_RANK", "1")
    with _ThreadRunning():
        rep = digest.build(run_dir, workers=2, isolate=True)
    assert rep["built"] == [0, 2] and list(rep["failed"]) == [1]
    assert "worker process failed" in rep["failed"][1]
