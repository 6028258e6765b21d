"""`trainprof compare` as a CI gate: exit codes, several runs per side, the baseline history,
inputs it cannot trust, markdown / JUnit / JSON output.

Hand-built summary.json files give ground truth by construction; tests/fixtures/compare/ holds
trimmed summaries of real runs of the reference job (4 ranks, dp=2 pp=2, 14 steps,
--profile-steps none; benchmarks/bench_gate_calibration.py `record` then `fixtures`, the first
runs of each kind of one pool): base-00..07 clean, slow50-00..07 with a 50 ms straggler on rank 1
recorded interleaved with them (step time +44 %, throughput -30 %: run-to-run noise on the shared
2-core machine is about 20 %, so smaller slowdowns need more runs than a test should hold),
prof-00 clean with the profiler window, short-00 a 3-step run. No job runs here."""

from __future__ import annotations

import paths
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from helpers import run_cli

FIXTURES = paths.FIXTURES / "compare"


def fixtures(prefix):
    return sorted(FIXTURES.glob(f"{prefix}-*.json"))


def summary(step_ms, tokens=2048, mem=None, run=None, extra=None):
    s = {"schema_version": 1,
         "run": {"world_size": 2, "mesh": {"dp": 2, "pp": 1, "tp": 1}, "device": "cpu",
                 "torch_version": "2.13.0+cpu", "exit_code": 0, **(run or {})},
         "metrics": {"step_time": {"job": {"tokens_per_step": tokens, "median_ms": float(np.median(step_ms))},
                                   "per_step": [{"step": i + 1, "max_ms": float(v)} for i, v in enumerate(step_ms)]}},
         "findings": []}
    if mem:
        s["metrics"]["memory"] = {"per_rank": [{"rank": r, "peak_rss_bytes": v} for r, v in enumerate(mem)]}
    for k, v in (extra or {}).items():
        s["metrics"][k] = v
    return s


def steps(median, n=12, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    return list(median * (1 + noise * rng.standard_normal(n)))


def write(tmp_path, name, s):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(s))
    return p


def side(tmp_path, prefix, median, k=3, between=0.02, seed=0, **kw):
    """k summaries whose levels differ by `between` (relative SD) from run to run."""
    rng = np.random.default_rng(seed)
    return [write(tmp_path, f"{prefix}{i}.json",
                  summary(steps(median * np.exp(between * rng.standard_normal()), seed=seed * 100 + i), **kw))
            for i in range(k)]


def compare(*args):
    return run_cli(["compare", *args], timeout=120)


def metrics_of(proc) -> dict:
    return {m["metric"]: m for m in json.loads(proc.stdout)["metrics"]}


# --- one run per side ---------------------------------------------------------------------------

def test_identical_runs_pass(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100), mem=[1e9, 1e9]))
    proc = compare(b, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "step_time" in proc.stdout
    assert "baseline: 1 run (12 analysed steps) · candidate: 1 run (12 analysed steps)" in proc.stdout


def test_one_run_per_side_slowdown_is_inconclusive_never_a_regression(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100)))
    c = write(tmp_path, "c.json", summary(steps(135, seed=1)))
    proc = compare(b, c)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "INCONCLUSIVE: step_time" in proc.stdout and "runs differ" in proc.stdout
    assert "one run per side cannot tell a code change from run-to-run noise" in proc.stdout.replace("\n", " ")


def test_noise_and_small_shift_pass(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100, noise=0.03)))
    c = write(tmp_path, "c.json", summary(steps(102, noise=0.03, seed=7)))
    assert compare(b, c).returncode == 0


def test_three_steps_each_is_inconclusive(tmp_path):
    b = write(tmp_path, "b.json", summary([100, 101, 99]))
    c = write(tmp_path, "c.json", summary([150, 151, 149]))
    proc = compare(b, c)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "insufficient data" in proc.stdout


# --- several runs per side -------------------------------------------------------------------------

