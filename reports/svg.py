"""Charts as inline SVG written directly (no plotting library): axes with ticks, bars, lines, dots,
rectangles, log scales, legends, a heatmap with its colour scale.

Every text (titles, tick labels, legend entries, tooltips) passes through esc(): names from a run
are never markup. Tooltips are <title> elements on the cells, bars, spans and points. The plot
area is a nested <svg> (it clips what runs off the axes without an id); the only ids are a
heatmap's colour gradient and a hatch pattern, prefixed per figure so that two figures on one page
never share one.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable, Sequence

from trainprof.reports import kit

_ids = itertools.count()

# matplotlib's viridis at 17 evenly spaced points, interpolated linearly in RGB
VIRIDIS = ("#440154", "#48186a", "#472d7b", "#424086", "#3b528b", "#33638d", "#2c728e", "#26828e",
           "#21918c", "#1fa088", "#28ae80", "#3fbc73", "#5ec962", "#84d44b", "#addc30", "#d8e219",
           "#fde725")
# matplotlib's default colour cycle (tab10)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")

FONT = 11  # px, tick labels and legends; titles 12
CHAR_W = 0.6  # average glyph width / font size of a sans-serif face: layout estimates only
GRID = "#e3e6eb"
AXIS = "#4a5160"
TEXT = "#1d2330"
MAX_POINTS = 1500  # points of one line drawn as is; a longer series keeps each bucket's min and max


esc = kit.esc


def num(v: float) -> str:
    """A coordinate: at most one decimal, no trailing zero."""
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else ("0" if s == "-0" else s)


def text_width(s: str, size: float = FONT) -> float:
    return len(str(s)) * size * CHAR_W


MAX_LABEL = 40  # characters of a tick label drawn (the tooltips keep the whole name)


def short(s, limit: int = MAX_LABEL) -> str:
    s = str(s)
    return s if len(s) <= limit else s[:limit - 1] + "…"


def finite(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


# --- colour -------------------------------------------------------------------------------------

def _rgb(h: str) -> tuple[int, int, int]:
    return int(h[1:3], 16), int(h[3:5], 16), int(h[5:7], 16)


_STOPS = [_rgb(c) for c in VIRIDIS]


def colormap(t: float) -> str:
    """viridis at t in [0, 1] (clamped) as #rrggbb."""
    t = 0.0 if not math.isfinite(t) else min(1.0, max(0.0, t))
    pos = t * (len(_STOPS) - 1)
    i = min(int(pos), len(_STOPS) - 2)
    f = pos - i
    a, b = _STOPS[i], _STOPS[i + 1]
    return "#%02x%02x%02x" % tuple(round(a[k] + (b[k] - a[k]) * f) for k in range(3))


def scaled_colour(v: float, vmin: float, vmax: float) -> str:
    """The colour of v on a vmin..vmax scale (beyond it: the end colours)."""
    return colormap((v - vmin) / (vmax - vmin) if vmax > vmin else 0.5)


# --- ticks --------------------------------------------------------------------------------------

def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 × 10^k apart) covering [lo, hi]: the step whose number of
    ticks is closest to n (the smaller step on a tie)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        return [lo]
    mag = 10 ** math.floor(math.log10((hi - lo) / max(n, 1)))
    best = None
    for step in (m * mag for m in (1, 2, 5, 10, 20, 50)):
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        score = abs(last - first + 1 - n)
        if best is None or score < best[0]:
            best = (score, step, first, last)
    _, step, first, last = best
    return [round(k * step, 12) for k in range(first, last + 1)]


def _decimals(ticks: Sequence[float]) -> int:
    step = min((abs(b - a) for a, b in zip(ticks, ticks[1:]) if b != a), default=1.0)
    for d in range(7):
        if abs(round(step, d) - step) <= step * 1e-6:
            return d
    return 6


