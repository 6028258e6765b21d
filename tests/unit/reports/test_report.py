"""report.html and the terminal summary render summary.json faithfully, safely and offline.

Cases that run multi-process jobs: tests/integration/test_report_jobs.py."""

from __future__ import annotations

from synth import EVIL, summary_by_hand
import io
import re
import sys
import types

import pytest

from trainprof.reports import kit, svg
from trainprof.reports.html import render_html, write_html
from trainprof.reports.terminal import render_terminal
from chromium import CHROMIUM, NETWORK_REF, _chromium

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium) — cannot "
                             "prove the report renders in a real browser")


def test_everything_from_the_summary_is_escaped():
    html = render_html(summary_by_hand())
    assert "<script" not in html.lower()  # not ours (we ship none) and none of theirs
    assert html.count("&lt;script&gt;") >= 6  # dir, command, host, message, evidence, problem, error...
    assert "rank 1 (dp1 pp0 tp0)" in html  # ranks named with their mesh coordinates
    assert "30 % slower" in html and "straggler" in html


def test_findings_come_first_then_sections_in_analyzer_order_then_problems():
    html = render_html(summary_by_hand())
    pos = [html.index(x) for x in ('class="finding"', 'id="s-step_time"', 'id="s-zz_custom"',
                                   "Analysis problems")]
    assert pos == sorted(pos)
    assert html.index("Findings") < html.index("Metrics")


def test_no_network_loads_and_plots_are_inline_svg():
    html = render_html(summary_by_hand())
    assert not NETWORK_REF.search(html), NETWORK_REF.search(html).group(0)
    assert "<svg" in html and "<img" not in html
    assert "<?xml" not in html  # the SVG XML header must not land inside the HTML


def test_two_figures_on_one_page_do_not_share_ids():
    frags = []
    for _ in range(2):  # a heatmap (colour-bar gradient) and a hatched bar chart (pattern) each
        frags.append(svg.heatmap([[1.0, 2.0], [3.0, 4.0]], ["a", "b"], ["x", "y"], "t", "ms"))
        p = svg.Plot((-0.5, 0.5), (0, 1))
        p.rect(-0.4, 0.4, 0, 0.5, "#4c72b0")
        p.rect(-0.4, 0.4, 0, 0.5, p.hatch())
        p.key("expected", "#4c72b0", "hatch")
        frags.append(svg.figure(p.render(), "x"))
    ids = [set(re.findall(r'id="([^"]+)"', f)) for f in frags]
    assert all(ids)
    assert sum(len(i) for i in ids) == len(set().union(*ids))  # no id in two figures
    for f, own in zip(frags, ids):  # every internal reference resolves inside its own figure
        refs = set(re.findall(r'(?:href="|url\()#([^")]+)', f))
        assert refs and refs <= own


def test_generic_renderer_truncates_huge_lists():
    html = render_html(summary_by_hand())
    assert "op49" in html and "op50<" not in html
    assert "450 more rows not shown" in html


def test_a_failing_section_shows_its_error_and_the_rest_renders(monkeypatch):
    broken = types.ModuleType("trainprof.reports.sections.zz_custom")
    broken.TITLE = "Custom"

    def render(metrics, summary):
        raise RuntimeError("section exploded " + EVIL)

    broken.render = render
    monkeypatch.setitem(sys.modules, "trainprof.reports.sections.zz_custom", broken)
    html = render_html(summary_by_hand())
    assert "could not be rendered" in html and "section exploded &lt;script&gt;" in html
    assert 'id="s-step_time"' in html and "<svg" in html  # the other sections are intact
    assert "Analysis problems" in html


def test_survives_a_nearly_empty_summary(tmp_path):
    for s in ({}, {"run": None, "metrics": {"step_time": {}}, "findings": [None, "x"]},
              {"metrics": {"step_time": {"per_rank": "garbage"}}}):
        path = write_html(s, tmp_path / "r.html")
        assert path.read_text().startswith("<!DOCTYPE html>")
        render_terminal(s, console=_console(io.StringIO()))


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    write_html(summary_by_hand(), tmp_path / "report.html")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def _console(buf):
    from rich.console import Console

    return Console(file=buf, force_terminal=False, width=120)