def test_several_runs_per_side_slowdown_is_a_regression(tmp_path):
    bases = side(tmp_path, "b", 100)
    cands = side(tmp_path, "c", 130, seed=1)
    proc = compare(*bases, "--", *cands, "--json")  # options may follow the candidates
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    st = {m["metric"]: m for m in res["metrics"]}["step_time"]
    assert st["verdict"] == "regression" and st["test"] == "t over runs" and st["runs"] == [3, 3]
    assert res["baseline"]["runs"] == 3 and res["baseline"]["steps"] == [12, 12, 12]
    assert res["candidate"]["paths"] == [str(c) for c in cands]
    text = compare(*bases, "--", *cands)
    assert "REGRESSION in step_time" in text.stdout
    assert "baseline: 3 runs (12 analysed steps each) · candidate: 3 runs (12 analysed steps each)" in text.stdout


def test_run_to_run_noise_is_not_a_regression(tmp_path):
    # tight steps, 15 % between runs: one run each would look different, three each do not
    bases = side(tmp_path, "b", 100, between=0.15, seed=2)
    cands = side(tmp_path, "c", 100, between=0.15, seed=3)
    proc = compare(*bases, "--", *cands)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_directories_of_runs(tmp_path):
    for i, p in enumerate(side(tmp_path, "b", 100)):
        write(tmp_path / "main" / f"run{i}", "summary.json", json.loads(p.read_text()))
    for i, p in enumerate(side(tmp_path, "c", 130, seed=1)):
        write(tmp_path / "pr" / f"run{i}", "summary.json", json.loads(p.read_text()))
    proc = compare(tmp_path / "main", tmp_path / "pr", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    assert res["baseline"]["runs"] == 3 and res["candidate"]["runs"] == 3


def test_usage_errors_for_run_lists(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100)))
    for args in ([b, b, b], [b, "--"], ["--", b], [b]):
        proc = compare(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr


# --- inputs it cannot trust: exit 2, one line naming the file ------------------------------------------

@pytest.mark.parametrize("content,expect", [
    (None, "no such file or directory"),
    ("{not json", "not valid JSON (line 1"),
    ("[1, 2]", "not a trainprof summary.json"),
    ('{"schema_version": 1, "run": {}}', "no 'metrics' object"),
    ('{"schema_version": 99, "run": {}, "metrics": {}}', "newer than this trainprof"),
    ('{"schema_version": "2", "run": {}, "metrics": {}}', "schema_version '2' is not one"),
    ('{"schema_version": true, "run": {}, "metrics": {}}', "schema_version True is not one"),
    ('{"run": {}, "metrics": {}}', "schema_version None is not one"),
    ('{"schema_version": 1, "run": {}, "metrics": {"step_time": {"per_step": [{"max_ms": "1"}, 5]}}}',
     "malformed summary.json"),
    ('{"schema_version": 1, "run": {}, "metrics": {"pipeline": {"bubble_fraction_by_step": []}, '
     '"memory": {"per_rank": [{"rank": 0, "peak_rss_bytes": "x"}]}, "step_time": "fast"}}', "malformed"),
])
def test_bad_inputs_exit_2_naming_the_file(tmp_path, content, expect):
    good = write(tmp_path, "good.json", summary(steps(100)))
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    proc = compare(good, bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(bad) in proc.stderr and expect in proc.stderr and "candidate" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_directory_with_an_unknown_schema_exits_2(tmp_path):
    good = write(tmp_path, "good.json", summary(steps(100)))
    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"schema_version": "2", "command": ["x"]}))
    proc = compare(good, run)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(run) in proc.stderr and "candidate" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_directory_that_is_not_a_run_exits_2(tmp_path):
    good = write(tmp_path, "good.json", summary(steps(100)))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = compare(empty, good)
    assert proc.returncode == 2 and str(empty) in proc.stderr and "baseline" in proc.stderr


def test_run_directory_uses_its_summary(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary(steps(100))))
    c = write(tmp_path, "c.json", summary(steps(150, seed=3)))
    proc = compare(run, c, "--json")
    assert proc.returncode == 3 and metrics_of(proc)["step_time"]["ratio"] > 1.4


