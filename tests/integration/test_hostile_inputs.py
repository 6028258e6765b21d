"""Hostile and broken inputs: run directories, traces, dumps and snapshots are read as untrusted.

Each case is built from a small real run directory (2 gloo ranks, pp=2, a profiled window) or a
real fixture, then broken the way an attacker or an unlucky copy would break it. The CLI runs
in a child of a fresh measuring process, so that its peak RSS (getrusage of the children: the
CLI and the trace workers it forks) and its time are those of this one command. Every case
asserts the outcome: bounded memory and time, one problem line naming the file and the limit
(or a refusal with exit code 2), and the rest of the analysis going on.

Unbounded, these inputs took: the 538-byte shared-reference pickle 12 GB and 147 s; a 29-byte
bytearray(2e9) pickle 2 GB; an 11-byte memo-index pickle 3 GB; a 1.8 MB gzip bomb 1.8 GB; a
world size of 10^6 137 s and 387 MB of output; a FIFO forever.

Single-process cases: tests/unit/trainprof/test_hostile_files.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
from hostile_inputs_shared import analyze, cli, problems_with, shared_list_bomb


SMALL_RUN = ["--pp", "2", "--steps", "5", "--layers", "2", "--hidden", "64"]


@pytest.fixture(scope="module")
def small_run(reference_run):
    """A real 2-rank run directory (pp=2, 5 steps, steps 2-3 profiled), captured once; tests
    break copies of it."""
    return reference_run("hostile2", nproc=2, args=SMALL_RUN, wrap_args=["--profile-steps", "2-3"])


def copy_run(src: Path, dst: Path, traces: bool = False) -> Path:
    shutil.copytree(src, dst)
    if not traces:  # most cases need no trace: the analysis is faster without
        shutil.rmtree(dst / "profiler")
    return dst


def edit_json(path: Path, **fields) -> None:
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))


def fr_dump(payload) -> bytes:
    """A flight-recorder dump (torch writes protocol 2) with ``payload`` as an entry's sizes and
    frames: the places the post-mortem copies into its output."""
    return pickle.dumps({
        "version": "2.10", "pg_config": {},
        "pg_status": {"0": {"last_enqueued_collective": 1, "last_started_collective": 1,
                            "last_completed_collective": 0}},
        "entries": [{"profiling_name": "nccl:all_reduce", "collective_seq_id": 1,
                     "process_group": ["0", ""], "input_sizes": payload, "frames": payload,
                     "state": "scheduled", "retired": False}]}, protocol=2)


# ------------------------------------------------------------------ the data-only unpickler


# ------------------------------------------------------------------ a real run, broken


@pytest.mark.multiproc
def test_clean_small_run_is_the_baseline(small_run, tmp_path):
    res, s = analyze(tmp_path, small_run)
    res.bounded()
    assert res.rc == 0 and not s["errors"], s["errors"]
    assert not s["problems"], s["problems"]
    assert "partial" not in s["run"] and "partial" not in s["metrics"]["step_time"]["job"]
    assert s["metrics"]["roofline"]["job"]["mfu"] > 0
    assert s["metrics"]["pipeline"]["bubble_fraction"] > 0


@pytest.mark.multiproc
def test_shared_reference_pickle_bomb_in_a_flight_recorder_dump(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    dump = run / "ranks/rank-00000/flight-recorder.pkl"
    dump.write_bytes(fr_dump(shared_list_bomb(7)))
    assert dump.stat().st_size < 600
    res = cli(tmp_path, "hang", run, "--json").bounded()
    assert res.rc == 0 and len(res.out_bytes) < 200_000
    out = json.loads(res.stdout)
    assert [p for p in out["problems"] if str(dump) in p and "expand to more than" in p]
    res, s = analyze(tmp_path, run)
    res.bounded()
    assert res.rc == 0 and len(json.dumps(s)) < 2_000_000
    assert len(problems_with(s, str(dump), "expand to more than")) == 1
    assert s["metrics"]["step_time"]["job"]["median_ms"] > 0  # the rest goes on
    # a bytearray(2e9) constructor as a dump: refused, named
    dump.write_bytes(b"\x80\x02cbuiltins\nbytearray\nJ\x00\x94\x35\x77\x85R.")
    res, s = analyze(tmp_path, run)
    res.bounded()
    assert len(problems_with(s, str(dump), "builtins.bytearray", "refus")) == 1


@pytest.mark.multiproc
def test_gzip_bomb_trace_is_refused_with_the_limit_named(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run", traces=True)
    trace = run / "profiler/rank-00000.pt.trace.json.gz"
    member = zlib.compressobj(9, zlib.DEFLATED, 31)
    one = member.compress(b" " * (1 << 20)) + member.flush()  # 1 MB of spaces in ~1 kB
    with open(trace, "wb") as f:  # 1800 concatenated members: 1.8 MB inflating to 1.8 GB
        head = zlib.compressobj(9, zlib.DEFLATED, 31)
        f.write(head.compress(b'{"traceEvents": [') + head.flush())
        for _ in range(1800):
            f.write(one)
    res, s = analyze(tmp_path, run)
    res.bounded()
    assert res.rc == 0
    assert len(problems_with(s, str(trace), "inflates past", "--max-input-mb")) == 1
    assert s["metrics"]["step_time"]["job"]["median_ms"] > 0
    assert s["metrics"]["roofline"]["per_rank"] and not s["errors"]  # rank 1's trace still read
    # an explicit limit replaces the ratio check, and is named
    res, s = analyze(tmp_path, run, "--max-input-mb", "0.5")
    res.bounded()
    assert problems_with(s, str(trace), "larger than the 0.5 MB limit for a profiler trace")
    assert problems_with(s, "rank-00001.pt.trace.json.gz", "inflates past the 0.5 MB limit")
    res = cli(tmp_path, "analyze", run, "--no-report", env={"TRAINPROF_MAX_INPUT_MB": "abc"})
    assert res.rc == 2 and "TRAINPROF_MAX_INPUT_MB='abc'" in res.stderr


@pytest.mark.multiproc
def test_fifos_devices_and_oversized_streams_are_not_read(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    r0, r1 = run / "ranks/rank-00000", run / "ranks/rank-00001"
    for p in (r1 / "steps.jsonl", r0 / "heartbeat.jsonl"):
        p.unlink()
        os.mkfifo(p)  # nobody ever writes: opening it for reading would block forever
    (r1 / "collectives.jsonl").unlink()
    (r1 / "collectives.jsonl").symlink_to("/dev/zero")
    (r0 / "nan.jsonl").write_bytes(b'{"kind": "step"}\n' * 70_000)  # 1.2 MB
    res, s = analyze(tmp_path, run, "--max-input-mb", "1")
    res.bounded()
    assert res.rc == 0
    assert len(problems_with(s, str(r1 / "steps.jsonl"), "a FIFO, not a regular file")) == 1
    assert len(problems_with(s, str(r0 / "heartbeat.jsonl"), "a FIFO")) == 1
    assert len(problems_with(s, str(r1 / "collectives.jsonl"), "a character device")) == 1
    assert len(problems_with(s, str(r0 / "nan.jsonl"), "larger than the 1 MB limit for a stream")) == 1
    assert s["metrics"]["step_time"]["per_rank"][0]["rank"] == 0 and not s["errors"]
    res = cli(tmp_path, "hang", run, "--json").bounded()
    assert res.rc == 0 and json.loads(res.stdout)["problems"]


@pytest.mark.multiproc
def test_world_size_from_files_is_checked_not_a_loop_bound(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    edit_json(run / "ranks/rank-00000/meta.json", world_size=10**6)
    res = cli(tmp_path, "hang", run, "--json").bounded()
    assert res.rc == 0 and len(res.out_bytes) < 200_000
    out = json.loads(res.stdout)
    assert [p for p in out["problems"] if "disagree on the world size" in p and "1000000" in p]
    res, s = analyze(tmp_path, run)
    res.bounded()
    assert s["run"]["world_size"] == 2 and "partial" not in s["run"]
    # every file agrees on 10^6, with 2 ranks present: not trusted, analyses say partial
    for p in (run / "ranks/rank-00001/meta.json", run / "manifest.json"):
        edit_json(p, world_size=10**6)
    res = cli(tmp_path, "hang", run).bounded()
    assert res.rc == 0 and len(res.out_bytes) < 200_000
    res, s = analyze(tmp_path, run)
    res.bounded()
    assert s["run"]["world_size"] == 2 and s["run"]["partial"]["world_size"] == 10**6
    assert problems_with(s, "world size 1000000 but only 2 rank(s) have files: not trusted")
    assert "mfu" not in s["metrics"]["roofline"]["job"]


STREAM_BREAKS = {  # stream -> a documented field given the wrong type
    "steps": ("step", "x"), "collectives": ("blocked_ms", 1e308), "groups": ("ranks", "0,1"),
    "clock": ("offset_ns", "0"), "pipeline": ("stage", [1]), "data": ("wait_ms", {"a": 1}),
    "nan": ("step", 1.5), "heartbeat": ("t_ns", "now"), "memory": ("peak_rss_bytes", -1),
    "steps_device": ("device_ms", "1"), "telemetry": ("sm_util_pct", "high"),
}


@pytest.mark.multiproc
def test_wrongly_typed_records_in_every_stream_are_skipped_and_counted(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    d = run / "ranks/rank-00000"
    for name, (field, bad) in STREAM_BREAKS.items():
        p = d / f"{name}.jsonl"
        lines = p.read_text().splitlines() if p.exists() else [json.dumps({"step": 1, "t_ns": 1})]
        rec = json.loads(lines[0])
        rec[field] = bad
        lines.insert(1, json.dumps(rec))  # line 2
        p.write_text("\n".join(lines) + "\n")
    from trainprof.analysis.run import RunDir

    rd = RunDir(run)  # the reader: one problem per bad record, the others kept
    for name, (field, _) in STREAM_BREAKS.items():
        n = len(rd.stream(0, name))
        hits = [p for p in rd.problems if f"{d / name}.jsonl:2: record skipped" in p and f'"{field}"' in p]
        assert len(hits) == 1 and n == len((d / f"{name}.jsonl").read_text().splitlines()) - 1, name
    res, s = analyze(tmp_path, run)  # the analyses: no analyzer fails on them
    res.bounded()
    assert res.rc == 0 and not s["errors"], s["errors"]
    assert problems_with(s, f"{d / 'steps'}.jsonl:2: record skipped", '"step"')
    clean_steps = len((small_run / "ranks/rank-00000/steps.jsonl").read_text().splitlines())
    st = s["metrics"]["step_time"]
    assert st["job"]["steps_recorded"] == clean_steps and st["job"]["ranks_reporting"] == 2


@pytest.mark.multiproc
def test_wrongly_typed_manifest_and_meta_fields_are_problems_not_tracebacks(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    edit_json(run / "manifest.json", schema_version="1", world_size="abc", mesh="dp2")
    meta = run / "ranks/rank-00001/meta.json"
    edit_json(meta, world_size="abc", mesh="dp2", coords=[0, 1, 0], probes_off=5,
              run_info={"tokens_per_step": "lots", "layers": 2})
    res, s = analyze(tmp_path, run)
    res.bounded()
    assert res.rc == 0 and not s["errors"], s["errors"]
    for where, field in ((run / "manifest.json", "world_size"), (run / "manifest.json", "mesh"),
                         (meta, "world_size"), (meta, "mesh"), (meta, "coords"),
                         (meta, "probes_off"), (meta, "tokens_per_step")):
        assert len(problems_with(s, str(where), f'"{field}"', "expected")) == 1, (where, field)
    assert problems_with(s, "schema_version", "read as 1")
    assert s["run"]["world_size"] == 2 and s["run"]["mesh"] == {"dp": 1, "pp": 2, "tp": 1}
    res = cli(tmp_path, "hang", run).bounded()
    assert res.rc == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("version", ["3", 99, "abc"])  # "3": newer than schema 2, given as a string
def test_newer_or_unreadable_schema_is_refused_with_exit_2(small_run, tmp_path, version):
    run = copy_run(small_run, tmp_path / "run")
    edit_json(run / "manifest.json", schema_version=version)
    for args in (("analyze", run, "--no-report"), ("hang", run), ("compare", small_run, run)):
        res = cli(tmp_path, *args).bounded()
        assert res.rc == 2, (args[0], res.rc, res.stderr)
        assert f"schema_version {version if version != 'abc' else repr(version)}" in res.stderr, res.stderr


@pytest.mark.multiproc
def test_unreadable_directories_are_problems(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run", traces=True)
    blocked = [run / "ranks/rank-00001", run / "profiler"]
    for p in blocked:
        p.chmod(0)
    try:
        drop = os.geteuid() == 0
        res, s = analyze(tmp_path, run, drop_dac=drop)
        res.bounded()
        if s is not None and not problems_with(s, "cannot"):
            pytest.skip("permissions do not bite for this user")
        assert res.rc == 0
        assert len(problems_with(s, "rank-00001", "cannot read (permission denied)")) == 1
        assert len(problems_with(s, "profiler", "cannot list")) == 1
        assert s["run"]["partial"]["missing_ranks"] == [1]
        assert s["metrics"]["step_time"]["job"]["partial"]["ranks_reporting"] == 1
        res = cli(tmp_path, "hang", run, drop_dac=drop).bounded()
        assert res.rc == 0
        (run / "ranks").chmod(0)
        res, s = analyze(tmp_path, run, drop_dac=drop)
        res.bounded()
        assert problems_with(s, "ranks", "cannot list") and s["run"]["partial"]["missing_count"] == 2
    finally:
        for p in [run / "ranks", *blocked]:
            p.chmod(0o755)


@pytest.mark.multiproc
def test_a_missing_rank_is_loud_and_job_figures_are_partial_or_withheld(small_run, tmp_path):
    run = copy_run(small_run, tmp_path / "run", traces=True)
    shutil.rmtree(run / "ranks/rank-00001")
    (run / "profiler/rank-00001.pt.trace.json.gz").unlink()
    res = cli(tmp_path, "analyze", run, "--no-report").bounded()
    assert res.rc == 0 and "partial run: 1 of 2 ranks have files (missing: 1)" in res.stdout
    assert "MFU: withheld" in res.stdout and "pipeline bubble: withheld" in res.stdout
    s = json.loads((run / "summary.json").read_text())
    assert len(problems_with(s, "1 of 2 rank(s) have no readable files", "rank-00001")) == 1
    assert s["run"]["partial"] == {"world_size": 2, "ranks_present": 1, "missing_ranks": [1],
                                   "missing_count": 1}
    assert s["metrics"]["step_time"]["job"]["partial"]["ranks_reporting"] == 1
    job = s["metrics"]["roofline"]["job"]
    assert "mfu" not in job and "1 of 2 ranks" in job["withheld"]
    pm = s["metrics"]["pipeline"]
    assert pm["bubble_fraction"] is None and "1 of 2 ranks" in pm["withheld"]
    assert not [f for f in s["findings"] if f["kind"] == "pipeline_bubble"]


@pytest.mark.multiproc
def test_input_strings_reach_the_terminal_as_text(small_run, tmp_path):
    evil = "\x1b]0;pwned\x07\x1b[2J[/x][bold]"
    run = copy_run(small_run, tmp_path / f"run{evil[:4]}x")
    res = cli(tmp_path, "analyze", run, "--no-report").bounded()
    assert res.rc == 0 and "\x1b" not in res.stdout and "\\x1b]0;x" in res.stdout


