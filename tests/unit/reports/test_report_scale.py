"""report.html and the terminal summary stay readable and bounded at 1,024 ranks: per-rank tables
worst first and capped with a count of what is hidden, charts aggregated by host with the
outlier ranks drawn on their own, rank lists capped; a small run still shows every rank."""

from __future__ import annotations

from synth import SLOWEST, STRAGGLER, host, scale_summary
import io
import re
import shutil
import subprocess
import time

import pytest

from trainprof.reports import ranks as rk
from trainprof.reports.html import render_html, write_html
from trainprof.reports.terminal import render_terminal

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def big():
    summary = scale_summary(1024)
    t0 = time.process_time()
    html = render_html(summary)
    return summary, html, time.process_time() - t0


def _section(html: str, name: str) -> str:
    start = html.index(f'id="s-{name}"')
    end = html.find("<section", start + 1)
    return html[start:end if end > 0 else len(html)]


def _table_ranks(fragment: str) -> list[int]:
    """The rank column (first cell) of every data row of the tables in a fragment, in order."""
    return [int(x) for x in re.findall(r'<tr><td class="num">(\d+)</td>', fragment)]


def test_1024_ranks_render_small_and_fast(big):
    summary, html, cpu_s = big
    # measured: ~0.6 MB and ~4 s of CPU; a report with a row or bar per rank was 7 MB and 70 s
    assert len(html.encode()) < 2_500_000, len(html)
    assert cpu_s < 40, cpu_s
    assert html.count("<tr") < 1500
    assert html.rstrip().endswith("</html>")


def test_tables_sort_worst_first_cap_rows_and_say_how_many_are_hidden(big):
    _, html, _ = big
    st = _section(html, "step_time")
    assert "… 1,004 more ranks not shown (of 1,024); full data in summary.json." in st
    rows = _table_ranks(st)
    # the straggler a finding names first, then the slowest by median step time, worst first
    assert rows[:2] == [STRAGGLER, SLOWEST] and len(rows) == 20
    assert "median of 1,024" in st  # a median row over all ranks closes the capped table
    for name in ("stragglers", "comm_compute", "collectives", "memory", "hang"):
        sec = _section(html, name)
        assert re.search(r"… 1,00\d more ranks not shown \(of 1,024\)", sec), name
        assert STRAGGLER in _table_ranks(sec)[:3], name


def test_charts_aggregate_by_host_with_the_outliers_drawn_individually(big):
    _, html, _ = big
    for name in ("step_time", "stragglers", "collectives", "comm_compute"):
        sec = _section(html, name)
        assert f"rank {STRAGGLER} ({host(STRAGGLER)})" in sec, name  # its own labelled row
        assert "node000–node001" in sec, name  # 128 hosts: 2 per row, median of their ranks
        assert ">node127<" not in sec and ">1023<" not in sec, name  # no row or bar per rank
    # the slowest rank stands out of the step-time heatmap too (farthest from the median)
    assert f"rank {SLOWEST} ({host(SLOWEST)})" in _section(html, "step_time")


def test_rank_lists_and_messages_are_capped(big):
    _, html, _ = big
    assert f"1,023 ranks: 0–{STRAGGLER - 1}, {STRAGGLER + 1}–1023" in html  # ranges
    assert "342 ranks: 0, 3, 6, 9, 12, 15, 18, 21 … and 334 more" in html  # every third rank
    assert f"rank {STRAGGLER} is a chronic straggler; its peers ranks 0, 1, 2, 3, 4, 5, 6, 7 … " \
           "and 1,015 more wait for it" in html
    assert "1,023 entries. Largest: " in html  # a value per rank in evidence: one line
    assert "1023 wait in" not in html


def test_terminal_summary_at_1024_ranks_is_short_and_names_the_straggler():
    from rich.console import Console

    buf = io.StringIO()
    render_terminal(scale_summary(1024), report_path="/x/report.html",
                    console=Console(file=buf, force_terminal=False, width=160))
    out = buf.getvalue()
    assert "1024 ranks, 128 hosts" in out
    assert f"rank {STRAGGLER}" in out and "… and 1,015 more" in out
    assert "1,023 ranks: 0–772, 774–1023" in out
    assert len(out) < 6000, len(out)


@pytest.mark.parametrize("n", [8, 64])
def test_a_small_run_still_shows_every_rank(n):
    html = render_html(scale_summary(n))
    assert "not shown" not in html and f"<td>median of {n}</td>" not in html and "node000–" not in html
    for name in ("step_time", "stragglers", "collectives", "memory", "hang"):
        assert sorted(_table_ranks(_section(html, name))) == list(range(n)), name
    st = _section(html, "step_time")
    assert _table_ranks(st) == list(range(n))  # rank order, as before
    plots = _section(html, "stragglers").split("<figure", 1)[1]
    assert ">rank " not in plots  # heatmap rows are the ranks themselves


def test_rank_list_and_cap_numbers():
    assert rk.rank_list([]) == ""
    assert rk.rank_list([5]) == "5"
    assert rk.rank_list([0, 1, 4, 5]) == "0, 1, 4, 5"
    assert rk.rank_list([0, 1, 2, 3, 9]) == "0–3, 9"
    assert rk.rank_list(list(range(0, 40, 2)), limit=3) == "0, 2, 4 … and 17 more"
    assert rk.cap_numbers("ranks 1, 2, 3 wait") == "ranks 1, 2, 3 wait"
    assert rk.cap_numbers("ranks " + ", ".join(map(str, range(20))) + ".", keep=4) == \
        "ranks 0, 1, 2, 3 … and 16 more."
    assert rk.cap_numbers("1,234.5 ms, 2, 3") == "1,234.5 ms, 2, 3"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_1024_rank_report_loads_in_headless_chromium(big, tmp_path):
    path = write_html(big[0], tmp_path / "report.html")
    cmd = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
           "--proxy-server=127.0.0.1:9", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
           path.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "works offline" in proc.stdout and f"rank {STRAGGLER} ({host(STRAGGLER)})" in proc.stdout


def test_many_findings_of_one_kind_are_grouped_most_severe_first():
    s = scale_summary(1024)
    s["findings"] = [{"kind": "straggler", "severity": "warning", "ranks": [r], "analyzer": "stragglers",
                      "message": f"rank {r} is slow", "evidence": {"score": 2.0 + (r == STRAGGLER)}}
                     for r in range(5, 1024, 8)]  # 128 findings, the straggler's score highest
    html = render_html(s)
    findings = html[html.index("<h2>Findings"):html.index("<h2>Metrics")]
    assert "straggler: 128 findings — 128 ranks: 5, 13, 21, 29, 37, 45, 53, 61 … and 120 more" in findings
    assert findings.count('class="finding"') == 3  # the three most severe in full
    assert findings.index(f"rank {STRAGGLER} is slow") < findings.index("rank 5 is slow")
    assert "… 105 more straggler findings not shown (of 125); full data in summary.json." in findings
    assert len(findings) < 60_000

    from rich.console import Console

    buf = io.StringIO()
    render_terminal(s, console=Console(file=buf, force_terminal=False, width=160))
    out = buf.getvalue()
    assert f"rank {STRAGGLER} is slow" in out and "… 125 more straggler findings" in out
    assert out.count(" is slow") == 3
