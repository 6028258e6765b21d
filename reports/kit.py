"""Building blocks for report sections: escaped HTML fragments, tables, inline SVG figures.

Sections build their fragments only from these helpers, so every text that came from a run
(rank hosts, module paths, messages) is escaped exactly once and nothing loads from a network.
"""

from __future__ import annotations

import html
import io
import itertools
import math
import re
from typing import Any, Callable, Iterable, Mapping

_fig_ids = itertools.count()


def esc(x: Any) -> str:
    """HTML-escape str(x) (quotes included); None becomes an empty string."""
    return "" if x is None else html.escape(str(x), quote=True)


def _num(x) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def fmt_ms(x) -> str:
    v = _num(x)
    if v is None:
        return "—"
    if abs(v) >= 10_000:
        return f"{v / 1e3:.1f} s"
    if abs(v) >= 100:
        return f"{v:.0f} ms"
    if abs(v) >= 1:
        return f"{v:.1f} ms"
    return f"{v * 1e3:.0f} µs"


def fmt_bytes(x) -> str:
    v = _num(x)
    if v is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"  # unreachable


def fmt_pct(x) -> str:
    """x is a fraction (0.25 → '25.0 %')."""
    v = _num(x)
    return "—" if v is None else f"{100 * v:.1f} %"


def fmt_value(x) -> str:
    """Default cell formatting: compact floats, lists joined, dicts as k=v."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "—"
        if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-3):
            return f"{x:.3g}"
        return f"{x:,.3f}".rstrip("0").rstrip(".") if abs(x) < 1000 else f"{x:,.1f}"
    if isinstance(x, int):
        return f"{x:,}" if abs(x) >= 10_000 else str(x)
    if isinstance(x, Mapping):
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in x.items())
    if isinstance(x, (list, tuple)):
        shown = ", ".join(fmt_value(v) for v in list(x)[:20])
        return shown + (f" … and {len(x) - 20:,} more" if len(x) > 20 else "")
    return str(x)


def para(text: Any, cls: str | None = None) -> str:
    c = f' class="{esc(cls)}"' if cls else ""
    return f"<p{c}>{esc(text)}</p>"


def kv(mapping: Mapping, fmt: Mapping[str, Callable] | None = None) -> str:
    """A two-column key/value table."""
    fmt = fmt or {}
    rows = []
    for k, v in mapping.items():
        f = fmt.get(k, fmt_value)
        rows.append(f"<tr><th>{esc(k)}</th><td>{esc(_safe_fmt(f, v))}</td></tr>")
    return f'<table class="kv">{"".join(rows)}</table>'


def _safe_fmt(f, v) -> str:
    try:
        return f(v)
    except Exception:  # noqa: BLE001 - a formatter choking on odd data must not lose the table
        return fmt_value(v)


def table(rows: Iterable[Mapping], columns: list[tuple[str, str]] | None = None,
          fmt: Mapping[str, Callable] | None = None, max_rows: int = 200, what: str = "rows",
          extra_rows: Iterable[str] = ()) -> str:
    """A data table. columns = [(key, label)] (default: the union of the rows' keys, in order);
    rows past max_rows are left out with a note saying how many (`what`: "rows", "ranks", ...).
    extra_rows: ready-made <tr> fragments appended to the body (a summary row)."""
    rows = [r for r in rows if isinstance(r, Mapping)]
    if columns is None:
        keys: dict[str, None] = {}
        for r in rows[:max_rows]:
            keys.update(dict.fromkeys(r))
        columns = [(k, k) for k in keys]
    fmt = fmt or {}
    head = "".join(f"<th>{esc(label)}</th>" for _, label in columns)
    body = []
    for r in rows[:max_rows]:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            cls = ' class="num"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            cells.append(f"<td{cls}>{esc(_safe_fmt(fmt.get(key, fmt_value), v))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    note = ""
    if len(rows) > max_rows:
        note = para(f"… {len(rows) - max_rows:,} more {what} not shown (of {len(rows):,}); "
                    "full data in summary.json.", "note")
    return (f'<div class="tablewrap"><table class="data"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}{''.join(extra_rows)}</tbody></table></div>{note}")


def plt():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    # Text stays <text> in the SVG (the page's own fonts): a fraction of the size and the
    # rendering time of glyphs drawn as paths.
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as pyplot

    return pyplot


_ID_RE = re.compile(r'\bid="([^"]+)"')


def figure(fig, alt: str = "") -> str:
    """Embed a matplotlib figure as inline SVG (ids made unique per figure) and close it."""
    pyplot = plt()
    buf = io.StringIO()
    try:
        fig.savefig(buf, format="svg", bbox_inches="tight")
    finally:
        pyplot.close(fig)
    svg = buf.getvalue()
    start = svg.find("<svg")
    svg = svg[start:] if start >= 0 else svg
    # matplotlib names clip paths and glyphs with ids local to one file: two SVGs on one page
    # would reference each other's definitions, so every id (and its references) gets a prefix.
    prefix = f"f{next(_fig_ids)}-"
    ids = set(_ID_RE.findall(svg))
    if ids:
        pattern = re.compile(r'(id="|#)(' + "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True)) + r')(?=["\)])')
        svg = pattern.sub(lambda m: m.group(1) + prefix + m.group(2), svg)
    svg = svg.replace("<svg ", f'<svg role="img" aria-label="{esc(alt)}" ', 1)
    return f'<figure class="plot">{svg}<figcaption>{esc(alt)}</figcaption></figure>'


def heatmap(matrix, row_labels: list, col_labels: list, title: str, cbar_label: str = "",
            alt: str | None = None, cmap: str = "viridis", separator: int | None = None,
            vmin: float | None = None, vmax: float | None = None) -> str:
    """A rows × columns heatmap (NaN cells blank) as an inline figure; `separator`: a line drawn
    under that many top rows; vmin/vmax: the colour scale (cells beyond it saturate)."""
    import numpy as np

    pyplot = plt()
    m = np.asarray(matrix, dtype=float)
    h = min(0.28 * max(len(row_labels), 1) + 1.4, 9 if len(row_labels) <= 40 else 12)
    fig, ax = pyplot.subplots(figsize=(7.5, h))
    im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", cmap=cmap, interpolation="nearest",
                   vmin=vmin, vmax=vmax)
    ax.set_yticks(range(len(row_labels)))
    ax.set_yticklabels([str(r) for r in row_labels], fontsize=7)
    step = max(1, len(col_labels) // 20)
    ax.set_xticks(range(0, len(col_labels), step))
    ax.set_xticklabels([str(c) for c in col_labels[::step]], fontsize=7)
    ax.set_title(title, fontsize=9)
    if separator:
        ax.axhline(separator - 0.5, color="white", linewidth=2.5)
        ax.axhline(separator - 0.5, color="black", linewidth=1)
    finite = m[np.isfinite(m)]
    over = vmax is not None and finite.size and finite.max() > vmax
    under = vmin is not None and finite.size and finite.min() < vmin
    cb = fig.colorbar(im, ax=ax, extend={(True, True): "both", (True, False): "max",
                                         (False, True): "min"}.get((bool(over), bool(under)), "neither"))
    cb.set_label(cbar_label, fontsize=8)
    return figure(fig, alt or title)
