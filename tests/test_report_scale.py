"""report.html and the terminal summary stay readable and bounded at 1,024 ranks: per-rank tables
worst first and capped with a count of what is hidden, charts aggregated by host with the
outlier ranks drawn on their own, rank lists capped; a small run still shows every rank."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import time

import pytest

from trainprof.reports import ranks as rk
from trainprof.reports.html import render_html, write_html
from trainprof.reports.terminal import render_terminal

STRAGGLER = 773  # named by the stragglers finding
SLOWEST = 301  # the largest median step time, named by no finding
PER_HOST = 8
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def host(r: int) -> str:
    return f"node{r // PER_HOST:03d}"


def coords(r: int) -> dict:
    return {"dp": r // 4, "pp": (r // 2) % 2, "tp": r % 2}


def scale_summary(n: int) -> dict:
    """A summary of an n-rank run in the analyzers' schema: one chronic straggler (STRAGGLER,
    when there is such a rank) and, with n > SLOWEST, one rank (SLOWEST) with the largest
    median step time."""
    ranks = range(n)
    strag = STRAGGLER if n > STRAGGLER else n - 1
    wiggle = lambda r: (r * 37 % 11) / 10  # noqa: E731 - a deterministic per-rank jitter (0..1 ms)
    median = {r: 100.0 + wiggle(r) + (60.0 if r == strag else 0) + (80.0 if r == SLOWEST else 0)
              for r in ranks}
    steps = list(range(1, 10))
    others = [r for r in ranks if r != strag]
    scattered = [r for r in ranks if r % 3 == 0]
    return {
        "schema_version": 1, "trainprof_version": "0.1.0", "generated_at": "2026-11-25T10:00:00+00:00",
        "run": {"dir": "runs/big", "command": ["torchrun", "train.py"], "exit_code": 0,
                "world_size": n, "mesh": {"dp": max(1, n // 4), "pp": 2, "tp": 2}, "device": "cpu",
                "backend": "gloo",
                "ranks": [{"rank": r, "host": host(r), "local_rank": r % PER_HOST, "coords": coords(r)}
                          for r in ranks]},
        "metrics": {
            "step_time": {
                "job": {"steps": 9, "median_ms": 160.0, "p90_ms": 170.0, "ranks_reporting": n},
                "per_rank": [{"rank": r, "steps": 9, "median_ms": median[r], "p90_ms": median[r] + 2,
                              "min_ms": median[r] - 2, "max_ms": median[r] + 3, "spread_pct": 2.0}
                             for r in ranks],
                "step_ms_by_rank": {str(r): [900.0] + [median[r]] * 9 for r in ranks},
                "first_step": 0, "excluded_steps": {"warmup": [0], "profiler": []}},
            "stragglers": {
                "steps": steps, "steps_analysed": steps, "chronic": [strag], "transient": [],
                "median_step_ms": 160.0, "thresholds": {"score": 1.5, "min_excess": 0.1, "chronic": 0.5},
                "per_rank": [{"rank": r, "group": "pp0", "coords": coords(r), "host": host(r),
                              "own_ms": median[r], "peer_own_ms": 100.0, "excess_ms": median[r] - 100,
                              "score": (median[r] - 100) / 2 if r == strag else wiggle(r) / 5,
                              "busy_ms": median[r], "blocked_ms": 60.0, "status":
                              "chronic" if r == strag else "ok"} for r in ranks],
                "busy_ms_by_rank": {str(r): [median[r]] * 9 for r in ranks},
                "wait_ms_by_rank": {str(r): [0.0 if r == strag else 60.0 + wiggle(r)] * 9 for r in ranks},
                "data_ms_by_rank": {str(r): [0.5] * 9 for r in ranks}},
            "comm_compute": {
                "job": {"trace_kind": "cpu", "ranks": n, "compute_fraction": 0.5},
                "per_rank": [{"rank": r, "coords": coords(r), "step_window_ms": median[r],
                              "compute_fraction": 0.5, "exposed_comm_fraction": 0.3 + wiggle(r) / 100,
                              "other_fraction": 0.2 - wiggle(r) / 100} for r in ranks],
                "per_step": [{"rank": r, "step": s, "compute_ms": 50.0, "exposed_comm_ms": 30.0 + wiggle(r)}
                             for r in ranks for s in (3, 4)]},
            "collectives": {
                "records": 10 * n, "ranks": n, "groups": 3,
                "lateness": {"per_rank": [{"rank": r, "n": 100, "mean_ms": 9.0 if r == strag else wiggle(r),
                                           "p90_ms": 12.0 if r == strag else 1.0 + wiggle(r)}
                                          for r in ranks]}},
            "memory": {
                "job": {"peak_metric": "peak_allocated_bytes", "max_peak_bytes": 2 ** 31},
                "per_rank": [{"rank": r, "coords": coords(r), "peak_allocated_bytes": 2 ** 30 + r,
                              "measured": {"params_bytes": 2 ** 20}, "expected": {"params_bytes": 2 ** 20}}
                             for r in ranks],
                "timeline": {str(r): {"step": steps, "allocated_bytes": [2 ** 30 + r] * 9} for r in ranks}},
            "hang": {
                "hung": True, "message": "rank " + str(strag) + " never reached the all_reduce that "
                "ranks " + ", ".join(map(str, others)) + " wait in",
                "ranks": [{"rank": r, "state": "running" if r == strag else "in_collective", "step": 7,
                           "waiting_in": None if r == strag else {"op": "all_reduce", "seq": 9, "pg": "0",
                                                                  "source": "log"},
                           "frame": "train.py:12", "stalled_s": 30.0} for r in ranks],
                "stack_groups": [{"ranks": others, "majority": True, "in_collective": True,
                                  "frame": "all_reduce", "frames": []},
                                 {"ranks": [strag], "majority": False, "in_collective": False,
                                  "frame": "forward", "frames": []}]},
        },
        "findings": [
            {"kind": "straggler", "severity": "warning", "ranks": [strag], "analyzer": "stragglers",
             "message": f"rank {strag} is a chronic straggler; its peers ranks "
                        + ", ".join(map(str, others)) + " wait for it",
             "evidence": {"rank": strag, "waits_caused_ms": {str(r): 60.0 + wiggle(r) for r in others}}},
            {"kind": "exposed_comm", "severity": "warning", "ranks": others, "analyzer": "comm_compute",
             "message": "communication not hidden", "evidence": {"per_rank": {str(r): 0.3 for r in ranks}}},
            {"kind": "scattered", "severity": "info", "ranks": scattered, "analyzer": "x",
             "message": "every third rank"},
        ],
        "problems": [], "errors": [],
    }


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