def test_terminal_summary_plain_text():
    buf = io.StringIO()
    render_terminal(summary_by_hand(), report_path="/x/report.html", console=_console(buf))
    out = buf.getvalue()
    assert "\x1b[" not in out  # no colour codes when not a terminal
    assert "130 ms" in out and "31,507.7 tokens/s" in out
    assert "warning" in out and "straggler" in out and "rank 1 (dp1 pp0 tp0)" in out
    assert EVIL in out  # printed literally, not interpreted as rich markup
    assert "/x/report.html" in out


def test_terminal_summary_says_no_findings():
    s = summary_by_hand()
    s["findings"] = []
    buf = io.StringIO()
    render_terminal(s, console=_console(buf))
    assert "no findings" in buf.getvalue()


@needs_chromium
def test_report_renders_offline_in_headless_chromium(tmp_path):
    path = write_html(summary_by_hand(), tmp_path / "report.html")
    dom = _chromium(["--dump-dom", path.as_uri()], tmp_path).stdout
    # the browser parsed the whole document: findings, the plot, the generic section, the footer
    for text in ("Findings (1 warning)", "Step time", "<svg", "zz custom", "works offline"):
        assert text in dom, text
    assert "<script" not in dom.lower()
    shot = tmp_path / "shot.png"
    _chromium([f"--screenshot={shot}", "--window-size=1280,1800", path.as_uri()], tmp_path)
    assert shot.stat().st_size > 10_000


def test_input_line_names_every_part_left_out_in_terminal_and_report():
    inp = {"files": 7, "traces_read": 5, "unreadable": 1, "later_windows_skipped": 2,
           "other_job_files": 1, "not_traces": 1, "stub_steps_dropped": 2, "ranks": 2, "steps": 6}
    line = ("input: 7 trace file(s), 5 read, 1 unreadable, 2 later window(s) left out, 1 file(s) "
            "of another job left out, 1 JSON file(s) not traces, 2 empty trailing step(s) dropped over the "
            "ranks; "
            "2 rank(s), 6 profiled step(s)")
    assert kit.input_text(inp) == line
    summary = {"run": {"dir": "traces", "world_size": 2, "input": inp}, "metrics": {}, "findings": [],
               "problems": [], "errors": []}
    buf = io.StringIO()
    from rich.console import Console

    render_terminal(summary, console=Console(file=buf, force_terminal=False, width=300))
    assert line in buf.getvalue()
    assert kit.esc(line) in render_html(summary)
    # the folder analyzed (a subfolder found below the one given) titles both
    summary["run"]["input"]["inputs"] = ["traces/lightning_logs/version_0"]
    assert "<h1>trainprof report — traces/lightning_logs/version_0</h1>" in render_html(summary)
    buf = io.StringIO()
    render_terminal(summary, console=Console(file=buf, force_terminal=False, width=300))
    assert buf.getvalue().startswith("trainprof traces/lightning_logs/version_0:")


def test_mesh_dim_table_mentions_the_collective_log_only_when_there_is_one():
    from trainprof.reports.sections import comm_compute as section

    traces_only = {"by_mesh_dim": [{"mesh_dim": "world", "rank": 0, "comm_ms_per_step": 4.0,
                                    "exposed_ms_per_step": 3.0, "blocked_ms_per_step": None}]}
    html = section.render(traces_only, {})
    assert "collective log" not in html and "blocked (log)" not in html and "world" in html
    logged = {"by_mesh_dim": [dict(traces_only["by_mesh_dim"][0], blocked_ms_per_step=2.5)]}
    html = section.render(logged, {})
    assert "always-on collective log" in html and "blocked (log)" in html
