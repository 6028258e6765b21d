"""The report's whole-run view renders the analyzer's downsampled series as they are: bounded
at 1,024 ranks and 100,000 steps, every onset marked and listed."""

from __future__ import annotations

import re

from trainprof.reports.html import render_html
from trainprof.reports.sections import whole_run


def _metrics(rows=64, bins=200, steps=100_000):
    edges = [round(i * steps / bins) for i in range(bins + 1)]
    return {"steps": steps, "first_step": 1, "last_step": steps,
            "bins": [{"first": a + 1, "last": b, "time": None, "step_ms": 10.0, "max_ms": 12.0,
                      "steps_per_s": 100.0 - (30 if a >= 60_000 else 0)}
                     for a, b in zip(edges[:-1], edges[1:])],
            "heatmap": {"rows": [f"{16 * i}–{16 * i + 15}" for i in range(rows)], "ranks_per_row": 16,
                        "bins": [[a + 1, b] for a, b in zip(edges[:-1], edges[1:])],
                        "ms": [[10.0 + (5 if (i == 7 and j >= 120) else 0) for j in range(bins)]
                               for i in range(rows)]}}


def test_whole_run_section_bounded_with_onsets():
    findings = [{"kind": "straggler", "severity": "warning", "ranks": [117], "message": "rank 117 ...",
                 "onset": {"step": 60_001, "time": "2026-01-01T00:00:00+00:00"}},
                {"kind": "throughput_drop", "severity": "warning", "ranks": [117], "message": "drop",
                 "onset": {"step": 60_003, "time": None}, "end": {"step": 90_000, "time": None}},
                {"kind": "exposed_comm", "severity": "warning", "ranks": [], "message": "no onset"}]
    summary = {"run": {"world_size": 1024}, "metrics": {"whole_run": _metrics()}, "findings": findings}
    html = whole_run.render(summary["metrics"]["whole_run"], summary)
    assert html.count("<figure") == 2 and html.count("<svg") >= 2
    # both onsets drawn (labels stacked, not on top of each other) and listed; the end dotted
    assert html.count('stroke-dasharray="4 3"') >= 2 and 'stroke-dasharray="1 3"' in html
    assert "straggler" in html and "throughput_drop" in html and "exposed_comm" not in html
    ys = [float(m) for m in re.findall(r'<text[^>]*y="([\d.]+)"[^>]*>(?:straggler|throughput_drop)<', html)]
    assert len(set(ys)) == 2
    assert "60001" in html.replace(",", "") and "ongoing at the last step" in html
    # 64 rows × ≤ 37 columns after merging: the heatmap stays a few hundred KB at most
    cells = html.count("<rect")
    assert cells <= 64 * 40 + 200, cells
    assert len(html) < 700_000
    page = render_html(summary)
    assert 'id="s-whole_run"' in page and "could not be rendered" not in page


def test_whole_run_section_without_onsets_says_so():
    summary = {"metrics": {"whole_run": _metrics(rows=2, bins=20, steps=400)}, "findings": []}
    html = whole_run.render(summary["metrics"]["whole_run"], summary)
    assert "No finding with an onset" in html