def test_bad_threshold_and_alpha_are_usage_errors(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100)))
    for args in (["--fail-on", "step_time"], ["--fail-on", "step_time:+5 parsecs"], ["--alpha", "2"]):
        proc = compare(b, b, *args)
        assert proc.returncode == 2, (args, proc.stderr)


# --- environments ----------------------------------------------------------------------------------

def test_world_size_mismatch_is_refused_naming_the_field(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100)))
    c = write(tmp_path, "c.json", summary(steps(100), run={"world_size": 4}))
    proc = compare(b, c)
    assert proc.returncode == 2
    assert "world_size: baseline 2, candidate 4" in proc.stderr
    ok = compare(b, c, "--allow-mismatch")
    assert ok.returncode == 0 and "environments differ" in ok.stdout


def test_other_fingerprint_fields_are_checked(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100)))
    c = write(tmp_path, "c.json", summary(steps(100), run={"mesh": {"dp": 1, "pp": 1, "tp": 2},
                                                           "torch_version": "2.12.0"}))
    proc = compare(b, c)
    assert proc.returncode == 2 and "mesh:" in proc.stderr and "torch_version:" in proc.stderr
    assert "device" not in proc.stderr.split("anyway")[1]


def test_mismatch_within_a_side_names_the_run(tmp_path):
    b1, b2 = side(tmp_path, "b", 100, k=2)
    b3 = write(tmp_path, "b3.json", summary(steps(100), run={"device": "NVIDIA H100"}))
    proc = compare(b1, b2, "--", b3)
    assert proc.returncode == 2 and f"candidate {b3}" in proc.stderr


# --- metrics and thresholds ------------------------------------------------------------------------

def test_fail_on_peak_memory_threshold(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100), mem=[1.00e9, 1.00e9]))
    c = write(tmp_path, "c.json", summary(steps(100, seed=1), mem=[1.00e9, 1.03e9]))
    assert compare(b, c).returncode == 0  # informational by default
    proc = compare(b, c, "--fail-on", "peak_memory:+2%")
    assert proc.returncode == 1 and "REGRESSION in peak_memory" in proc.stdout
    assert "rank 1" in proc.stdout


def test_single_valued_metrics_never_gate_by_default(tmp_path):
    extra_b = {"roofline": {"mfu": 0.40}, "comm_compute": {"exposed_comm_fraction": 0.10},
               "pipeline": {"bubble_fraction": 0.30}}
    extra_c = {"roofline": {"mfu": 0.20}, "comm_compute": {"exposed_comm_fraction": 0.50},
               "pipeline": {"bubble_fraction": 0.70}}
    b = write(tmp_path, "b.json", summary(steps(100), mem=[1e9, 1e9], extra=extra_b))
    c = write(tmp_path, "c.json", summary(steps(100, seed=1), mem=[1e9, 3e9], extra=extra_c))
    proc = compare(b, c, "--json")
    assert proc.returncode == 0, proc.stdout
    by = metrics_of(proc)
    for name in ("mfu", "exposed_comm", "bubble", "peak_memory"):
        assert by[name]["gate"] is False and by[name]["moved"] == "regression", by[name]
    assert "worse (not gated)" in compare(b, c).stdout
    assert compare(b, c, "--fail-on", "mfu:-5%").returncode == 1  # on request they gate
    assert compare(b, c, "--fail-on", "bubble:+5pp").returncode == 1
    assert compare(c, b, "--fail-on", "mfu:-5%").returncode == 0  # MFU up is an improvement


def test_gated_metric_missing_on_one_side_is_inconclusive(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100), extra={"roofline": {"mfu": 0.40}}))
    none = write(tmp_path, "n.json", summary(steps(100, seed=2)))
    assert compare(b, none).returncode == 0  # not gated: shown as missing
    proc = compare(b, none, "--fail-on", "mfu:-5%")
    assert proc.returncode == 3 and "not in candidate" in proc.stdout


