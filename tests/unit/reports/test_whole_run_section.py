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


def _plot_areas(html: str) -> list[tuple[float, str]]:
    """(plot width px, the plot area's SVG) of each chart: the nested <svg> holding the data."""
    out = []
    for m in re.finditer(r'<svg width="([\d.]+)" height="[\d.]+" overflow="hidden"[^>]*>(.*?)</svg>',
                         html, re.S):
        out.append((float(m.group(1)), m.group(2)))
    return out


def _marker_xs(area: str) -> dict[str, float]:
    """{tooltip: x px} of the onset/end markers of one plot area."""
    return {t: float(x) for x, t in re.findall(
        r'<g><line x1="([\d.]+)"[^>]*stroke-dasharray="[^"]+"/><line[^>]*stroke-opacity="0"[^>]*/>'
        r'<title>([^<]*)</title></g>', area)}


def test_onsets_drawn_at_their_step_on_throughput_and_heatmap():
    """100,000 steps in 200 bins of 500; a straggler's onset at step 60,251 (bin 120, half-way)
    and a drop from 60,001 to its end at 90,000. Throughput (x: steps 1..100,000): the marker at
    (60,251 − 1) / 99,999 of the plot's width. Heatmap (64 rows: bins merged 6 at a time into 34
    columns; column 20 = steps 60,001–63,000): at (20 + 250 / 3,000) / 34 of its width; the
    end at step 90,000 = the last step of merged column 29 ((29 + 2,999 / 3,000) / 34)."""
    findings = [{"kind": "straggler", "severity": "warning", "ranks": [117], "message": "rank 117 slow",
                 "onset": {"step": 60_251, "time": "2026-01-01T00:00:00+00:00"}},
                {"kind": "throughput_drop", "severity": "warning", "ranks": [], "message": "drop",
                 "onset": {"step": 60_001, "time": None}, "end": {"step": 90_000, "time": None}}]
    summary = {"metrics": {"whole_run": _metrics()}, "findings": findings}
    html = whole_run.render(summary["metrics"]["whole_run"], summary)
    (tw, thr), (hw, heat) = _plot_areas(html)
    for area, width, frac in ((thr, tw, lambda s: (s - 1) / 99_999),
                              (heat, hw, lambda s: (20 + (s - 60_001) / 3000) / 34
                               if s < 63_001 else (29 + (s - 87_001) / 3000) / 34)):
        xs = _marker_xs(area)
        onset = next(x for t, x in xs.items() if t.startswith("straggler from step 60251"))
        assert abs(onset - frac(60_251) * width) <= 0.1, (onset, frac(60_251) * width)
        drop = next(x for t, x in xs.items() if t.startswith("throughput_drop from step 60001"))
        assert abs(drop - frac(60_001) * width) <= 0.1
        end = next(x for t, x in xs.items() if t == "throughput_drop over at step 90000")
        assert abs(end - frac(90_000) * width) <= 0.1
        # each onset labelled with its kind (hover: the finding), the end not labelled
        assert re.search(r'>straggler<title>straggler from step 60251 \(2026-01-01T00:00:00\+00:00\): '
                         r'rank 117: rank 117 slow</title></text>', area)
        assert area.count(">throughput_drop<title>") == 1
    assert whole_run.column_of([[1, 10], [11, 20], [31, 40]], 25) == 1.5  # between bins: the edge
    assert whole_run.column_of([[1, 10], [11, 20]], 0) == -0.5
