"""The report and the terminal lead with "What to change first" (reports/actions.py): each fix
with its saving, evidence sentence and links; a per-step breakdown chart; evidence as sentences."""

from __future__ import annotations

import io

from trainprof.reports.actions import breakdown, evidence_sentences, terminal_lines
from trainprof.reports.html import render_html

EST = {"step_ms_before": 108.4, "step_ms_after": 68.3, "saving_ms": 40.1, "saving_fraction": 0.37,
       "model": "lockstep replay", "assumptions": ["the straggler runs as its peers do"],
       "basis": "job step"}


def _summary(gpu_overview: bool = False) -> dict:
    f = {"kind": "straggler", "severity": "warning", "ranks": [1], "analyzer": "stragglers",
         "message": "rank 1 is a chronic straggler: 104 ms of its own time; more", "fix": "remove it",
         "estimate": EST, "evidence": {"sync_fraction": {"0": 0.299, "1": 0.1}, "excess_ms": 40.0}}
    m = {"stragglers": {"steps": [1, 2], "busy_ms_by_rank": {"0": [60.0, 61.0], "1": [100.0, 101.0]},
                        "data_ms_by_rank": {"0": [0.0, 0.0], "1": [0.0, 2.0]},
                        "wait_ms_by_rank": {"0": [41.0, 42.0], "1": [1.0, 1.0]}}}
    if gpu_overview:
        m["gpu_overview"] = {"per_step": [{"step": 3, "kernel_ms": 5.0, "memcpy_ms": 1.0, "dataloader_ms": 4.0,
                                           "cpu_exec_ms": 2.0, "other_ms": 0.5}]}
    return {"run": {"world_size": 2}, "metrics": m, "findings": [f],
            "actions": [{"finding": 0, "kind": "straggler", "fix": "remove it", "saving_ms": 40.1,
                         "saving_fraction": 0.37, "step_ms_before": 108.4, "step_ms_after": 68.3,
                         "evidence": "rank 1 is a chronic straggler: 104 ms of its own time",
                         "section": "s-stragglers"}]}


def test_report_leads_with_the_actions_and_a_breakdown():
    html = render_html(_summary())
    lead = html.index("What to change first")
    assert lead < html.index("Findings (")
    assert "saves ≈ 40.1 ms/step (37.0 %): 108 ms → 68.3 ms" in html
    assert 'href="#f-0"' in html and 'id="f-0"' in html and 'href="#s-stragglers"' in html
    assert "Step breakdown (each step, the rank the others wait for)" in html and "<svg" in html
    # evidence as sentences: the per-rank map is written out, not a raw dictionary
    assert "sync fraction: rank 0 29.9 %, rank 1 10.0 %." in html
    assert "Estimated gain:" in html and "lockstep replay" in html


def test_breakdown_prefers_the_gpu_overview_and_the_rank_waited_for():
    b = breakdown(_summary(gpu_overview=True))
    assert b["steps"] == ["3"] and [p[0] for p in b["parts"]] == ["kernel", "memcpy", "data loading",
                                                                  "CPU exec", "other"]
    assert b["values"] == [[5.0, 1.0, 4.0, 2.0, 0.5]]
    b = breakdown(_summary())
    assert b["values"] == [[100.0, 0.0, 1.0], [101.0, 2.0, 1.0]]  # rank 1 each step


def test_terminal_lines_and_sentences():
    lines = terminal_lines(_summary())
    assert lines[0] == "What to change first:"
    assert lines[1].startswith("  1. remove it — saves ≈ 40.1 ms/step (37.0 %)")
    assert evidence_sentences({"a_ms": 2.5, "per": {"3": 0.5}}) == ["a 2.5 ms.", "per: rank 3 0.5."]
    from rich.console import Console

    from trainprof.reports.terminal import render_terminal

    buf = io.StringIO()
    render_terminal(_summary(), console=Console(file=buf, width=200))
    out = buf.getvalue()
    assert out.index("What to change first") < out.index("1 finding(s)")


def _chromium():
    import shutil

    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_report_renders_in_headless_chromium(tmp_path):
    import subprocess

    import pytest

    exe = _chromium()
    if not exe:
        pytest.skip("no headless Chromium installed")
    from trainprof.reports.html import write_html

    page = write_html(_summary(gpu_overview=True), tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'p'}"]
    r = subprocess.run(args + ["--window-size=1280,900", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]
    dom = subprocess.run(args + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert "What to change first" in dom and "saves ≈ 40.1 ms/step" in dom and "<svg" in dom


def test_step_keyed_evidence_is_labelled_by_step_not_rank():
    # slow_steps' evidence "slow_ms" maps step -> ms: the report said "slow: rank 7 161 ms" and
    # drew a bar chart over "rank" 7, 8, 9, 10 on a 2-rank job
    from trainprof.reports.actions import rank_bars

    ev = {"slow_ms": {"7": 161.4, "8": 80.1, "9": 57.9}, "own_extra_ms": {"0": 43.2, "1": 23.0}}
    assert evidence_sentences(ev) == ["slow: step 7 161 ms, step 8 80.1 ms, step 9 57.9 ms.",
                                      "own extra: rank 0 43.2 ms, rank 1 23.0 ms."]
    svg = rank_bars(ev)
    assert "step 7: 161 ms" in svg and "rank 7" not in svg and ">step<" in svg


def test_a_failed_job_leads_the_report_and_the_terminal():
    """A blocked action (analyzers/advice.py: a rank failure) before the straggler's saving: it
    says why it comes first and shows no saving."""
    s = _summary()
    s["findings"].insert(0, {"kind": "rank_failure", "severity": "error", "ranks": [0],
                             "analyzer": "hang", "message": "Rank failure: rank 0 was the first to fail",
                             "fix": "read the failed rank's error", "evidence": {}})
    s["actions"][0]["finding"] = 1
    s["actions"].insert(0, {"finding": 0, "kind": "rank_failure", "severity": "error",
                            "fix": "read the failed rank's error", "saving_ms": None,
                            "saving_fraction": None, "step_ms_before": None, "step_ms_after": None,
                            "blocked": "the job did not finish",
                            "evidence": "Rank failure: rank 0 was the first to fail", "section": "s-hang"})
    html = render_html(s)
    lead = html[html.index("What to change first"):html.index("Findings (")]
    first = lead.index("read the failed rank&#x27;s error")
    assert first < lead.index("remove it")
    assert ('<span class="blocked">error: the job did not finish; fix this before any speed-up'
            '</span>') in lead
    assert lead.count("saves ≈") == 1 and "saves ≈ –" not in lead and "None" not in lead
    lines = terminal_lines(s)
    assert lines[1] == ("  1. read the failed rank's error — error: the job did not finish; fix "
                        "this before any speed-up")
    assert lines[2] == "     rank_failure: Rank failure: rank 0 was the first to fail"
    assert lines[3].startswith("  2. remove it — saves ≈ 40.1 ms/step")
