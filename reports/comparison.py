"""Renderings of a `trainprof compare` result: terminal table, markdown (asv-style), JSON, JUnit XML.

`result` is the dict built by trainprof.cli.compare (see comparison_result): settings, each side's
runs (paths, analysed steps per run, fingerprint), `metrics` (Comparison.to_dict() each),
`exit_code`, `verdict`.
Marks (as in `asv compare`): `+` regression (worse), `-` improvement (better), `~` changed but
not significantly or within the threshold, blank unchanged, `?` insufficient data / missing.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from trainprof.reports import kit
from trainprof.reports.terminal import printable

INFO_WORD = {"regression": "worse", "improvement": "better"}  # informational metrics never "regress"
MARK = {"regression": "+", "improvement": "-", "insufficient data": "?", "missing": "?", "runs differ": "?"}
INCONCLUSIVE = ("insufficient data", "missing", "runs differ")


def mark(m: Mapping) -> str:
    if m.get("verdict") in MARK:
        return MARK[m["verdict"]]
    change, p = m.get("change"), m.get("p_value")
    moved = isinstance(change, (int, float)) and abs(change) >= 0.005
    if moved or (p is not None and p < 0.05):
        return "~"
    return ""


def fmt_metric(value, unit: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if unit == "ms":
        return kit.fmt_ms(value)
    if unit == "bytes":
        return kit.fmt_bytes(value)
    if unit == "fraction":
        return kit.fmt_pct(value)
    if unit == "tokens/s":
        return f"{value:,.0f} tok/s"
    return kit.fmt_value(float(value))


def _in_pp(m: Mapping) -> bool:
    """Fractions gated in percentage points show their change in points too."""
    return (m.get("unit") == "fraction" and str(m.get("threshold") or "").endswith("pp")
            and isinstance(m.get("baseline"), (int, float)))


def fmt_change(m: Mapping) -> str:
    r = m.get("ratio")
    if _in_pp(m) and isinstance(m.get("candidate"), (int, float)):
        return f"{(m['candidate'] - m['baseline']) * 100:+.1f}pp"
    if r is None:
        return "n/a"
    return f"{(r - 1) * 100:+.1f}%"


def fmt_ci(m: Mapping) -> str:
    ci = m.get("ci")
    if not ci or any(x is None or not math.isfinite(x) for x in ci):
        return ""
    if _in_pp(m):
        b = m["baseline"] * 100
        return f"[{(ci[0] - 1) * b:+.1f}pp, {(ci[1] - 1) * b:+.1f}pp]"
    return f"[{(ci[0] - 1) * 100:+.1f}%, {(ci[1] - 1) * 100:+.1f}%]"


def fmt_p(m: Mapping) -> str:
    """The p-value the verdict used: Benjamini–Hochberg adjusted for gated metrics."""
    p = m.get("p_adjusted")
    if p is None:
        p = m.get("p_value")
    return "" if p is None else (f"{p:.2g}" if p >= 1e-4 else "<1e-4")


def fmt_n(m: Mapping) -> str:
    """Samples per side; with several runs, runs×samples."""
    n, runs = m.get("n"), m.get("runs")
    if runs and max(runs) > 1:
        if n:
            return f"{runs[0]}r·{n[0]}/{runs[1]}r·{n[1]}"
        return f"{runs[0]}r/{runs[1]}r"
    return f"{n[0]}/{n[1]}" if n else ""


TEST_SHORT = {"U over steps": "U", "t over runs": "t", "threshold only": "—"}


def describe_side(side: Mapping) -> str:
    runs, steps = side.get("runs"), side.get("steps") or []
    if not runs:
        return str(side.get("path", ""))
    if len(set(steps)) == 1:
        per = f"{steps[0]} analysed steps" + (" each" if runs > 1 else "")
    else:
        per = f"{', '.join(map(str, steps))} analysed steps"
    return f"{runs} run{'s' * (runs != 1)} ({per})"


def sides_line(result: Mapping) -> str:
    return (f"baseline: {describe_side(result.get('baseline', {}))} · "
            f"candidate: {describe_side(result.get('candidate', {}))}")


def rows(result: Mapping) -> list[dict]:
    out = []
    for m in result.get("metrics", []):
        unit = m.get("unit", "")
        out.append({
            "mark": mark(m), "metric": m.get("metric"), "label": m.get("label"),
            "baseline": fmt_metric(m.get("baseline"), unit),
            "candidate": fmt_metric(m.get("candidate"), unit),
            "change": fmt_change(m), "ci": fmt_ci(m), "p": fmt_p(m),
            "n": fmt_n(m), "test": TEST_SHORT.get(m.get("test"), m.get("test") or ""),
            "threshold": m.get("threshold") or "report only",
            "verdict": (("not significant, underpowered" if m.get("underpowered") else m.get("verdict"))
                        if m.get("gate", True) else
                        f"{INFO_WORD.get(m.get('verdict'), m.get('verdict'))} (not gated)"),
            "detail": "; ".join(x for x in (m.get("detail"), m.get("reason")) if x),
        })
    return out


def headline(result: Mapping) -> str:
    code, verdict = result.get("exit_code"), result.get("verdict")
    regressed = [m["metric"] for m in result.get("metrics", [])
                 if m.get("gate", True) and m.get("verdict") == "regression"]
    inconclusive = [m["metric"] for m in result.get("metrics", [])
                    if m.get("gate", True) and m.get("verdict") in INCONCLUSIVE]
    if regressed:
        return f"REGRESSION in {', '.join(regressed)} (exit {code})"
    if inconclusive:
        return f"INCONCLUSIVE: {', '.join(inconclusive)} (exit {code})"
    named = result.get("underpowered") or []
    weak = [m for m in result.get("metrics", []) if m.get("gate", True) and m.get("underpowered")
            and m.get("metric") in named]
    if verdict == "pass" and weak:  # a large move the runs cannot confirm: not a clean pass
        return f"PASS (inconclusive): {underpowered_text(weak)} (exit {code})"
    return f"PASS: no regression (exit {code})" if verdict == "pass" else f"{verdict} (exit {code})"


def underpowered_text(weak: list) -> str:
    """'cpu_time +34.1% not significant with 3 candidate vs 6 baseline runs (p=0.095); the
    smallest change this gate can detect at this noise is ~78%; add runs' (several metrics:
    each with its p and detectable change, the runs once)."""
    def p_of(m):
        p = m.get("p_adjusted") if m.get("p_adjusted") is not None else m.get("p_value")
        return f"p={p:.2g}" if isinstance(p, (int, float)) else None

    def mde(m):
        return f"~{m['mde'] * 100:.0f}%" if isinstance(m.get("mde"), (int, float)) else None

    runs = weak[0].get("runs") or []
    with_runs = (f" with {runs[1]} candidate vs {runs[0]} baseline run{'s' * (runs[0] != 1)}"
                 if len(runs) == 2 else "")
    if len(weak) == 1:
        m = weak[0]
        text = f"{m.get('metric')} {fmt_change(m)} not significant{with_runs}"
        text += f" ({p_of(m)})" if p_of(m) else ""
        if mde(m):
            text += f"; the smallest change this gate can detect at this noise is {mde(m)}"
        return text + "; add runs"
    parts = []
    for m in weak:
        inner = ", ".join(x for x in (p_of(m), mde(m) and f"detectable {mde(m)}") if x)
        parts.append(f"{m.get('metric')} {fmt_change(m)}" + (f" ({inner})" if inner else ""))
    return (f"{', '.join(parts)} not significant{with_runs} (detectable: the smallest change this "
            f"gate can detect at this noise); add runs")


def render_terminal(result: Mapping, console=None) -> None:
    import sys

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:  # CI logs are wide: do not squeeze the table into 80 columns
        console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    s = result.get("settings", {})
    table = Table(title=f"trainprof compare  (α={s.get('alpha')} after Benjamini–Hochberg, min effect "
                        f"{s.get('min_effect', 0) * 100:g}%)\n{sides_line(result)}", title_justify="left")
    for col in ("", "metric", "baseline", "candidate", "change", "95% CI", "test", "p", "n",
                "threshold", "verdict"):
        table.add_column(col, overflow="fold", no_wrap=col in ("", "change", "p", "n", "test"))
    style = {"regression": "bold red", "improvement": "green", "insufficient data": "yellow",
             "missing": "yellow", "runs differ": "yellow"}
    details = []
    for r, m in zip(rows(result), result.get("metrics", [])):
        st = style.get(m.get("verdict"), "")
        verdict = escape(r["verdict"])
        table.add_row(f"[{st}]{escape(r['mark'])}[/]" if st else escape(r["mark"]),
                      escape(r["metric"]), r["baseline"], r["candidate"], r["change"],
                      r["ci"], r["test"], r["p"], r["n"], escape(r["threshold"]),
                      f"[{st}]{verdict}[/]" if st else verdict)
        if r["detail"]:
            details.append(f"  {r['metric']}: {r['detail']}")
    console.print(table)
    for d in details:
        console.print(d, markup=False)
    for line in op_diff_lines(result.get("op_diff")):
        console.print(line, markup=False)
    code = result.get("exit_code")
    colour = {0: "yellow" if result.get("underpowered") else "green", 1: "bold red",
              3: "yellow"}.get(code, "")
    console.print(f"[{colour}]{escape(headline(result))}[/]" if colour else escape(headline(result)))


def _md_cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _md_paths(side: Mapping) -> str:
    paths = side.get("paths") or [side.get("path")]
    if side.get("path") not in paths:  # a baseline history: its directory
        return f"`{_md_cell(side.get('path'))}`"
    more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
    return f"`{_md_cell(paths[0])}`{more}"


def render_markdown(result: Mapping) -> str:
    b, c = result.get("baseline", {}), result.get("candidate", {})
    lines = [f"### trainprof compare: {headline(result)}", "",
             f"Baseline {_md_paths(b)} → candidate {_md_paths(c)}  ",
             _md_cell(sides_line(result)), "",
             "| Change | Before | After | Ratio | 95% CI | p | n | Metric | Verdict |",
             "|:------:|-------:|------:|------:|:------:|--:|--:|:-------|:--------|"]
    for r, m in zip(rows(result), result.get("metrics", [])):
        ratio = f"{m['ratio']:.2f}" if isinstance(m.get("ratio"), (int, float)) else "n/a"
        verdict = r["verdict"] + (f" — {r['detail']}" if r["detail"] else "")
        lines.append("| " + " | ".join(_md_cell(x) for x in (
            r["mark"], r["baseline"], r["candidate"], ratio, r["ci"], r["p"], r["n"],
            f"{r['label']} (`{r['metric']}`)" if r["label"] != r["metric"] else f"`{r['metric']}`",
            verdict)) + " |")
    s = result.get("settings", {})
    lines += ["", f"`+` worse · `-` better · `~` changed within noise or threshold · `?` insufficient "
              f"data · a regression is significant at α={s.get('alpha')} (p adjusted by "
              f"Benjamini–Hochberg over the gated metrics; one run per side: Mann–Whitney U over the "
              f"steps, several: t-test over the per-run medians) and beyond its threshold "
              f"(min effect {s.get('min_effect', 0) * 100:g}%) · n: samples per side, `r`: runs.", ""]
    lines += op_diff_markdown(result.get("op_diff"))
    return "\n".join(lines)


def render_json(result: Mapping) -> str:
    return json.dumps(_clean(result), indent=2, default=str)  # NaN → null: strict JSON


def _clean(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def render_junit(result: Mapping) -> str:
    """One test case per metric: regression → failure, inconclusive → skipped (or failure when
    the result itself is inconclusive and gated, so CI shows why it stopped: see exit codes)."""
    metrics = result.get("metrics", [])
    failures = sum(1 for m in metrics if m.get("gate", True) and m.get("verdict") == "regression")
    skipped = sum(1 for m in metrics if m.get("verdict") in INCONCLUSIVE)
    suite = ET.Element("testsuite", name="trainprof.compare", tests=str(len(metrics)),
                       failures=str(failures), errors="0", skipped=str(skipped))
    root = ET.Element("testsuites", name="trainprof compare", tests=str(len(metrics)),
                      failures=str(failures), errors="0", skipped=str(skipped))
    root.append(suite)
    for r, m in zip(rows(result), metrics):
        case = ET.SubElement(suite, "testcase", classname="trainprof.compare", name=str(m.get("metric")),
                             time="0")
        text = (f"{r['label']}: baseline {r['baseline']}, candidate {r['candidate']}, change "
                f"{r['change']} {r['ci']} p={r['p'] or 'n/a'} n={r['n'] or 'n/a'} threshold "
                f"{r['threshold']}; {r['verdict']}"
                + (f" ({r['detail']})" if r["detail"] else ""))
        if m.get("gate", True) and m.get("verdict") == "regression":
            ET.SubElement(case, "failure", message=f"{m.get('metric')} regressed by {r['change']}",
                          type="regression").text = text
        elif m.get("verdict") in INCONCLUSIVE:
            ET.SubElement(case, "skipped", message=f"{m.get('metric')}: {m.get('verdict')}").text = text
        else:
            ET.SubElement(case, "system-out").text = text
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --- which ops moved (result["op_diff"], trainprof/gate/opdiff.py) -------------------------------------

OP_ROWS = 10
OP_NAME_CHARS = 90
_OP_CRITICAL = {"kernels": "compute and memory kernels", "cpu_ops": "compute on the step's threads"}


def _op_name(name) -> str:
    """A trace's op name shortened, with control and format characters shown as escapes."""
    s = str(name)
    return printable(s if len(s) <= OP_NAME_CHARS else s[:OP_NAME_CHARS - 1] + "…")


