"""Per-rank views that read at any world size: capped rank lists, worst-first tables, charts that
aggregate by host above a few dozen ranks with the outliers kept individually.

Up to MAX_RANKS ranks every view shows every rank, as is. Above it a table shows the TOP worst
rows (by a key the section names) and a median row over all ranks, and says how many rows it
left out; a chart draws one row or bar per host (or per block of hosts or ranks), the median of
its ranks, plus the OUTLIERS ranks farthest from the job's median (and any rank a finding names)
drawn individually. Display only: the numbers are the summary's, sorted, capped and summarized.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Callable, Iterable, Mapping

from trainprof.rankranges import rank_list  # noqa: F401 - the one rank-list formatter, used here as rk.rank_list
from trainprof.reports import kit, svg

MAX_RANKS = 64  # up to this many ranks, every per-rank view shows every rank
TOP = 20  # rows of a capped per-rank table
OUTLIERS = 8  # ranks drawn individually beside an aggregated chart
MAX_GROUPS = 64  # rows (bars) of an aggregated chart


_ITEM = r"\d+(?:[–-]\d+)?"  # a rank or a range of ranks
_NUM_LIST = re.compile(rf"(?<![\d.,–-]){_ITEM}(?:, {_ITEM}){{11,}}(?![\d–-]|\.\d)")


def cap_numbers(text: Any, keep: int = 8) -> str:
    """Long comma-separated lists of integers or ranges inside a message (rank lists) capped to
    `keep` items."""
    if text is None:
        return ""

    def cap(m: re.Match) -> str:
        items = m.group(0).split(", ")
        return ", ".join(items[:keep]) + f" … and {len(items) - keep:,} more"

    return _NUM_LIST.sub(cap, str(text))


def hosts(summary: Mapping) -> dict[int, str]:
    out = {}
    run = summary.get("run") if isinstance(summary, Mapping) else None
    for r in (run.get("ranks") if isinstance(run, Mapping) else None) or []:
        if isinstance(r, Mapping) and isinstance(r.get("rank"), int) and r.get("host") is not None:
            out[r["rank"]] = str(r["host"])
    return out


def _num(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) else float(x)


def _median_row(rows: list[Mapping], columns: list[tuple[str, str]], fmt: Mapping, label: str) -> str:
    cells = []
    for i, (key, _) in enumerate(columns):
        vals = [v for v in (_num(r.get(key)) for r in rows) if v is not None]
        if i == 0:
            cells.append(f"<td>{kit.esc(label)}</td>")
        elif vals and len(vals) * 2 >= len(rows) and all(
                isinstance(r.get(key), (int, float)) or r.get(key) is None for r in rows):
            f = fmt.get(key, kit.fmt_value)
            try:
                txt = f(kit.median(vals))
            except Exception:  # noqa: BLE001 - a formatter choking must not lose the table
                txt = kit.fmt_value(kit.median(vals))
            cells.append(f'<td class="num">{kit.esc(txt)}</td>')
        else:
            cells.append("<td></td>")
    return f'<tr class="agg">{"".join(cells)}</tr>'


def rank_table(rows: Iterable[Mapping], columns: list[tuple[str, str]], fmt: Mapping | None = None,
               worst: Callable[[Mapping], Any] | None = None, worst_label: str = "",
               pinned: Iterable = (), top: int = TOP, limit: int = MAX_RANKS,
               what: str = "ranks") -> str:
    """A per-rank table. Up to `limit` rows: every row, in the given order. Above: the rows of
    the `pinned` ranks (those a finding names; the worst `top` of them), then the worst others
    by `worst(row)` (higher is worse, None last) up to `top` rows, a median row over every row,
    and a note of how many are not shown."""
    rows = [r for r in rows if isinstance(r, Mapping)]
    fmt = fmt or {}
    if len(rows) <= limit:
        return kit.table(rows, columns, fmt, max_rows=max(len(rows), 1), what=what)

    def key(r):
        v = _num(worst(r)) if worst else None
        return (v is None, -(v or 0.0))

    pins = set(pinned or ())
    ordered = sorted(rows, key=lambda r: (r.get("rank") not in pins, *key(r)))
    n_top = top
    how = (f"the {n_top} worst by {worst_label}, worst first" if worst_label
           else f"the first {n_top}")
    if pins:
        how += " (ranks named by a finding first)"
    note = kit.para(f"{len(rows):,} {what}: {how}; the last row is the median over all "
                    f"{len(rows):,}.", "note")
    return note + kit.table(ordered, columns, fmt, max_rows=n_top, what=what,
                            extra_rows=[_median_row(rows, columns, fmt, f"median of {len(rows):,}")])


# --- charts -------------------------------------------------------------------------------------

def _as_list(v) -> list[float]:
    """A number or a series as floats, NaN for anything not a number (bool, None, text)."""
    vals = v if isinstance(v, (list, tuple)) else [v]
    return [float(y) if (t := type(y)) is float or t is int
            or (t is not bool and isinstance(y, (int, float))) else math.nan for y in vals]


def _column_medians(series: list[list[float]]) -> list[float]:
    """The median of each position over the series (NaN ignored; NaN where none has a value)."""
    out = []
    for col in itertools.zip_longest(*series, fillvalue=math.nan):
        vals = [x for x in col if x == x]
        out.append(kit.median(vals) if vals else math.nan)
    return out


def outliers(values: Mapping[int, Any], n: int = OUTLIERS, named: Iterable = ()) -> list[int]:
    """The ranks whose values (a number or a series per rank) lie farthest from the job's median
    (mean absolute distance over the series' positions); `named` ranks come first."""
    series = {r: _as_list(v) for r, v in values.items()}
    meds = _column_medians(list(series.values()))

    def dist(r):
        d = [abs(x - m) for x, m in zip(series[r], meds) if not math.isnan(x) and not math.isnan(m)]
        return sum(d) / len(d) if d else -1.0

    first = [r for r in dict.fromkeys(named) if r in series][:n]
    rest = sorted((r for r in series if r not in first), key=lambda r: (-dist(r), r))
    return first + rest[:max(0, n - len(first))]


def groups(ranks: Iterable[int], summary: Mapping, max_groups: int = MAX_GROUPS) -> tuple[list[tuple[str, list[int]]], str]:
    """Ranks grouped for a chart: by host (blocks of consecutive hosts when there are more than
    max_groups), else blocks of consecutive ranks. Returns ([(label, ranks)], what one row is)."""
    ranks = sorted(ranks)
    host = hosts(summary)
    order: list[str] = []
    members: dict[str, list[int]] = {}
    if ranks and all(r in host for r in ranks):
        for r in ranks:
            if host[r] not in members:
                order.append(host[r])
                members[host[r]] = []
            members[host[r]].append(r)
    if len(order) > 1:
        k = math.ceil(len(order) / max_groups)
        out = []
        for i in range(0, len(order), k):
            block = order[i:i + k]
            label = block[0] if len(block) == 1 else f"{block[0]}–{block[-1]}"
            out.append((label, [r for h in block for r in members[h]]))
        return out, "host" if k == 1 else f"{k} hosts"
    k = math.ceil(len(ranks) / max_groups)
    return ([(f"{ranks[i]}–{ranks[min(i + k, len(ranks)) - 1]}", ranks[i:i + k])
             for i in range(0, len(ranks), k)], f"{k} consecutive ranks")


def chart_rows(values: Mapping[int, Any], summary: Mapping, named: Iterable = (),
               limit: int = MAX_RANKS) -> tuple[list[tuple[str, list[int]]], int, str]:
    """Rows of a per-rank chart: ([(label, member ranks)], number of individual outlier rows at
    the top, a sentence saying what the rows are ('' when every rank has its own row)."""
    ranks = sorted(values)
    if len(ranks) <= limit:
        return [(str(r), [r]) for r in ranks], 0, ""
    host = hosts(summary)
    out = outliers(values, OUTLIERS, named)
    rows = [(f"rank {r}" + (f" ({host[r]})" if r in host else ""), [r]) for r in out]
    grouped, per = groups(ranks, summary)
    note = (f"{len(ranks):,} ranks: the first {len(out)} rows are single ranks (any a finding "
            f"names, then those farthest from the job's median); each row after the line is "
            f"the median of one {per}'s ranks.")
    return rows + grouped, len(out), note


def aggregate(values: Mapping[int, Any], members: list[int]):
    """The median of the members' values (numbers, or series position by position)."""
    vals = [values[r] for r in members if r in values]
    if not vals:
        return math.nan
    if len(vals) == 1:
        return vals[0]
    if all(isinstance(v, (list, tuple)) for v in vals):
        return _column_medians([_as_list(v) for v in vals])
    nums = [x for v in vals if (x := _num(v)) is not None]
    return kit.median(nums) if nums else math.nan


def rank_heatmap(by_rank: Mapping, col_labels: list, title: str, cbar_label: str, summary: Mapping,
                 alt: str, named: Iterable = (), scale_cols: Iterable[int] | None = None,
                 col_name: str = "step") -> str:
    """A rank × column heatmap: a row per rank up to MAX_RANKS ranks, else a row per host
    (median) under the outlier ranks' own rows. scale_cols: the columns (indices) the colour
    scale and the choice of outliers come from (the analysed steps: a warm-up or profiled step
    many times longer would wash out every other cell); the others are marked with a *."""
    width = len(col_labels)
    values = {}
    for r, v in (by_rank or {}).items():
        try:
            values[int(r)] = _as_list(v)[:width]
        except (TypeError, ValueError):
            continue
    if not values or not width:
        return ""
    keep = sorted({i for i in (scale_cols or ()) if 0 <= i < width})
    if len(keep) == width:
        keep = []
    pick = {r: [v[i] if i < len(v) else math.nan for i in keep] for r, v in values.items()} if keep else values
    rows, n_single, note = chart_rows(pick, summary, named)
    m = []
    for _, members in rows:
        v = aggregate(values, members)
        v = _as_list(v)
        m.append(v + [math.nan] * (width - len(v)))
    vmin = vmax = None
    labels = [str(c) for c in col_labels]
    if keep:
        scaled = [x for row in m for i in keep if not math.isnan(x := row[i])]
        if scaled:
            vmin, vmax = min(scaled), max(scaled)
            labels = [f"{c}" if i in keep else f"{c}*" for i, c in enumerate(col_labels)]
            title += "\n(* excluded from the statistics; colour scale from the analysed steps)"
    tips = [f"rank {label}" if not note else label if len(members) == 1
            else f"{label} (median of {len(members):,} ranks)" for label, members in rows]
    fig = svg.heatmap(m, [label for label, _ in rows], labels, title, cbar_label, alt=alt,
                      separator=n_single or None, vmin=vmin, vmax=vmax, row_tips=tips,
                      col_name=col_name, fmt=kit.fmt_ms if cbar_label == "ms" else None,
                      row_name="rank" if not note else "rank / host")
    return fig + (kit.para(note, "note") if note else "")


def named(summary: Mapping, limit: int = OUTLIERS) -> list[int]:
    """Up to `limit` ranks the findings single out (from findings naming at most `limit` ranks:
    culprits, not the whole job), most severe finding first (then the highest evidence score)."""
    findings = [f for f in (summary.get("findings") or []) if isinstance(f, Mapping)] \
        if isinstance(summary, Mapping) else []
    out: list[int] = []
    for f in sorted(findings, key=_finding_key):
        rs = f.get("ranks")
        if isinstance(rs, list) and 0 < len(rs) <= limit:
            out += [r for r in rs if isinstance(r, int) and not isinstance(r, bool) and r not in out]
    return out[:limit]


# --- findings -----------------------------------------------------------------------------------

SEVERITY_ORDER = {"critical": 0, "error": 1, "warning": 2, "info": 3}
MANY_FINDINGS = 12  # more findings than this: grouped by kind, a few in full per kind
FULL_PER_KIND = 3


def _finding_key(f: Mapping):
    ev = f.get("evidence") if isinstance(f.get("evidence"), Mapping) else {}
    score = _num(ev.get("score"))
    return (SEVERITY_ORDER.get(str(f.get("severity")), 4), -(score or 0.0))


def findings_by_kind(findings: list[Mapping]) -> list[tuple[str, list[Mapping]]]:
    """[(kind, findings)]: kinds in order of their most severe finding (then first appearance),
    each kind's findings most severe first, then by a numeric evidence score (higher first)."""
    groups: dict[str, list[Mapping]] = {}
    for f in findings:
        groups.setdefault(str(f.get("kind")), []).append(f)
    out = [(k, sorted(v, key=_finding_key)) for k, v in groups.items()]
    return sorted(out, key=lambda kv: _finding_key(kv[1][0])[0])


def finding_ranks(findings: Iterable[Mapping]) -> list:
    """The ranks a group of findings names, each once, sorted."""
    out: set = set()
    for f in findings:
        rs = f.get("ranks")
        if isinstance(rs, (list, tuple)):
            out.update(r for r in rs if isinstance(r, int) and not isinstance(r, bool))
    return sorted(out)


_GROUP = re.compile(r"^([^:]*):(\d+(?:,\d+)*)$")


def group_label(g: Any, limit: int = 4) -> str:
    """A process group named by its member list ("11:4,5", "0:0,1,2,...,1023") with the list
    shortened when long: "0:0–1023 (1,024 ranks)"."""
    s = "" if g is None else str(g)
    m = _GROUP.match(s)
    if not m:
        return s
    members = [int(x) for x in m.group(2).split(",")]
    if len(members) <= 8:
        return s
    return f"{m.group(1)}:{rank_list(members, limit)} ({len(members):,} ranks)"


def bounded_note(metrics: dict) -> str:
    """What a bounded summary left out of the per-rank, per-step series (summary_bound)."""
    out = []
    rs = metrics.get("rank_series")
    if isinstance(rs, dict) and rs.get("omitted"):
        out.append(f"{len(rs.get('kept') or [])} of {rs.get('ranks')} ranks shown (the ranks "
                   f"findings name, then the slowest); the others' min / median / max per step "
                   f"are in summary.json ({', '.join(rs.get('tables') or [])}_all_ranks)")
    for r in metrics.get("series_resolution") or []:
        if isinstance(r, dict) and (r.get("every") or 1) > 1:
            out.append(f"a long run: of {r.get('length'):,} steps, every one of the last "
                       f"{r.get('recent_full'):,} and one in {r.get('every')} before them "
                       f"are shown")
            break
    return kit.para("; ".join(out) + ".", "note") if out else ""
