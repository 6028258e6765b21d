"""Hostile and unlucky inputs, round 3: every case asserts the outcome (exit code, the problem
line naming the file, the user's file untouched). Run directories are copies of the real 4-rank
run in tests/fixtures/scale/dp4-run.tar.gz (its streams; the profiler trace left out for speed)
broken the way a full disk, a killed writer or an attacker breaks them; no job is started.
Bounded time is measured by benchmarks/bench_linear_inputs.py, not here."""

from __future__ import annotations

import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from paths import FIXTURES

from helpers import TRAINPROF, run_cli

DP4 = FIXTURES / "scale" / "dp4-run.tar.gz"


@pytest.fixture(scope="module")
def dp4(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dp4")
    with tarfile.open(DP4) as tf:
        tf.extractall(root, filter="data")
    run = next(p.parent for p in root.rglob("manifest.json"))
    shutil.rmtree(run / "profiler", ignore_errors=True)
    man = json.loads((run / "manifest.json").read_text())
    for r in range(4):  # no trace kept: the ranks did not record one (not "lost traces")
        meta = run / "ranks" / f"rank-{r:05d}" / "meta.json"
        m = json.loads(meta.read_text())
        m.pop("profiled", None)
        m["profile_steps"] = None
        meta.write_text(json.dumps(m))
    (run / "manifest.json").write_text(json.dumps(man))
    return run


def copy(dp4: Path, dst: Path) -> Path:
    shutil.copytree(dp4, dst, symlinks=True)
    return dst


def analyze(run: Path, out: Path, *extra, **kw) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = run_cli(["analyze", run, "--out", out, "--no-report", *extra], timeout=300, **kw)
    s = out / "summary.json"
    return proc, (json.loads(s.read_text()) if s.exists() else None)


def streams(run: Path, name: str) -> list[Path]:
    return sorted(run.glob(f"ranks/rank-*/{name}.jsonl"))


# -------------------------------------------------- 1. empty and torn streams


def test_every_stream_empty_is_nothing_analyzed_exit_3(dp4, tmp_path):
    run = copy(dp4, tmp_path / "run")
    for p in run.glob("ranks/rank-*/*.jsonl"):
        p.write_bytes(b"")  # the disk filled just after the ranks started
    proc, s = analyze(run, tmp_path / "out")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "nothing looks wrong" not in proc.stdout
    assert "nothing analyzed" in proc.stderr and "holds a complete record" in proc.stderr
    assert "holds a complete record" in s["nothing_analyzed"]
    empty = [p for p in s["problems"] if "steps.jsonl" in p and "empty (0 bytes)" in p]
    assert empty and str(run / "ranks" / "rank-00000" / "steps.jsonl") in empty[0]
    assert "ranks 0-3 (4 of 4)" in empty[0]


def test_only_steps_empty_lists_step_time_as_not_analyzed(dp4, tmp_path):
    run = copy(dp4, tmp_path / "run")
    for p in streams(run, "steps"):
        p.write_bytes(b"")
    proc, s = analyze(run, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    missing = {m["analysis"] for m in s["coverage"]["not_analyzed"]}
    assert {"step time", "stragglers over every step"} <= missing
    assert "not analyzed: step time" in proc.stdout  # the terminal's coverage line
    assert any("steps.jsonl" in p and "empty (0 bytes)" in p for p in s["problems"])


def test_a_torn_stream_is_a_problem_naming_the_file(dp4, tmp_path):
    run = copy(dp4, tmp_path / "run")
    p = streams(run, "collectives")[2]
    p.write_bytes(p.read_bytes() + b'{"step": 3, "pg": "0", "se')  # the writer killed mid-record
    proc, s = analyze(run, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    torn = [x for x in s["problems"] if "torn" in x]
    assert len(torn) == 1 and torn[0].startswith(str(p)) and "rank 2" in torn[0]
    clean_proc, clean = analyze(dp4, tmp_path / "clean")  # the clean run says nothing of the kind
    assert not [x for x in clean["problems"] if "torn" in x or "empty (0 bytes)" in x]


def test_a_stream_linked_outside_the_run_is_not_read(dp4, tmp_path):
    run = copy(dp4, tmp_path / "run")
    outside = tmp_path / "elsewhere.jsonl"
    victim = run / "ranks" / "rank-00001" / "steps.jsonl"
    shutil.move(victim, outside)
    victim.symlink_to(outside)
    inside = run / "ranks" / "rank-00002" / "nan.jsonl"  # a link within the run is fine
    inside.unlink()
    inside.symlink_to("../rank-00000/nan.jsonl")
    proc, s = analyze(run, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    said = [p for p in s["problems"] if "outside the run directory" in p]
    assert len(said) == 1 and said[0].startswith(str(victim)) and str(outside) in said[0]
    assert 1 not in {int(r) for r in s["metrics"]["step_time"]["step_ms_by_rank"]}


# -------------------------------------------------- 2. compare: zero and extreme baselines


def summary(step_ms, mem=None, extra=None) -> dict:
    s = {"schema_version": 1,
         "run": {"world_size": 2, "mesh": {"dp": 2, "pp": 1, "tp": 1}, "device": "cpu",
                 "torch_version": "2.13.0+cpu", "exit_code": 0},
         "metrics": {"step_time": {"job": {"tokens_per_step": 2048, "median_ms": float(np.median(step_ms))},
                                   "per_step": [{"step": i + 1, "max_ms": float(v)} for i, v in enumerate(step_ms)]}},
         "findings": []}
    if mem is not None:
        s["metrics"]["memory"] = {"per_rank": [{"rank": r, "peak_rss_bytes": v} for r, v in enumerate(mem)]}
    s["metrics"].update(extra or {})
    return s


def steps(median, seed=0):
    return list(median * (1 + 0.01 * np.random.default_rng(seed).standard_normal(12)))


def write(tmp_path, name, s) -> Path:
    (tmp_path / name).write_text(json.dumps(s))
    return tmp_path / name


@pytest.mark.parametrize("base,cand,gate,code", [
    (summary(steps(100), mem=[0, 0]), summary(steps(100, 1), mem=[10e9, 10e9]), "peak_memory:+2%", 1),
    (summary(steps(100), extra={"pipeline": {"bubble_fraction": 0.0}}),
     summary(steps(100, 1), extra={"pipeline": {"bubble_fraction": 0.9}}), "bubble:+1%", 1),
    (summary([0.0] * 12), summary(steps(501)), None, 3),  # one run per side: "the runs differ"
    (summary(steps(100), mem=[-5, -5]), summary(steps(100, 1), mem=[10e9, 10e9]), "peak_memory:+2%", 2),
])
def test_a_zero_or_negative_baseline_never_passes(tmp_path, base, cand, gate, code):
    b, c = write(tmp_path, "b.json", base), write(tmp_path, "c.json", cand)
    proc = run_cli(["compare", b, c] + (["--fail-on", gate] if gate else []), timeout=120)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr


@pytest.mark.parametrize("value", [5e-324, pytest.param(1e-310, marks=pytest.mark.long),
                                   pytest.param(1e308, marks=pytest.mark.long), 1.7e308])
def test_denormal_and_huge_values_give_no_traceback_nor_warnings(tmp_path, value):
    extra = {"pipeline": {"bubble_fraction": value}, "roofline": {"mfu": value}}
    odd = summary([100.0] * 6 + [value] * 6, mem=[1e9, value], extra=extra)
    base = summary([100.0] * 12, mem=[1e9, 1e9], extra={"pipeline": {"bubble_fraction": 0.3},
                                                          "roofline": {"mfu": 0.3}})
    o, b = write(tmp_path, "o.json", odd), write(tmp_path, "b.json", base)
    for args in ([b, o], [o, b], [o, o, "--", b, b], [b, b, "--", o, o]):
        proc = run_cli(["compare", *args, "--fail-on", "peak_memory:+2%", "--fail-on", "mfu:-5%"],
                       timeout=120)
        assert proc.returncode in (0, 1, 2, 3), proc.stderr
        assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 1, proc.stderr


# -------------------------------------------------- 3. analyze --out never overwrites the user's files


def test_analyze_out_refuses_a_folder_with_the_users_files(dp4, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.json").write_text('{"my": "numbers"}')
    (out / "report.html").write_text("<html>my report</html>")
    proc = run_cli(["analyze", dp4, "--out", out], timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not empty and holds files trainprof did not write" in proc.stderr
    assert (out / "summary.json").read_text() == '{"my": "numbers"}'
    assert (out / "report.html").read_text() == "<html>my report</html>"
    (out / "summary.json").unlink()
    (out / "report.html").unlink()
    (out / "notes.txt").write_text("x")  # any file of the user's
    assert run_cli(["analyze", dp4, "--out", out], timeout=300).returncode == 2
    (out / "notes.txt").unlink()
    assert run_cli(["analyze", dp4, "--out", out], timeout=300).returncode == 0  # empty: written
    assert run_cli(["analyze", dp4, "--out", out], timeout=300).returncode == 0  # its own: again


def test_stale_temporaries_of_a_killed_analyze_are_removed(dp4, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out / f".summary.json.{dead.pid}.140000.tmp"
    old = out / ".report.html.abcd1234"
    live = out / f".summary.json.{os.getpid()}.1.tmp"  # a live writer's: kept
    for p in (stale, old, live):
        p.write_text("partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    proc, s = analyze(dp4, out)
    assert proc.returncode == 0 and s is not None
    assert not stale.exists() and not old.exists() and live.exists()


# -------------------------------------------------- 7. a full disk while analyze writes


def _fsize_limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # Python ignores SIGXFSZ: EFBIG


@pytest.mark.parametrize("as_json", [False, True])
def test_a_full_disk_while_writing_prints_the_findings_and_one_line(dp4, tmp_path, as_json):
    out = tmp_path / "out"
    proc = subprocess.run(TRAINPROF + ["analyze", str(dp4), "--out", str(out)]
                          + (["--json"] if as_json else []),
                          capture_output=True, text=True, timeout=300, preexec_fn=_fsize_limit)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not write" in lines[0] and "summary.json" in lines[0]
    if as_json:
        assert json.loads(proc.stdout)["run"]["world_size"] == 4
    else:
        assert "trainprof" in proc.stdout and "4 ranks" in proc.stdout
    assert not (out / "summary.json").exists() and not list(out.glob(".*tmp"))


# -------------------------------------------------- 8. names capped, bidi and control characters neutralised


def test_huge_and_bidi_names_are_capped_and_neutralised(tmp_path):
    def ev(name, ts, dur, cat="cpu_op"):
        return {"ph": "X", "name": name, "cat": cat, "ts": 1_000_000 + ts, "dur": dur, "pid": 1,
                "tid": 1, "args": {}}
    events = []
    for i in range(4):
        events.append(ev(f"ProfilerStep#{i}", i * 30_000, 30_000, "user_annotation"))
        events += [ev("aten::" + "A" * 1_000_000 + str(j), i * 30_000 + j * 1000, 900) for j in range(16)]
        events.append(ev("aten::evil\u202egnp.exe\x00\x1b[31m", i * 30_000 + 17_000, 5000))
    trace = tmp_path / "t.pt.trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()))
    assert trace.stat().st_size < 100_000
    out = tmp_path / "out"
    proc = run_cli(["analyze", trace, "--out", out], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.json").stat().st_size < 1_000_000  # 16 MB before the cap
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "gnp.exe" in html  # the op is in the report ...
    assert "\u202e" not in html and "\x00" not in html and "\x1b" not in html  # ... its bidi/controls not
    assert "\\u202e" in html