def _op_tables(diff: Mapping) -> list[tuple[str, Mapping]]:
    return [(t, diff[t]) for t in ("kernels", "cpu_ops") if isinstance(diff.get(t), Mapping)]


def _op_row(r: Mapping) -> tuple[str, str, str, str, str]:
    status = r.get("status", "")
    change = r.get("change")
    pct = f" ({change * 100:+.0f}%)" if isinstance(change, (int, float)) else ""
    approx = "≈" if r.get("below_top_in") else ""
    return (_op_name(r.get("name")), kit.fmt_ms(r.get("baseline_ms")), kit.fmt_ms(r.get("candidate_ms")),
            f"{approx}{'+' if (r.get('delta_ms') or 0) >= 0 else '-'}{kit.fmt_ms(abs(r.get('delta_ms') or 0))}{pct}",
            "" if status == "changed" else status)


def _op_apart(t: Mapping, diff: Mapping, table: str) -> list[str]:
    """The ops listed apart from the top contributors: waits and communication (a symptom:
    they grow when a peer or the device is slow), other threads, time outside any op."""
    def moved(rows):
        return [r for r in rows or [] if r.get("delta_ms")][:3]

    def ms(x):
        return f"{'+' if x >= 0 else '-'}{kit.fmt_ms(abs(x))}/step"

    out = []
    waits = [f"{_op_name(r.get('name'))} {ms(r['delta_ms'])}" for r in moved(t.get("waiting"))]
    outside = diff.get("outside_ops_ms") or {}
    if table == "cpu_ops" and isinstance(outside.get("delta"), (int, float)) and outside["delta"]:
        waits.append(f"outside any op on the step's threads {ms(outside['delta'])}")
    if waits:
        out.append("waiting moved: " + ", ".join(waits) + " — a symptom; see the top contributors")
    other = [f"{_op_name(r.get('name'))} {ms(r['delta_ms'])}" for r in moved(t.get("other_threads"))]
    if other:
        out.append("other threads: " + ", ".join(other))
    return out