def test_config_file(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100), mem=[1.00e9]))
    c = write(tmp_path, "c.json", summary(steps(104, seed=1), mem=[1.03e9]))
    cfg = tmp_path / "gate.toml"
    cfg.write_text('[compare]\nalpha = 0.01\nmin_effect = "3%"\n[compare.fail_on]\npeak_memory = "+2%"\n')
    proc = compare(b, c, "--config", cfg, "--json")
    assert proc.returncode == 1
    res = json.loads(proc.stdout)
    assert res["settings"]["min_effect"] == 0.03 and res["settings"]["thresholds"] == {"peak_memory": "+2%"}
    by = {m["metric"]: m for m in res["metrics"]}
    assert by["peak_memory"]["verdict"] == "regression"
    bad = tmp_path / "bad.toml"
    bad.write_text("alpha = 0.01\nfail_onn = 3\n")
    proc = compare(b, c, "--config", bad)
    assert proc.returncode == 2 and "fail_onn" in proc.stderr


def test_custom_metric_paths(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100), extra={"custom": {"x": 10.0, "xs": steps(5)}}))
    c = write(tmp_path, "c.json", summary(steps(100, seed=1), extra={"custom": {"x": 12.0, "xs": steps(5, seed=2)}}))
    proc = compare(b, c, "--metric", "metrics.custom.x", "--metric", "metrics.custom.xs", "--json")
    assert proc.returncode == 0
    by = metrics_of(proc)
    assert by["metrics.custom.x"]["gate"] is False and by["metrics.custom.xs"]["kind"] == "sampled"
    assert compare(b, c, "--fail-on", "metrics.custom.x:+10%").returncode == 1
    proc = compare(b, c, "--fail-on", "metrics.nope:+10%")
    assert proc.returncode == 2 and "metrics.nope" in proc.stderr


def test_markdown_and_junit(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100), mem=[1e9]))
    c = write(tmp_path, "c.json", summary(steps(135, seed=1), mem=[1e9]))
    write(tmp_path, "c2.json", summary(steps(136, seed=2), mem=[1e9]))
    md, xml = tmp_path / "out" / "compare.md", tmp_path / "out" / "compare.xml"
    b2 = write(tmp_path, "b2.json", summary(steps(101, seed=3), mem=[1e9]))
    proc = compare(b, b2, "--", c, tmp_path / "c2.json", "--markdown", md, "--junit", xml,
                   "--fail-on", "peak_memory:+5%")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = md.read_text()
    assert "| Change | Before | After | Ratio | 95% CI | p | n | Metric | Verdict |" in text
    assert "2 runs (12 analysed steps each)" in text
    rows = {line.split("|")[8].split("`")[1]: line.split("|")[1].strip() for line in text.splitlines()
            if line.startswith("| ") and "`" in line}
    assert rows == {"step_time": "+", "throughput": "+", "peak_memory": ""}
    suite = ET.parse(xml).getroot().find("testsuite")
    cases = {tc.get("name"): tc for tc in suite.iter("testcase")}
    assert set(cases) == {"step_time", "throughput", "peak_memory"}
    assert cases["step_time"].find("failure") is not None
    assert cases["peak_memory"].find("failure") is None
    assert suite.get("failures") == "2" and suite.get("tests") == "3"
    compare(c, tmp_path / "c2.json", "--", b, b2, "--markdown", md)  # improvements are marked "-"
    assert "| - |" in md.read_text()


def test_json_is_the_only_stdout(tmp_path):
    b = write(tmp_path, "b.json", summary(steps(100)))
    proc = compare(b, b, "--json")
    res = json.loads(proc.stdout)
    assert res["exit_code"] == 0 == proc.returncode and res["verdict"] == "pass"
    st = res["metrics"][0]
    assert st["metric"] == "step_time" and st["n"] == [12, 12] and st["ci"][0] <= 1 <= st["ci"][1]
    assert res["settings"]["multiple_comparisons"] == "benjamini-hochberg"


# --- baseline history ------------------------------------------------------------------------------

