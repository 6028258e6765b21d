"""Building blocks for report sections: escaped HTML fragments, tables, number formats.

Sections build their fragments only from these helpers and the charts of trainprof.reports.svg,
so every text that came from a run (rank hosts, module paths, messages) is escaped exactly once
and nothing loads from a network.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable, Mapping

from trainprof.wording import wall_time


# control characters and the format characters that reorder or hide text (bidi overrides and
# isolates, zero-width marks): shown as visible escapes, as the terminal shows them
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e"
                          "\u2060-\u2069\ufeff]")


def _visible(m) -> str:
    return m.group().encode("unicode_escape").decode("ascii")


def esc(x: Any) -> str:
    """HTML-escape str(x) (quotes included), as html.escape(quote=True) does (that module's
    import builds the entity tables: milliseconds of start-up), with control and bidi
    characters shown as escapes (a right-to-left override in an op name cannot reorder the
    report's text); None becomes an empty string."""
    if x is None:
        return ""
    s = _UNPRINTABLE.sub(_visible, str(x))
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#x27;"))


def median(values: Iterable) -> Any:
    """statistics.median (the middle value, or the mean of the two middle ones) without that
    module's import (it brings fractions and decimal). ValueError for no values."""
    data = sorted(values)
    n = len(data)
    if not n:
        raise ValueError("no median of no values")
    return data[n // 2] if n % 2 else (data[n // 2 - 1] + data[n // 2]) / 2


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


EPOCH_NS_MIN = 10 ** 17  # a time in ns since the epoch is after 1973: larger than any duration here


def fmt_wall_ns(x) -> str:
    """A wall-clock time in ns since the epoch as '2026-11-25 13:37:59.123 UTC'."""
    return wall_time(x) or fmt_value(x)


def _default_fmt(key) -> Callable:
    """fmt_value, except for epoch timestamps (keys ending in _ns, e.g. detected_ns, t_ns)."""
    if isinstance(key, str) and key.endswith("_ns"):
        return lambda v: fmt_wall_ns(v) if (isinstance(v, (int, float)) and not isinstance(v, bool)
                                            and EPOCH_NS_MIN <= v < 10 ** 20) else fmt_value(v)
    return fmt_value


def kv(mapping: Mapping, fmt: Mapping[str, Callable] | None = None) -> str:
    """A two-column key/value table."""
    fmt = fmt or {}
    rows = []
    for k, v in mapping.items():
        f = fmt.get(k) or _default_fmt(k)
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
            cells.append(f"<td{cls}>{esc(_safe_fmt(fmt.get(key) or _default_fmt(key), v))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    note = ""
    if len(rows) > max_rows:
        note = para(f"… {len(rows) - max_rows:,} more {what} not shown (of {len(rows):,}); "
                    "full data in summary.json.", "note")
    return (f'<div class="tablewrap"><table class="data"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}{''.join(extra_rows)}</tbody></table></div>{note}")


def _dim_text(k, v) -> str:
    return f"{k}={v}" if str(k)[-1:].isdigit() else f"{k}{v}"  # dim0=1, not dim01


def coord_text(coords) -> str:
    """Mesh coordinates as "dp1 pp0 tp1" (an unnamed mesh's dim: "dim0=1")."""
    return " ".join(_dim_text(k, v) for k, v in coords.items()) if isinstance(coords, Mapping) else ""


def mesh_text(sizes) -> str:
    """Mesh sizes as "dp2·pp1·tp1" (an unnamed mesh's dim: "dim0=2")."""
    return "·".join(_dim_text(k, v) for k, v in sizes.items()) if isinstance(sizes, Mapping) else ""


def input_problems(summary: Mapping) -> list:
    """The summary's problems but the coverage line (what bare traces cannot give, shown on its
    own): what could not be (fully) read or analyzed."""
    cover = summary.get("coverage")
    text = cover.get("text") if isinstance(cover, Mapping) else None
    return [p for p in (summary.get("problems") or []) if p != text]


def _n(x) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def input_label(run: Mapping) -> str:
    """What was analyzed: the run directory, or for bare traces the one file or folder analyzed
    (several: the folder they were found in)."""
    inp = run.get("input")
    given = inp.get("inputs") if isinstance(inp, Mapping) else None
    if isinstance(given, list) and len(given) == 1 and str(given[0]) not in (".", "./", ""):
        return str(given[0])
    return str(run.get("dir") or "")


def input_text(inp: Mapping) -> str:
    """How much of a bare-trace input was analyzed (summary run.input), in one line: files,
    windows read, and every part left out (unreadable, other windows, another job's files,
    JSON that is no trace, stub steps)."""
    parts = [f"{inp.get('files', '?')} trace file(s), {inp.get('traces_read', '?')} read"]
    for key, what in (("unreadable", "unreadable"), ("older_windows_skipped", "earlier window(s) left out"),
                      ("later_windows_skipped", "later window(s) left out"),
                      ("other_job_files", "file(s) of another job left out"),
                      ("not_traces", "JSON file(s) not traces"),
                      ("stub_steps_dropped", "empty trailing step(s) dropped over the ranks")):
        if _n(inp.get(key)):
            parts.append(f"{inp[key]} {what}")
    return (f"input: {', '.join(parts)}; {inp.get('ranks', '?')} rank(s), "
            f"{inp.get('steps', '?')} profiled step(s)"
            + (" (whole-trace windows: no ProfilerStep)" if inp.get("whole_trace_windows") else ""))