def op_diff_lines(diff) -> list[str]:
    """Plain-text lines of the op diff for the terminal (names are printed as text, not markup)."""
    if not isinstance(diff, Mapping):
        return []
    if not diff.get("available"):
        return [f"which ops moved: not available ({diff.get('reason', 'no op breakdown')})"] if diff.get("reason") else []
    sw = diff.get("step_window_ms") or {}
    lines = ["", f"Which ops moved (profiled steps, {diff.get('basis', '')}); step window "
                 f"{kit.fmt_ms(sw.get('baseline'))} -> {kit.fmt_ms(sw.get('candidate'))}:"]
    for table, t in _op_tables(diff):
        lines.append(f"  {'GPU kernels' if table == 'kernels' else 'CPU ops'}, {t.get('measure')}: "
                     f"{kit.fmt_ms(t.get('baseline_ms'))} -> {kit.fmt_ms(t.get('candidate_ms'))}; "
                     f"top contributors ({_OP_CRITICAL[table]}):")
        for r in [r for r in t.get("top") or [] if r.get("delta_ms")][:OP_ROWS]:
            name, b, c, d, status = _op_row(r)
            lines.append(f"    {d:>18}  {b:>9} -> {c:<9} {name}" + (f"  [{status}]" if status else ""))
        lines += [f"    {x}" for x in _op_apart(t, diff, table)]
        for what in ("added", "removed"):
            ops = t.get(what) or []
            if ops:
                lines.append(f"    {what}: " + ", ".join(f"{_op_name(o['name'])} ({kit.fmt_ms(o['ms'])})"
                                                        for o in ops[:5])
                             + (f" and {len(ops) - 5} more" if len(ops) > 5 else ""))
    for note in diff.get("notes") or []:
        lines.append(f"  note: {note}")
    return lines