def test_baseline_dir_history(tmp_path):
    hist = tmp_path / "history"
    mains = side(tmp_path, "main", 100, k=4, seed=4)
    # a cold cache: nothing to compare with
    pr = side(tmp_path, "pr", 100, k=1, seed=5)[0]
    proc = compare("--baseline-dir", hist, pr)
    assert proc.returncode == 3 and "no usable baseline run" in proc.stdout
    # the main-branch job stores its runs, keeping the newest --keep
    first = compare("--baseline-dir", hist, "--save-baseline", "--keep", "3", mains[0])
    assert first.returncode == 0 and "stored 1 run" in first.stdout
    (hist / "notes.txt").write_text("not ours")  # never deleted
    for m in mains[1:]:
        proc = compare("--baseline-dir", hist, "--save-baseline", "--keep", "3", m)
        assert proc.returncode in (0, 3), proc.stdout + proc.stderr
    stored = sorted(hist.glob("baseline-*.json"))
    assert len(stored) == 3 and (hist / "notes.txt").exists()
    assert json.loads(stored[-1].read_text()) == json.loads(mains[-1].read_text())
    # a pull request: compared with the history's distribution
    proc = compare("--baseline-dir", hist, pr, "--json")
    assert proc.returncode == 0, proc.stdout
    res = json.loads(proc.stdout)
    assert res["baseline"]["runs"] == 3 and res["baseline"]["path"] == str(hist)
    assert metrics_of(proc)["step_time"]["test"] == "t over runs"
    slow = side(tmp_path, "slow", 140, k=2, seed=6)
    proc = compare("--baseline-dir", hist, slow[0])  # one candidate run: it differs, that is all
    assert proc.returncode == 3 and "a single candidate run" in proc.stdout
    proc = compare("--baseline-dir", hist, *slow)
    assert proc.returncode == 1 and "REGRESSION in step_time" in proc.stdout, proc.stdout
    # runs that cannot be trusted are not stored; other environments are left out when reading
    short = write(tmp_path, "short.json", summary([100, 101, 99]))
    proc = compare("--baseline-dir", hist, "--save-baseline", short)
    assert proc.returncode == 3 and len(list(hist.glob("baseline-*.json"))) == 3
    gpu = write(tmp_path, "gpu.json", summary(steps(100), run={"device": "NVIDIA H100"}))
    proc = compare("--baseline-dir", hist, gpu)
    assert proc.returncode == 2 and "no run from the candidate's environment" in proc.stderr
    proc = compare("--baseline-dir", hist, pr, "--", pr)
    assert proc.returncode == 2


# --- recorded runs of the reference job ----------------------------------------------------------

def test_fixtures_exist_and_are_small():
    files = list(FIXTURES.glob("*.json"))
    assert len(fixtures("base")) == 8 and len(fixtures("slow50")) == 8 and fixtures("short")
    assert sum(f.stat().st_size for f in files) < 200_000