def linear_labels(ticks: Sequence[float]) -> list[str]:
    """Tick labels with as many decimals as the tick step needs; thousands separated."""
    d = _decimals(ticks)
    out = []
    for t in ticks:
        s = f"{t:,.{d}f}"
        out.append("0" if s.strip("-0.,") == "" else s)
    return out


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten within [lo, hi]; 2× and 5× multiples too when that gives fewer than three."""
    if not (lo > 0 and hi > 0):
        return []
    if hi < lo:
        lo, hi = hi, lo
    eps = 1e-9
    decades = [10.0 ** k for k in range(math.ceil(math.log10(lo) - eps), math.floor(math.log10(hi) + eps) + 1)]
    if len(decades) >= 3:
        return decades
    out = [m * 10.0 ** k for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
           for m in (1, 2, 5)]
    return [t for t in out if lo * (1 - eps) <= t <= hi * (1 + eps)]


_SI = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def log_label(v: float) -> str:
    """0.01, 0.1, 1, 10, 100, 1000 as such; larger with an SI prefix (10k, 100M, 1T); smaller as 1e-05."""
    if v <= 0:
        return str(v)
    if 1e-3 <= v < 1e4:
        return f"{v:g}"
    if v < 1e-3:
        return f"{v:.0e}"
    for scale, prefix in _SI:
        if v >= scale:
            return f"{v / scale:g}{prefix}"
    return f"{v:g}"


# --- a plot -------------------------------------------------------------------------------------

class Plot:
    """One set of axes. Data coordinates go in; the layout (margins for tick labels, the title,
    a legend or a colour bar) is settled when the plot is rendered.

    x, y: the data ranges (y's first value at the bottom; give (n - 0.5, -0.5) for rows drawn
    top-down). xticks / yticks: [(value, label)] for categories, else computed (log or linear).
    """

    def __init__(self, x: tuple[float, float], y: tuple[float, float], *, width: int = 720,
                 height: int = 220, title: str = "", xlabel: str = "", ylabel: str = "",
                 xlog: bool = False, ylog: bool = False, xticks=None, yticks=None,
                 yfmt: Callable[[float], str] | None = None, grid: str | None = "y",
                 legend_at: str = "right", xtick_size: float = FONT, ytick_size: float = FONT,
                 crisp: bool = False):
        self.x0, self.x1 = x
        self.y0, self.y1 = y
        self.width, self.plot_h = width, height
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.xlog, self.ylog = xlog, ylog
        self.xticks, self.yticks, self.yfmt = xticks, yticks, yfmt
        self.grid, self.legend_at = grid, legend_at
        self.xtick_size, self.ytick_size = xtick_size, ytick_size
        self.crisp = crisp  # no anti-aliased seams between adjacent cells (heatmaps)
        self.items: list[tuple] = []
        self.legend: list[tuple[str, str, str]] = []
        self.defs: list[str] = []
        self.side: tuple[float, Callable[[float, float, float], str]] | None = None
        self.prefix = f"g{next(_ids)}-"

    # data -> pixels inside the plot area
    def _t(self, v: float, a: float, b: float, log: bool) -> float:
        if log:
            v, a, b = (math.log10(max(u, 1e-300)) for u in (v, a, b))
        return (v - a) / (b - a) if b != a else 0.5

    def sx(self, v: float) -> float:
        return self._t(v, self.x0, self.x1, self.xlog) * self.pw

    def sy(self, v: float) -> float:
        return (1 - self._t(v, self.y0, self.y1, self.ylog)) * self.plot_h

    # primitives, in data coordinates
    def rect(self, x0, x1, y0, y1, fill: str, tip: str | None = None, extra: str = "") -> None:
        self.items.append(("rect", x0, x1, y0, y1, fill, tip, extra))

    def line(self, xs: Sequence, ys: Sequence, color: str, width: float = 1.4, dash: str | None = None,
             tip: str | None = None, markers: float = 0, tips: Sequence[str] | None = None) -> None:
        """A polyline (None or NaN values break it); markers: radius of a dot at each point,
        each with its tooltip from `tips`."""
        self.items.append(("line", list(xs), list(ys), color, width, dash, tip))
        if markers:
            self.dots(xs, ys, color, markers, tips)

    def dots(self, xs, ys, color, r, tips=None, opacity: float = 1.0) -> None:
        self.items.append(("dots", list(xs), list(ys), color, r, tips, opacity))

    def text(self, x, y, s, size: float = 10, anchor: str = "start", color: str = TEXT,
             dx: float = 0, dy: float = 0, extra: str = "") -> None:
        self.items.append(("text", x, y, s, size, anchor, color, dx, dy, extra))

    def vline(self, x, color: str = AXIS, width: float = 1, dash: str | None = None,
              tip: str | None = None) -> None:
        """A vertical line at x; with a tip, its tooltip over a band a few pixels wide."""
        self.items.append(("vline", x, color, width, dash, tip))

    def hline(self, y, color: str = AXIS, width: float = 1, dash: str | None = None) -> None:
        self.items.append(("hline", y, color, width, dash, None))

    def marks(self, marks: Sequence[dict], top: float, color: str, span: float | None = None) -> None:
        """Event markers: per mark {"x", "label" (drawn at the top, None: none), "tip", "dash"},
        a vertical line with its tooltip; a label that would overprint an earlier one (its
        text's width on a plot of the figure's width less its margins and the legend keyed so
        far; or within ``span`` data units) goes on the first free row below."""
        right = self._legend_size()[0] if self.legend_at == "right" else 0
        pw = max(60.0, self.width - 80 - right)  # (the margins: tick labels, a y label)
        scale = abs(float(self.x1 - self.x0)) / pw  # data units a pixel
        placed: list[tuple[float, float, int]] = []  # (x, right end, row)
        for m in marks:
            x = m["x"]
            self.vline(x, color, m.get("width", 1.2), m.get("dash"), m.get("tip"))
            if m.get("label") is None:
                continue
            end = x + (span if span is not None else (text_width(m["label"], 9) + 8) * scale)
            taken = {r for a, b, r in placed if a < end and x < b}
            row = next(r for r in range(len(placed) + 1) if r not in taken)
            placed.append((x, end, row))
            tip = f"<title>{esc(m['tip'])}</title>" if m.get("tip") else ""
            self.items.append(("text", x, top, str(m["label"]), 9, "start", color, 3,
                               10 + 11 * row, "", tip))

    def vspan(self, x0, x1, fill: str = "#adb5bd", opacity: float = 0.3, tip: str | None = None) -> None:
        self.items.append(("vspan", x0, x1, fill, opacity, tip))

    def key(self, label: str, color: str, kind: str = "rect") -> None:
        """A legend entry; kind: rect, line, dash, dot or hatch."""
        self.legend.append((label, color, kind))

    def hatch(self) -> str:
        """The fill reference of a white diagonal hatch to draw over a coloured rectangle."""
        pid = self.prefix + "hatch"
        if not any(pid in d for d in self.defs):
            self.defs.append(f'<pattern id="{pid}" patternUnits="userSpaceOnUse" width="6" height="6" '
                             f'patternTransform="rotate(45)"><rect width="2" height="6" fill="#fff"/></pattern>')
        return f"url(#{pid})"

    # layout and rendering
    def _tick_list(self, axis: str) -> list[tuple[float, str]]:
        given = self.xticks if axis == "x" else self.yticks
        if given is not None:
            return [(v, short(lab)) for v, lab in given]
        lo, hi = (self.x0, self.x1) if axis == "x" else (self.y0, self.y1)
        lo, hi = min(lo, hi), max(lo, hi)
        if (self.xlog if axis == "x" else self.ylog):
            ts = log_ticks(lo, hi)
            return [(t, log_label(t)) for t in ts]
        ts = nice_ticks(lo, hi, 6 if axis == "x" else 5)
        fmt = self.yfmt if axis == "y" else None
        return list(zip(ts, [fmt(t) for t in ts] if fmt else linear_labels(ts)))

    def _legend_size(self) -> tuple[float, float]:
        """(width, height) of a legend at the right; at the bottom the height comes from
        _legend_rows once the plot's width is known."""
        if not self.legend:
            return 0, 0
        w = 26 + max(text_width(label) for label, _, _ in self.legend)
        return w + 10, 16 * len(self.legend) + 6

    def _legend_rows(self) -> list[list[tuple[str, str, str]]]:
        """Bottom legend entries packed into rows no wider than the plot."""
        rows: list[list] = [[]]
        used = 0.0
        for entry in self.legend:
            w = 26 + text_width(entry[0]) + 14
            if rows[-1] and used + w > self.pw:
                rows.append([])
                used = 0.0
            rows[-1].append(entry)
            used += w
        return rows

    def render(self) -> str:
        yt = self._tick_list("y")
        xt = self._tick_list("x")
        title_lines = [t for t in str(self.title).split("\n") if t] if self.title else []
        ylab_w = max((text_width(lab, self.ytick_size) for _, lab in yt), default=0)
        left = 10 + ylab_w + 6 + (18 if self.ylabel else 0)
        right = 14
        leg_w, leg_h = self._legend_size()
        if self.legend and self.legend_at == "right":
            right += leg_w
        if self.side:
            right += self.side[0]
        self.pw = max(60.0, self.width - left - right)
        # x tick labels: horizontal when they fit, else vertical; thinned if even that is too dense
        rotate = False
        if xt:
            slot = self.pw / max(len(xt), 1)
            widest = max(text_width(lab, self.xtick_size) for _, lab in xt)
            if widest + 4 > slot:
                rotate = True
                every = max(1, math.ceil((self.xtick_size + 1) / max(slot, 1e-9)))
                xt = xt[::every]
        xlab_h = (max(text_width(lab, self.xtick_size) for _, lab in xt) + 6) if rotate and xt else self.xtick_size + 6
        top = 8 + 16 * len(title_lines)
        bottom = 6 + xlab_h + (18 if self.xlabel else 0)
        if self.legend and self.legend_at == "bottom":
            bottom += 18 * len(self._legend_rows()) + 6
        height = top + self.plot_h + bottom
        if self.legend and self.legend_at == "right":
            height = max(height, top + leg_h)
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {num(self.width)} {num(height)}" '
               f'width="{num(self.width)}" height="{num(height)}" font-size="{FONT}" fill="{TEXT}">']
        if self.defs:
            out.append("<defs>" + "".join(self.defs) + "</defs>")
        cx = left + self.pw / 2
        for i, line in enumerate(title_lines):
            out.append(f'<text x="{num(cx)}" y="{num(20 + 16 * i)}" text-anchor="middle" font-size="12" '
                       f'font-weight="600">{esc(line)}</text>')
        # grid and ticks
        g = [f'<g transform="translate({num(left)},{num(top)})">']
        for v, lab in yt:
            y = self.sy(v)
            if not -0.5 <= y <= self.plot_h + 0.5:
                continue
            if self.grid in ("y", "both"):
                g.append(f'<line x1="0" x2="{num(self.pw)}" y1="{num(y)}" y2="{num(y)}" stroke="{GRID}"/>')
            g.append(f'<line x1="-4" x2="0" y1="{num(y)}" y2="{num(y)}" stroke="{AXIS}"/>'
                     f'<text x="-7" y="{num(y)}" text-anchor="end" dominant-baseline="central" '
                     f'font-size="{num(self.ytick_size)}">{esc(lab)}</text>')
        for v, lab in xt:
            x = self.sx(v)
            if not -0.5 <= x <= self.pw + 0.5:
                continue
            if self.grid in ("x", "both"):
                g.append(f'<line x1="{num(x)}" x2="{num(x)}" y1="0" y2="{num(self.plot_h)}" stroke="{GRID}"/>')
            h = self.plot_h
            g.append(f'<line x1="{num(x)}" x2="{num(x)}" y1="{num(h)}" y2="{num(h + 4)}" stroke="{AXIS}"/>')
            if rotate:
                g.append(f'<text transform="translate({num(x)},{num(h + 7)}) rotate(-90)" text-anchor="end" '
                         f'dominant-baseline="central" font-size="{num(self.xtick_size)}">{esc(lab)}</text>')
            else:
                g.append(f'<text x="{num(x)}" y="{num(h + 6 + self.xtick_size)}" text-anchor="middle" '
                         f'font-size="{num(self.xtick_size)}">{esc(lab)}</text>')
        # the data, clipped to the plot area
        g.append(f'<svg width="{num(self.pw)}" height="{num(self.plot_h)}" overflow="hidden"'
                 + (' shape-rendering="crispEdges">' if self.crisp else ">"))
        g.extend(self._item(it) for it in self.items)
        g.append("</svg>")
        g.append(f'<rect width="{num(self.pw)}" height="{num(self.plot_h)}" fill="none" stroke="{AXIS}"/>')
        if self.xlabel:
            g.append(f'<text x="{num(self.pw / 2)}" y="{num(self.plot_h + xlab_h + 18)}" '
                     f'text-anchor="middle">{esc(self.xlabel)}</text>')
        if self.ylabel:
            g.append(f'<text transform="translate({num(-left + 12)},{num(self.plot_h / 2)}) rotate(-90)" '
                     f'text-anchor="middle">{esc(self.ylabel)}</text>')
        g.append(self._legend(xlab_h))
        if self.side:
            x0 = self.pw + 14 + (leg_w if self.legend and self.legend_at == "right" else 0)
            g.append(self.side[1](x0, 0, self.plot_h))
        g.append("</g>")
        out.extend(g)
        out.append("</svg>")
        return "".join(out)

    def _legend(self, xlab_h: float) -> str:
        if not self.legend:
            return ""
        out = []
        if self.legend_at == "right":
            for i, (label, color, kind) in enumerate(self.legend):
                out.append(f'<g transform="translate({num(self.pw + 14)},{num(4 + 16 * i)})">'
                           f'{self._swatch(color, kind)}<text x="24" y="6" dominant-baseline="central">'
                           f'{esc(label)}</text></g>')
            return "".join(out)
        y = self.plot_h + xlab_h + (18 if self.xlabel else 0) + 12
        for row in self._legend_rows():
            x = max(0.0, (self.pw - sum(26 + text_width(label) + 14 for label, _, _ in row) + 14) / 2)
            for label, color, kind in row:
                out.append(f'<g transform="translate({num(x)},{num(y)})">{self._swatch(color, kind)}'
                           f'<text x="24" y="6" dominant-baseline="central">{esc(label)}</text></g>')
                x += 26 + text_width(label) + 14
            y += 18
        return "".join(out)

    def _swatch(self, color: str, kind: str) -> str:
        if kind == "line":
            return f'<line x1="0" x2="18" y1="6" y2="6" stroke="{color}" stroke-width="2"/>'
        if kind == "dash":
            return f'<line x1="0" x2="18" y1="6" y2="6" stroke="{color}" stroke-width="2" stroke-dasharray="4 2"/>'
        if kind == "dot":
            return f'<circle cx="9" cy="6" r="4" fill="{color}"/>'
        if kind == "hatch":
            return (f'<rect width="18" height="12" fill="{color}"/>'
                    f'<rect width="18" height="12" fill="{self.hatch()}"/>')
        return f'<rect width="18" height="12" fill="{color}"/>'

    def _item(self, it: tuple) -> str:
        kind = it[0]
        if kind == "rect":
            _, x0, x1, y0, y1, fill, tip, extra = it
            ax, bx, ay, by = self.sx(x0), self.sx(x1), self.sy(y0), self.sy(y1)
            x, w = min(ax, bx), abs(bx - ax)
            y, h = min(ay, by), abs(by - ay)
            body = f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" fill="{fill}"{extra}'
            return body + (f"><title>{esc(tip)}</title></rect>" if tip else "/>")
        if kind == "line":
            _, xs, ys, color, width, dash, tip = it
            pts = _thin([(x, y) for x, y in zip(xs, ys)])
            runs, cur = [], []
            for x, y in pts:
                fx, fy = finite(x), finite(y)
                if fx is None or fy is None or (self.ylog and fy <= 0) or (self.xlog and fx <= 0):
                    if cur:
                        runs.append(cur)
                    cur = []
                    continue
                cur.append(f"{num(self.sx(fx))},{num(self.sy(fy))}")
            if cur:
                runs.append(cur)
            d = f' stroke-dasharray="{dash}"' if dash else ""
            t = f"<title>{esc(tip)}</title>" if tip else ""
            return "".join(f'<polyline points="{" ".join(r)}" fill="none" stroke="{color}" '
                           f'stroke-width="{width}" stroke-linejoin="round"{d}>{t}</polyline>'
                           for r in runs if len(r) > 1)
        if kind == "dots":
            _, xs, ys, color, r, tips, opacity = it
            out = []
            op = f' fill-opacity="{opacity}"' if opacity < 1 else ""
            for i, (x, y) in enumerate(zip(xs, ys)):
                fx, fy = finite(x), finite(y)
                if fx is None or fy is None:
                    continue
                rad = r[i] if isinstance(r, (list, tuple)) else r
                tip = tips[i] if tips and i < len(tips) else None
                body = (f'<circle cx="{num(self.sx(fx))}" cy="{num(self.sy(fy))}" r="{num(rad)}" '
                        f'fill="{color}"{op}')
                out.append(body + (f"><title>{esc(tip)}</title></circle>" if tip else "/>"))
            return "".join(out)
        if kind == "text":
            _, x, y, s, size, anchor, color, dx, dy, extra, *tip = it
            return (f'<text x="{num(self.sx(x) + dx)}" y="{num(self.sy(y) + dy)}" font-size="{num(size)}" '
                    f'text-anchor="{anchor}" fill="{color}"{extra}>{esc(s)}{tip[0] if tip else ""}</text>')
        if kind in ("vline", "hline"):
            _, v, color, width, dash, tip = it
            d = f' stroke-dasharray="{dash}"' if dash else ""
            if kind == "vline":
                x = num(self.sx(v))
                line = (f'<line x1="{x}" x2="{x}" y1="0" y2="{num(self.plot_h)}" stroke="{color}" '
                        f'stroke-width="{width}"{d}/>')
                if not tip:
                    return line
                return (f'<g>{line}<line x1="{x}" x2="{x}" y1="0" y2="{num(self.plot_h)}" '
                        f'stroke="{color}" stroke-opacity="0" stroke-width="7"/>'
                        f'<title>{esc(tip)}</title></g>')
            y = num(self.sy(v))
            return f'<line x1="0" x2="{num(self.pw)}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="{width}"{d}/>'
        if kind == "vspan":
            _, x0, x1, fill, opacity, tip = it
            a, b = sorted((self.sx(x0), self.sx(x1)))
            body = (f'<rect x="{num(a)}" y="0" width="{num(b - a)}" height="{num(self.plot_h)}" fill="{fill}" '
                    f'fill-opacity="{opacity}"')
            return body + (f"><title>{esc(tip)}</title></rect>" if tip else "/>")
        raise ValueError(kind)


