"""The report's charts, drawn as SVG by trainprof.reports.svg: numbers become the right geometry
(bar heights, cell colours, tick positions), text is escaped, and rendering a whole report
imports no plotting library."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from trainprof.reports import svg

EVIL = '<script>alert("x")</script>'
NS = "{http://www.w3.org/2000/svg}"


def parse(fragment: str) -> ET.Element:
    """The first <svg> of a fragment as an XML tree (a rendered plot must be well-formed XML)."""
    return ET.fromstring(fragment[fragment.index("<svg"):fragment.rindex("</svg>") + 6])


def plot_rects(root: ET.Element) -> list[ET.Element]:
    """The rectangles inside the plot area (the nested <svg>), not the frame or legend."""
    inner = root.find(f".//{NS}svg")
    return inner.findall(f"{NS}rect")


def test_bar_heights_are_proportional_to_values_and_start_at_zero():
    values = [1.0, 2.0, 4.0, 8.0]
    p = svg.Plot((-0.5, 3.5), (0, 10), height=200)
    for i, v in enumerate(values):
        p.rect(i - 0.4, i + 0.4, 0, v, "#4c6ef5", f"bar {i}: {v}")
    rects = plot_rects(parse(p.render()))
    assert len(rects) == 4
    heights = [float(r.get("height")) for r in rects]
    assert heights == pytest.approx([20.0, 40.0, 80.0, 160.0], abs=0.06)  # 200 px per 10 units
    for r, h in zip(rects, heights):  # every bar stands on the x axis (y = 0 at the bottom)
        assert float(r.get("y")) + h == pytest.approx(200.0, abs=0.1)
    xs = [float(r.get("x")) for r in rects]
    assert xs == sorted(xs) and len({round(float(r.get("width")), 1) for r in rects}) == 1
    assert [r.find(f"{NS}title").text for r in rects] == [f"bar {i}: {v}" for i, v in enumerate(values)]


def test_stacked_segments_meet():
    p = svg.Plot((-0.5, 0.5), (0, 1), height=100)
    p.rect(-0.4, 0.4, 0, 0.25, "#2f9e44")
    p.rect(-0.4, 0.4, 0.25, 0.75, "#e03131")
    low, high = plot_rects(parse(p.render()))
    assert float(high.get("y")) + float(high.get("height")) == pytest.approx(float(low.get("y")), abs=0.1)
    assert float(low.get("height")) == pytest.approx(25, abs=0.1)
    assert float(high.get("height")) == pytest.approx(50, abs=0.1)


def _luminance(hex_colour: str) -> float:
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def test_colormap_is_viridis_and_its_lightness_rises_with_the_value():
    assert svg.colormap(0.0) == "#440154" and svg.colormap(1.0) == "#fde725"
    assert svg.colormap(0.5) == "#21918c"
    lum = [_luminance(svg.colormap(i / 50)) for i in range(51)]
    assert all(b > a for a, b in zip(lum, lum[1:]))
    assert svg.colormap(-3) == svg.colormap(0) and svg.colormap(7) == svg.colormap(1)  # clamped


def test_heatmap_cell_colours_are_monotone_in_value_and_tooltips_name_row_column_value():
    values = [[10.0, 20.0, 30.0], [40.0, 50.0, math.nan]]
    html = svg.heatmap(values, ["r0", "r1"], ["s1", "s2", "s3"], "title", "ms", col_name="step")
    cells = plot_rects(parse(html))
    assert len(cells) == 5  # the NaN cell is left blank
    lum = [_luminance(c.get("fill")) for c in cells]
    assert lum == sorted(lum) and len(set(lum)) == 5
    assert cells[0].get("fill") == svg.VIRIDIS[0] and cells[-1].get("fill") == svg.VIRIDIS[-1]
    tips = [c.find(f"{NS}title").text for c in cells]
    assert tips[0] == "step s1, r0: 10" and tips[4] == "step s2, r1: 50"
    # rows top-down in the given order, columns left to right
    assert float(cells[0].get("y")) < float(cells[3].get("y"))
    assert float(cells[0].get("x")) < float(cells[1].get("x")) < float(cells[2].get("x"))


def test_heatmap_scale_saturates_beyond_vmin_vmax_and_marks_it():
    html = svg.heatmap([[0.0, 5.0, 10.0, 100.0]], ["r"], ["a", "b", "c", "d"], "t", vmin=0, vmax=10)
    cells = plot_rects(parse(html))
    assert cells[2].get("fill") == cells[3].get("fill") == svg.VIRIDIS[-1]
    assert "cells above 10" in html and "cells below" not in html  # an arrow at the top end only


def test_heatmap_with_many_columns_bins_them_keeping_the_largest():
    row = [1.0] * 500
    row[137] = 99.0
    html = svg.heatmap([row], ["r"], list(range(500)), "t", col_name="step")
    cells = plot_rects(parse(html))
    assert len(cells) <= svg.MAX_COLS
    assert sum(c.get("fill") == svg.VIRIDIS[-1] for c in cells) == 1  # the spike survives
    assert "largest of 5 consecutive steps" in html


def test_heatmap_separator_and_colour_bar():
    html = svg.heatmap([[1.0], [2.0], [3.0]], ["a", "b", "c"], ["x"], "t", "ms", separator=1)
    root = parse(html)
    assert root.find(f".//{NS}linearGradient") is not None
    ys = [float(ln.get("y1")) for ln in root.find(f".//{NS}svg").findall(f"{NS}line")]
    h = float(plot_rects(root)[0].get("height"))
    assert ys and all(y == pytest.approx(h, abs=0.1) for y in ys)  # under the first row


def test_every_text_is_escaped():
    p = svg.Plot((0, 1), (0, 1), title=EVIL, xlabel=EVIL, ylabel=EVIL,
                 xticks=[(0.5, EVIL)], yticks=[(0.5, EVIL)])
    p.rect(0, 1, 0, 1, "#000", tip=EVIL)
    p.line([0, 1], [0, 1], "#000", tip=EVIL, markers=2, tips=[EVIL, EVIL])
    p.dots([0.5], [0.5], "#000", 3, [EVIL])
    p.text(0.5, 0.5, EVIL)
    p.key(EVIL, "#000")
    out = svg.figure(p.render(), EVIL)
    assert "<script" not in out
    assert out.count("&lt;script&gt;") >= 12
    parse(out)  # still well-formed
    hm = svg.heatmap([[1.0]], [EVIL], [EVIL], EVIL, EVIL, alt=EVIL, row_tips=[EVIL], col_name=EVIL)
    assert "<script" not in hm and "&lt;script&gt;" in hm


def test_linear_ticks_are_round_and_cover_the_range():
    assert svg.nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert svg.nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg.nice_ticks(3.2, 5.9) == [3.5, 4.0, 4.5, 5.0, 5.5]
    assert svg.nice_ticks(0, 1600) == [0, 500, 1000, 1500]
    assert svg.linear_labels([0, 500, 1000, 1500]) == ["0", "500", "1,000", "1,500"]
    assert svg.linear_labels([0.5, 0.75, 1.0]) == ["0.50", "0.75", "1.00"]
    assert svg.nice_ticks(5, 5) == [5]


def test_log_axis_ticks_are_powers_of_ten_at_the_right_positions():
    assert svg.log_ticks(0.003, 250) == [0.01, 0.1, 1, 10, 100]
    assert svg.log_ticks(2e7, 3e11) == [1e8, 1e9, 1e10, 1e11]
    assert svg.log_ticks(3, 40) == [5, 10, 20]  # under three decades: 2× and 5× too
    assert [svg.log_label(v) for v in (0.01, 1, 1000, 1e4, 1e8, 1e12, 1e-5)] == \
        ["0.01", "1", "1000", "10k", "100M", "1T", "1e-05"]
    p = svg.Plot((1, 1e4), (1e8, 1e12), xlog=True, ylog=True, width=500, height=400, grid=None)
    root = parse(p.render())
    labels = {t.text: t for t in root.iter(f"{NS}text")}
    assert {"1", "10", "100", "1000", "10k", "100M", "1G", "10G", "100G", "1T"} <= set(labels)
    # equal ratios are equal distances: one decade = a quarter of each axis
    assert p.sx(10) - p.sx(1) == pytest.approx(p.pw / 4)
    assert p.sx(1000) - p.sx(100) == pytest.approx(p.pw / 4)
    assert p.sy(1e9) - p.sy(1e10) == pytest.approx(100)
    assert p.sy(1e8) == pytest.approx(400) and p.sy(1e12) == pytest.approx(0)


def test_line_breaks_at_missing_values_and_long_series_are_thinned():
    p = svg.Plot((0, 5), (0, 5), height=100)
    p.line([0, 1, 2, 3, 4, 5], [1, 2, None, 3, float("nan"), 4], "#000")
    polys = parse(p.render()).find(f".//{NS}svg").findall(f"{NS}polyline")
    assert len(polys) == 1 and len(polys[0].get("points").split()) == 2  # single points dropped
    n = 100_000
    ys = [math.sin(i / 500) for i in range(n)]
    ys[54_321] = 50.0  # a one-sample peak
    pts = svg._thin(list(zip(range(n), ys)))
    assert len(pts) <= svg.MAX_POINTS
    assert (54_321, 50.0) in pts and pts[0] == (0, ys[0]) and pts[-1] == (n - 1, ys[-1])
    assert [x for x, _ in pts] == sorted(x for x, _ in pts)


def test_plot_area_clips_what_runs_off_the_scale():
    p = svg.Plot((0, 2), (0, 10), height=100)
    p.line([0, 1, 2], [5, 1000, 5], "#000")
    root = parse(p.render())
    inner = root.find(f".//{NS}svg")
    assert inner.get("overflow") == "hidden" and float(inner.get("height")) == 100


def test_legend_entries_and_bottom_legend_wraps():
    p = svg.Plot((0, 1), (0, 1), width=400, legend_at="bottom")
    for i in range(8):
        p.key(f"a rather long legend entry {i}", svg.PALETTE[i])
    root = parse(p.render())
    texts = [t.text for t in root.iter(f"{NS}text") if t.text and t.text.startswith("a rather")]
    assert len(texts) == 8
    rows = {g.get("transform").split(",")[1] for g in root.iter(f"{NS}g")
            if g.get("transform", "").startswith("translate(") and g.find(f"{NS}text") is not None
            and (g.find(f"{NS}text").text or "").startswith("a rather")}
    assert len(rows) >= 3  # several rows, none wider than the plot


REPORT = """
import json, sys
from trainprof.reports.html import render_html
html = render_html(json.loads(sys.argv[1]))
print(json.dumps({"svg": html.count("<svg"), "mpl": sorted(m for m in sys.modules if m.startswith("matplotlib"))}))
"""


def test_rendering_a_report_imports_no_plotting_library():
    from synth import summary_by_hand
    from synth import scale_summary

    summary = scale_summary(80)  # aggregated heatmaps, bars, memory lines
    summary["metrics"]["step_time"] = summary_by_hand()["metrics"]["step_time"]  # a line chart
    summary["metrics"]["roofline"] = {"plot": {"peak_flops_per_s": 1e12, "peak_bytes_per_s": 1e11,
                                               "ridge_ai": 10.0, "points": [
                                                   {"label": "matmul", "ai": 30.0, "flops_per_s": 5e11,
                                                    "time_ms": 10.0}]}}
    proc = subprocess.run([sys.executable, "-c", REPORT, json.dumps(summary)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["mpl"] == []
    assert out["svg"] >= 8  # the charts are there, drawn without it


def test_every_plot_of_a_real_sized_report_is_well_formed_svg():
    from synth import scale_summary

    from trainprof.reports.html import render_html

    html = render_html(scale_summary(200))
    groups = re.findall(r'<div class="plots">(.*?)</div><figcaption>', html, flags=re.S)
    assert len(groups) >= 6
    for frag in groups:
        root = ET.fromstring(f"<div>{frag}</div>")
        assert root.findall(f"{NS}svg")


def test_a_huge_name_does_not_squash_the_plot():
    name = "node-" + "x" * 5000
    html = svg.heatmap([[1.0], [2.0]], [name, "b"], ["s"], "t")
    assert name not in html.split("<title>")[0]  # the tick label is shortened...
    assert f"{name}: " in html  # ...the tooltip names it in full
    cell = plot_rects(parse(html))[0]
    assert float(cell.get("width")) > 300