def test_recorded_a_a_several_runs_per_side_passes():
    base = fixtures("base")
    half = len(base) // 2
    proc = compare(*base[:half], "--", *base[half:2 * half], "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    assert res["baseline"]["runs"] == half and res["baseline"]["steps"] == [13] * half


def test_recorded_a_a_two_runs_against_the_others_as_history():
    from trainprof.gate.regression import Settings, compare_runs
    from trainprof.gate.verdict import overall_verdict

    base = [json.loads(p.read_text()) for p in fixtures("base")]
    for i in range(len(base) - 1):  # in process: the CLI's decision code, without a process per case
        cands = base[i:i + 2]
        history = base[:i] + base[i + 2:]
        results, _ = compare_runs(history, cands, Settings())
        assert overall_verdict(results) == (0, "pass"), (i, [r.to_dict() for r in results])


def test_recorded_slowdown_is_a_regression_naming_step_time():
    base, slow = fixtures("base"), fixtures("slow50")
    proc = compare(*base, "--", *slow, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    by = metrics_of(proc)
    assert by["step_time"]["verdict"] == "regression" and by["step_time"]["test"] == "t over runs"
    assert 1.3 < by["step_time"]["ratio"] < 1.6 and by["step_time"]["ci"][0] > 1.1
    assert by["throughput"]["verdict"] == "regression" and by["throughput"]["change"] < -0.25
    assert by["cpu_time"]["verdict"] == "regression" and by["cpu_time"]["ratio"] > 1.5
    text = compare(*base, "--", *slow)
    assert "REGRESSION in step_time, throughput, mfu, cpu_time" in text.stdout
    assert "baseline: 8 runs (13 analysed steps each) · candidate: 8 runs (13 analysed steps each)" in text.stdout
    # one run per side: the same slowdown only says that the two runs differ
    one = compare(base[0], slow[0])
    assert one.returncode in (0, 3) and "REGRESSION" not in one.stdout


def test_recorded_three_step_candidate_is_inconclusive_for_every_metric():
    proc = compare(*fixtures("base")[:3], "--", fixtures("short")[0], "--json",
                   "--fail-on", "peak_memory:+1%", "--fail-on", "bubble:+1pp")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    by = metrics_of(proc)
    assert {"step_time", "throughput", "mfu", "bubble", "peak_memory"} <= set(by)
    assert all(m["verdict"] == "insufficient data" for m in by.values()), by
    assert all("analysed steps (need ≥6)" in m["detail"] for m in by.values())


def test_recorded_profiled_window_missing_on_one_side():
    prof, base = fixtures("prof"), fixtures("base")
    proc = compare(prof[0], base[0], "--json")
    by = metrics_of(proc)
    assert by["exposed_comm"]["verdict"] == "missing" and by["exposed_comm"]["gate"] is False
    assert proc.returncode in (0, 3)
    proc = compare(prof[0], base[0], "--fail-on", "exposed_comm:+5pp")
    assert proc.returncode == 3 and "not in candidate" in proc.stdout


def test_recorded_slowdown_three_runs_per_side_is_found_by_cpu_time():
    """The straggler's extra work per step shows in the busiest rank's CPU time, which the
    machine's run-to-run noise barely moves: 3 runs per side suffice where step time does not."""
    from trainprof.gate.regression import Settings, compare_runs
    from trainprof.gate.verdict import overall_verdict

    base = [json.loads(p.read_text()) for p in fixtures("base")]
    slow = [json.loads(p.read_text()) for p in fixtures("slow50")]
    for i in range(len(base) - 2):
        results, _ = compare_runs(base[i:i + 3], slow[i:i + 3], Settings())
        by = {r.metric: r for r in results}
        assert overall_verdict(results)[0] == 1 and by["cpu_time"].verdict == "regression", i
        assert by["cpu_time"].ci[0] > 1.3 and by["cpu_time"].runs == [3, 3]


def test_recorded_a_a_every_four_against_four_passes():
    from itertools import combinations

    from trainprof.gate.regression import Settings, compare_runs
    from trainprof.gate.verdict import overall_verdict

    base = [json.loads(p.read_text()) for p in fixtures("base")]
    for pick in combinations(range(1, 8), 3):  # every split of the 8 runs into two halves once
        a = [0, *pick]
        results, _ = compare_runs([base[i] for i in a], [base[i] for i in range(8) if i not in a], Settings())
        assert overall_verdict(results) == (0, "pass"), (a, [r.to_dict() for r in results])


# --- underpowered comparisons and different jobs --------------------------------------------------

def _levels(tmp_path, prefix, levels, **kw):
    return [write(tmp_path, f"{prefix}{i}.json", summary(steps(v, seed=i), **kw)) for i, v in enumerate(levels)]


def test_large_change_not_significant_is_not_a_clean_pass(tmp_path):
    """3 candidate vs 6 baseline runs, +30 % at ±15 % run-to-run noise: not significant, and the
    verdict line says so (exit 0 with a warning, docs/ci-gate.md); 6 vs 6 finds it."""
    bases = _levels(tmp_path, "b", [100, 80, 125, 95, 110, 90])
    cands = _levels(tmp_path, "c", [130, 105, 160])
    proc = compare(*bases, "--", *cands)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    text = " ".join(proc.stdout.split())
    assert "PASS: no regression" not in text
    assert text.count("PASS (inconclusive): step_time +") == 1
    assert "not significant with 3 candidate vs 6 baseline runs (p=" in text
    assert "the smallest change this gate can detect at this noise is ~" in text and "add runs" in text
    assert last.endswith("(exit 0)")
    res = json.loads(compare(*bases, "--", *cands, "--json").stdout)
    assert res["verdict"] == "pass" and res["underpowered"] == ["step_time"]
    st = {m["metric"]: m for m in res["metrics"]}["step_time"]
    assert st["underpowered"] and st["mde"] > st["change"] > 0.25
    # a change well above what the gate can detect at this noise is a regression, no warning
    more = _levels(tmp_path, "d", [v * 1.8 for v in (100, 80, 125, 95, 110, 90)])
    proc = compare(*bases, "--", *more)
    assert proc.returncode == 1 and "inconclusive" not in proc.stdout, proc.stdout


def test_runs_of_different_jobs_are_refused(tmp_path):
    pl = {"command": ["torchrun", "--nproc-per-node", "2", "pl_tiny.py"],
          "run_info": {"framework": "lightning", "n_params_non_embedding": 4740, "global_batch": 64}}
    hf = {"command": ["torchrun", "--nproc-per-node", "2", "hf_gpt2.py"],
          "run_info": {"framework": "transformers", "n_params_non_embedding": 100096, "global_batch": 16}}
    b = write(tmp_path, "pl.json", summary(steps(100), run=pl))
    c = write(tmp_path, "hf.json", summary(steps(100), run=hf))
    proc = compare(b, c)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "runs of different jobs" in proc.stderr and "--allow-different" in proc.stderr
    for line in ("script: baseline 'pl_tiny.py', candidate 'hf_gpt2.py'",
                 "framework: baseline 'lightning', candidate 'transformers'",
                 "model parameters (non-embedding): baseline 4740, candidate 100096",
                 "global batch: baseline 64, candidate 16"):
        assert line in proc.stderr
    ok = compare(b, c, "--allow-different")
    assert ok.returncode == 0 and "different jobs (allowed)" in ok.stdout
    # the same job, facts known on one side only (an older summary): compared as usual
    old = write(tmp_path, "old.json", summary(steps(100), run={"mesh": {}}))
    assert compare(old, b).returncode == 0


def test_baseline_history_leaves_out_other_jobs(tmp_path):
    hist = tmp_path / "history"
    job = {"command": ["python", "train.py"], "run_info": {"framework": "lightning"}}
    for p in side(tmp_path, "main", 100, k=3, seed=4, run=job):
        assert compare("--baseline-dir", hist, "--save-baseline", p).returncode in (0, 3)
    other = write(tmp_path, "other.json", summary(steps(100), run={**job, "command": ["python", "eval.py"]}))
    proc = compare("--baseline-dir", hist, other)
    assert proc.returncode == 2 and "no run of the candidate's job" in proc.stderr
    assert compare("--baseline-dir", hist, other, "--allow-different").returncode == 0


def test_a_run_without_any_rank_data_is_said_as_such(tmp_path):
    # a baseline wrapped with TRAINPROF_DISABLE=1: no rank wrote anything; its missing device,
    # world size and torch version are no "different environment"
    empty = {"schema_version": 1, "run": {"world_size": 0, "ranks": [], "device": None,
                                          "torch_version": None, "exit_code": 0},
             "metrics": {}, "findings": []}
    b = write(tmp_path, "b.json", empty)
    c = write(tmp_path, "c.json", summary(steps(100)))
    p = compare(str(b), "--", str(c))
    assert p.returncode == 2, p
    assert "holding no data from any rank" in p.stderr and "baseline" in p.stderr and "b.json" in p.stderr
    assert "different environments" not in p.stderr