def op_diff_markdown(diff) -> list[str]:
    if not isinstance(diff, Mapping) or not diff.get("available"):
        return []
    sw = diff.get("step_window_ms") or {}
    lines = ["#### Which ops moved", "",
             f"Profiled steps, {_md_cell(diff.get('basis', ''))}; step window "
             f"{kit.fmt_ms(sw.get('baseline'))} → {kit.fmt_ms(sw.get('candidate'))}.", ""]
    for table, t in _op_tables(diff):
        rows = [r for r in t.get("top") or [] if r.get("delta_ms")][:OP_ROWS]
        apart = [f"{_md_cell(x)}" for x in _op_apart(t, diff, table)]
        lines += [f"{'GPU kernels' if table == 'kernels' else 'CPU ops'} ({_md_cell(t.get('measure'))}): "
                  f"{kit.fmt_ms(t.get('baseline_ms'))} → {kit.fmt_ms(t.get('candidate_ms'))}; "
                  f"top contributors ({_OP_CRITICAL[table]}):", ""]
        if not rows:
            lines += ["No op moved.", ""]
        else:
            lines += ["| Change | Before | After | Op | |", "|-------:|-------:|------:|:---|:--|"]
            for r in rows:
                name, b, c, d, status = _op_row(r)
                lines.append(f"| {_md_cell(d)} | {b} | {c} | `{_md_cell(name).replace('`', '')}` | {status} |")
            lines.append("")
        if apart:
            lines += [f"- {x}" for x in apart] + [""]
    return lines