def _thin(pts: list[tuple]) -> list[tuple]:
    """A long series reduced to the first, the smallest, the largest and the last point of each of
    MAX_POINTS // 4 buckets (in order): the shape, peaks included, at a bounded size."""
    if len(pts) <= MAX_POINTS:
        return pts
    k = math.ceil(len(pts) / (MAX_POINTS // 4))
    out = []
    for i in range(0, len(pts), k):
        chunk = pts[i:i + k]
        vals = [(j, p) for j, p in enumerate(chunk) if finite(p[1]) is not None]
        if not vals:
            out.append((chunk[0][0], None))  # a gap stays a gap
            continue
        lo = min(vals, key=lambda jp: jp[1][1])[0]
        hi = max(vals, key=lambda jp: jp[1][1])[0]
        out.extend(chunk[j] for j in sorted({vals[0][0], lo, hi, vals[-1][0]}))
    return out


def figure(svgs: str | Iterable[str], alt: str = "") -> str:
    """One or more rendered plots side by side as a captioned figure."""
    if isinstance(svgs, str):
        svgs = [svgs]
    body = "".join(s.replace("<svg ", f'<svg role="img" aria-label="{esc(alt)}" ', 1) for s in svgs)
    return f'<figure class="plot"><div class="plots">{body}</div><figcaption>{esc(alt)}</figcaption></figure>'


def extent(values: Iterable, zero: bool = True, pad: float = 0.05, log: bool = False) -> tuple[float, float]:
    """The range to draw the finite values in: from 0 (zero=True) or the smallest, padded."""
    vals = [float(x) for x in values
            if ((t := type(x)) is float or t is int or (t is not bool and isinstance(x, (int, float))))
            and math.isfinite(x) and (not log or x > 0)]
    if not vals:
        return (1.0, 10.0) if log else (0.0, 1.0)
    lo, hi = min(vals), max(vals)
    if log:
        return lo / 10 ** (pad * 4), hi * 10 ** (pad * 4)
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi == lo:
        return (lo - 1, hi + 1) if lo else (0.0, 1.0)
    span = hi - lo
    return (lo if zero and lo == 0 else lo - pad * span), (hi if zero and hi == 0 else hi + pad * span)


def category_ticks(labels: Sequence) -> list[tuple[float, str]]:
    return [(i, str(label)) for i, label in enumerate(labels)]


# --- heatmap ------------------------------------------------------------------------------------

MAX_COLS = 120  # columns of a heatmap drawn as is; more are binned (the largest of each bin)
MAX_CELLS = 2400  # and at most about this many cells (~140 bytes each with its tooltip)


def bin_columns(matrix: list[list[float]], col_labels: list, max_cols: int = MAX_COLS):
    """(matrix, labels, k): columns in bins of k consecutive ones, a cell the bin's largest finite
    value (a spike in one step stays visible), labelled first–last."""
    width = len(col_labels)
    if width <= max_cols:
        return matrix, list(col_labels), 1
    k = math.ceil(width / max_cols)
    out = []
    for row in matrix:
        cells = []
        for i in range(0, width, k):
            vals = [v for v in row[i:i + k] if finite(v) is not None]
            cells.append(max(vals) if vals else math.nan)
        out.append(cells)
    labels = [f"{col_labels[i]}–{col_labels[min(i + k, width) - 1]}" for i in range(0, width, k)]
    return out, labels, k


def heatmap(matrix, row_labels: list, col_labels: list, title: str, cbar_label: str = "",
            alt: str | None = None, separator: int | None = None, vmin: float | None = None,
            vmax: float | None = None, row_tips: Sequence[str] | None = None, col_name: str = "",
            fmt: Callable[[float], str] | None = None, width: int = 780, row_name: str = "",
            marks: Sequence[dict] = (), mark_colour: str = "#d9480f") -> str:
    """A rows × columns heatmap (viridis; NaN cells blank) as an inline figure with a colour bar.
    separator: a line under that many top rows; vmin/vmax: the colour scale (cells beyond it
    saturate, the bar gets an arrow at that end). Each cell's tooltip: "<col_name> <column>,
    <row>: <value>" with the row as row_tips names it (default: its label). marks: event
    markers (Plot.marks) at x in column units (column j spans j − 0.5 .. j + 0.5)."""
    m = [[(finite(v) if finite(v) is not None else math.nan) for v in row] for row in matrix]
    ncols = max([len(col_labels)] + [len(r) for r in m]) if m else 0
    m = [r + [math.nan] * (ncols - len(r)) for r in m]
    cols = list(col_labels) + [""] * (ncols - len(col_labels))
    m, cols, k = bin_columns(m, cols, min(MAX_COLS, max(12, MAX_CELLS // max(len(m), 1))))
    nrows, ncols = len(m), len(cols)
    fmt = fmt or (lambda v: f"{v:,.4g}")
    vals = [v for r in m for v in r if not math.isnan(v)]
    lo = vmin if vmin is not None else (min(vals) if vals else 0.0)
    hi = vmax if vmax is not None else (max(vals) if vals else 1.0)
    over = vmax is not None and vals and max(vals) > vmax
    under = vmin is not None and vals and min(vals) < vmin
    row_h = 22 if nrows <= 12 else 14 if nrows <= 32 else 11
    tick_size = FONT if nrows <= 32 else 9
    step = max(1, math.ceil(ncols / 20))
    xticks = [(i, str(c)) for i, c in enumerate(cols)][::step]
    if k > 1:
        title += f"\n(each column: the largest of {k} consecutive {col_name or 'column'}s)"
    p = Plot((-0.5, ncols - 0.5), (nrows - 0.5, -0.5), width=width, height=row_h * max(nrows, 1),
             title=title, xticks=xticks, yticks=[(i, str(r)) for i, r in enumerate(row_labels)],
             grid=None, xlabel=col_name, ylabel=row_name, ytick_size=tick_size,
             xtick_size=min(FONT, 10), crisp=True)
    for i, row in enumerate(m):
        rname = (row_tips[i] if row_tips and i < len(row_tips)
                 else row_labels[i] if i < len(row_labels) else "")
        for j, v in enumerate(row):
            if math.isnan(v):
                continue
            tip = f"{col_name + ' ' if col_name else ''}{cols[j]}, {rname}: {fmt(v)}"
            p.rect(j - 0.5, j + 0.5, i - 0.5, i + 0.5, scaled_colour(v, lo, hi), tip)
    if separator:
        p.hline(separator - 0.5, "#fff", 3)
        p.hline(separator - 0.5, "#000", 1)
    if marks:  # (columns binned k at a time: x in the binned columns' units)
        p.marks([{**m, "x": (m["x"] + 0.5) / k - 0.5} for m in marks], -0.5, mark_colour)
    gid = p.prefix + "cbar"
    stops = "".join(f'<stop offset="{i / (len(VIRIDIS) - 1):.3f}" stop-color="{c}"/>'
                    for i, c in enumerate(reversed(VIRIDIS)))
    p.defs.append(f'<linearGradient id="{gid}" x1="0" x2="0" y1="0" y2="1">{stops}</linearGradient>')
    ticks = [t for t in nice_ticks(lo, hi, 5) if lo <= t <= hi]
    labels = linear_labels(ticks)
    lab_w = max((text_width(s) for s in labels), default=0)

    def colour_bar(x0: float, y0: float, h: float) -> str:
        bh = max(min(h, 320.0), 60.0)
        arrow = 9.0
        top, bar = y0 + (arrow if over else 0), bh - (arrow if over else 0) - (arrow if under else 0)
        out = [f'<rect x="{num(x0)}" y="{num(top)}" width="16" height="{num(bar)}" fill="url(#{gid})" '
               f'stroke="{AXIS}" stroke-width="0.5"/>']
        if over:
            out.append(f'<path d="M{num(x0)},{num(top)}L{num(x0 + 8)},{num(y0)}L{num(x0 + 16)},{num(top)}Z" '
                       f'fill="{VIRIDIS[-1]}"><title>cells above {esc(fmt(hi))}</title></path>')
        if under:
            b = top + bar
            out.append(f'<path d="M{num(x0)},{num(b)}L{num(x0 + 8)},{num(b + arrow)}L{num(x0 + 16)},{num(b)}Z" '
                       f'fill="{VIRIDIS[0]}"><title>cells below {esc(fmt(lo))}</title></path>')
        for t, s in zip(ticks, labels):
            y = top + bar * (1 - ((t - lo) / (hi - lo) if hi > lo else 0.5))
            out.append(f'<line x1="{num(x0 + 16)}" x2="{num(x0 + 20)}" y1="{num(y)}" y2="{num(y)}" stroke="{AXIS}"/>'
                       f'<text x="{num(x0 + 23)}" y="{num(y)}" dominant-baseline="central">{esc(s)}</text>')
        if cbar_label:
            out.append(f'<text transform="translate({num(x0 + 36 + lab_w * 1.1)},{num(top + bar / 2)}) rotate(-90)" '
                       f'text-anchor="middle">{esc(cbar_label)}</text>')
        return "".join(out)

    p.side = (40 + lab_w * 1.1 + (18 if cbar_label else 0), colour_bar)
    return figure(p.render(), alt or title.replace("\n", " "))
