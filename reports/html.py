"""report.html: one self-contained file rendered from summary.json alone.

No network (inline CSS, inline SVG plots, no fonts or scripts from anywhere), every text from the
summary escaped. "What to change first" (reports/actions.py), then the findings, then one
section per analyzer in ANALYZER_MODULES order: the analyzer's own renderer
`trainprof.reports.sections.<NAME>` when there is one, else a generic view of its metrics. A
section that fails to render shows its error; the rest of the report still renders.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path

from trainprof.reports import actions as act, kit, ranks as rk

SEVERITY_COLOURS = {"critical": "#b3001b", "error": "#d9480f", "warning": "#e8a200", "info": "#1c7ed6"}

CSS = """
:root{--fg:#1d2330;--muted:#5c6577;--line:#dde1e8;--bg:#f6f7f9;--card:#fff}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--fg);background:var(--bg)}
header{background:#1d2330;color:#fff;padding:18px 28px}
header h1{margin:0 0 6px;font-size:20px;font-weight:600}
header .cmd{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;color:#c9d1e0;word-break:break-all}
.facts{display:flex;flex-wrap:wrap;gap:6px 18px;margin-top:10px;font-size:13px}
.facts span b{color:#9fb3d9;font-weight:500;margin-right:4px}
main{max-width:1200px;margin:0 auto;padding:18px 28px 40px}
h2{font-size:17px;margin:26px 0 10px;border-bottom:1px solid var(--line);padding-bottom:4px}
h3{font-size:14px;margin:14px 0 6px}
section{background:var(--card);border:1px solid var(--line);border-radius:6px;margin:12px 0;padding:0 16px 10px}
section>details>summary{cursor:pointer;list-style:none;padding:12px 0 8px;font-weight:600;font-size:15px}
section>details>summary::before{content:"\\25B8";display:inline-block;width:16px;color:var(--muted)}
section>details[open]>summary::before{content:"\\25BE"}
.finding{background:var(--card);border:1px solid var(--line);border-left:6px solid var(--sev);border-radius:6px;padding:10px 14px;margin:10px 0}
.finding .head{display:flex;gap:10px;align-items:baseline;flex-wrap:wrap}
.sev{background:var(--sev);color:#fff;border-radius:3px;padding:1px 7px;font-size:11px;font-weight:700;text-transform:uppercase;letter-spacing:.04em}
.kind{font-weight:600}
.ranks{color:var(--muted);font-size:13px}
.msg{margin:6px 0 4px}
.none{color:#2b8a3e;font-weight:600}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
th,td{border:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
thead th{background:#eef1f5;position:sticky;top:0}
table.kv th{background:#f3f5f8;font-weight:500;white-space:nowrap}
tr.agg td{background:#f3f5f8;font-style:italic;border-top:2px solid #c3c9d4}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.tablewrap{max-height:640px;overflow:auto;display:inline-block;max-width:100%}
.note{color:var(--muted);font-size:12px}
.error{color:#b3001b;white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;background:#fff5f5;border:1px solid #f1c0c0;padding:8px}
figure.plot{margin:8px 0}
figure.plot svg{max-width:100%;height:auto;font-family:inherit}
.plots{display:flex;flex-wrap:wrap;gap:10px 18px;align-items:flex-start}
figcaption{color:var(--muted);font-size:12px}
ul.problems{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
footer{color:var(--muted);font-size:12px;text-align:center;padding:20px}
"""

MAX_GENERIC_ITEMS = 50
MAX_PROBLEMS = 100


def _get(d, *keys, default=None):
    for k in keys:
        if not isinstance(d, Mapping) or k not in d:
            return default
        d = d[k]
    return d


def _rank_labels(summary: dict) -> dict[int, str]:
    """rank -> "rank 5 (dp1 pp0 tp1)"."""
    out = {}
    for r in _get(summary, "run", "ranks", default=[]) or []:
        if not isinstance(r, Mapping) or "rank" not in r:
            continue
        coords = r.get("coords") or {}
        c = kit.coord_text(coords)
        try:
            out[int(r["rank"])] = f"rank {r['rank']}" + (f" ({c})" if c else "")
        except (TypeError, ValueError):
            continue
    return out


def ranks_text(ranks, summary: dict, limit: int = 8) -> str:
    """Up to `limit` ranks each named with its mesh coordinates; more as a capped list of
    ranges ("ranks 0–4, 6–1023", "ranks 3, 7, 9 … and 1,021 more")."""
    ranks = list(ranks or []) if isinstance(ranks, (list, tuple)) else []
    if not ranks:
        return "all ranks / job-wide"
    if len(ranks) > limit:
        return f"{len(ranks):,} ranks: " + rk.rank_list(ranks, limit)
    labels = _rank_labels(summary)
    return ", ".join(labels.get(r, f"rank {r}") if isinstance(r, int) else f"rank {r}" for r in ranks)


def _header(summary: dict) -> str:
    run = _get(summary, "run", default={}) or {}
    cmd = run.get("command")
    cmd_s = " ".join(str(c) for c in cmd) if isinstance(cmd, (list, tuple)) else (cmd or "")
    mesh = run.get("mesh") or {}
    mesh_s = kit.mesh_text(mesh) if isinstance(mesh, Mapping) else str(mesh)
    exit_s = run.get("exit_code")
    if run.get("signal"):
        exit_s = f"{exit_s} (signal {run['signal']})"
    n_hosts = len(set(rk.hosts(summary).values()))
    world = run.get("world_size")
    if isinstance(run.get("declared_world_size"), int):  # a few ranks of a larger job
        world = f"{run['declared_world_size']} ({len(run.get('ranks') or [])} with files)"
    facts = [("world size", world), ("hosts", n_hosts if n_hosts > 1 else None),
             ("mesh", mesh_s or None),
             ("profiled", (run.get("profiled") or {}).get("text")
              if isinstance(run.get("profiled"), Mapping) else None),
             ("device", run.get("device")), ("backend", run.get("backend")),
             ("exit code", exit_s), ("torch", run.get("torch_version")),
             # a snapshot of a run not (cleanly) over: trainprof/rundir/state.py
             ("run", f"{run['state']}: a snapshot at step {run.get('last_step')}"
              if run.get("state") in ("running", "stopped") else None),
             ("started", _get(run, "start_time", "iso") if isinstance(run.get("start_time"), Mapping)
              else run.get("start_time")),
             ("trainprof", summary.get("trainprof_version"))]
    facts_html = "".join(f"<span><b>{kit.esc(k)}</b>{kit.esc(kit.fmt_value(v))}</span>"
                         for k, v in facts if v not in (None, ""))
    inp = run.get("input")  # bare profiler traces: how much of the input was analyzed
    inp_html = f'<div class="cmd">{kit.esc(kit.input_text(inp))}</div>' if isinstance(inp, Mapping) else ""
    return (f"<header><h1>trainprof report — {kit.esc(kit.input_label(run) or 'run')}</h1>"
            f'<div class="cmd">{kit.esc(cmd_s)}</div><div class="facts">{facts_html}</div>'
            f"{inp_html}</header>")


def _finding(f: Mapping, summary: dict, evidence_open: bool = True, idx: int | None = None) -> str:
    sev = str(f.get("severity", "info"))
    colour = SEVERITY_COLOURS.get(sev, "#868e96")
    evidence = f.get("evidence") or {}
    ev_html = ""
    if isinstance(evidence, Mapping) and evidence:
        # sentences and a small chart first; every figure, raw, folded (analyzers' own keys)
        said = "".join(kit.para(x) for x in act.evidence_sentences(evidence))
        ev_html = (f"<details{' open' if evidence_open else ''}><summary>evidence</summary>"
                   + said + act.rank_bars(evidence)
                   + "<details><summary>all figures</summary>" + generic(evidence)
                   + "</details></details>")
    elif evidence:
        ev_html = kit.para(kit.fmt_value(evidence))
    analyzer = f.get("analyzer")
    anchor = f' id="f-{idx}"' if isinstance(idx, int) else ""
    return (f'<div class="finding"{anchor} style="--sev:{colour}"><div class="head">'
            f'<span class="sev">{kit.esc(sev)}</span><span class="kind">{kit.esc(f.get("kind"))}</span>'
            f'<span class="ranks">{kit.esc(ranks_text(f.get("ranks"), summary))}</span>'
            + (f'<span class="note">from {kit.esc(analyzer)}</span>' if analyzer else "")
            + f'</div><div class="msg">{kit.esc(rk.cap_numbers(f.get("message")))}</div>'
            + act.estimate_html(f) + f'{ev_html}</div>')


def _findings(summary: dict) -> str:
    findings = [f for f in (summary.get("findings") or []) if isinstance(f, Mapping)]
    if summary.get("nothing_analyzed"):
        return f'<h2>Findings</h2><p class="error">Nothing analyzed: {kit.esc(summary["nothing_analyzed"])}</p>'
    cover = summary.get("coverage")
    # bare traces hold no run directory's streams: that is the input, said plainly, no error
    plain = act.coverage_is_the_input(summary)
    note = ((f'<p class="plain">What this input allows: {kit.esc(cover.get("text"))}</p>' if plain else
             f'<p class="error">Not everything was analyzed: {kit.esc(cover.get("text"))}</p>')
            if isinstance(cover, Mapping) else "")
    if not findings and note:  # never "nothing looks wrong" about analyses that did not run
        return '<h2>Findings</h2><p class="none">No findings in what was analyzed.</p>' + note
    if not findings:
        return '<h2>Findings</h2><p class="none">No findings: nothing looks wrong with this run.</p>'
    counts: dict[str, int] = {}
    for f in findings:
        counts[str(f.get("severity"))] = counts.get(str(f.get("severity")), 0) + 1
    tally = ", ".join(f"{n:,} {s}" for s, n in counts.items())
    head = f"<h2>Findings ({kit.esc(tally)})</h2>" + note
    if len(findings) <= rk.MANY_FINDINGS:
        return head + "".join(_finding(f, summary, idx=i) for i, f in enumerate(findings))
    return head + _many_findings(findings, summary)


def _many_findings(findings: list, summary: dict) -> str:
    """Findings by kind: the most severe few of each in full (evidence folded), the rest of the
    kind one row each (the first rk.TOP; every finding is in summary.json)."""
    groups = rk.findings_by_kind(findings)
    out = [kit.para(f"{len(findings):,} findings of {len(groups)} kind(s): per kind, the "
                    f"{rk.FULL_PER_KIND} most severe in full, the others one line each.", "note")]
    for kind, fs in groups:
        if len(fs) > 1:
            out.append(f"<h3>{kit.esc(kind)}: {len(fs):,} findings — "
                       f"{kit.esc(ranks_text(rk.finding_ranks(fs), summary))}</h3>")
        out.extend(_finding(f, summary, evidence_open=False, idx=_index(findings, f))
                   for f in fs[:rk.FULL_PER_KIND])
        rest = [{"severity": f.get("severity"), "ranks": ranks_text(f.get("ranks"), summary, limit=4),
                 "message": rk.cap_numbers(f.get("message"))} for f in fs[rk.FULL_PER_KIND:]]
        if rest:
            out.append(kit.table(rest, max_rows=rk.TOP, what=f"{kind} findings"))
    return "".join(out)


def _index(findings: list, f) -> int | None:
    return next((i for i, g in enumerate(findings) if g is f), None)


def generic(value, depth: int = 0) -> str:
    """A view of any JSON value: dicts of scalars as key/value tables, lists of dicts as tables,
    nested dicts as sub-headings; long lists truncated."""
    if isinstance(value, Mapping):
        scalars = {k: v for k, v in value.items() if not isinstance(v, (Mapping, list, tuple))
                   or (isinstance(v, (list, tuple)) and len(v) <= 20
                       and all(not isinstance(x, (Mapping, list, tuple)) for x in v))}
        parts = [_capped_kv(scalars)] if scalars else []
        nested = [k for k in value if k not in scalars]
        for k in nested[:MAX_GENERIC_ITEMS]:
            v = value[k]
            if depth >= 3:
                parts.append(f"<h3>{kit.esc(k)}</h3>" + kit.para(kit.fmt_value(v)))
                continue
            parts.append(f"<h3>{kit.esc(k)}</h3>" + generic(v, depth + 1))
        if len(nested) > MAX_GENERIC_ITEMS:
            parts.append(kit.para(f"… {len(nested) - MAX_GENERIC_ITEMS:,} more entries not shown "
                                  f"(of {len(nested):,}); full data in summary.json.", "note"))
        return "".join(parts)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(x, Mapping) for x in value):
            return kit.table(value, max_rows=MAX_GENERIC_ITEMS)
        if all(not isinstance(x, (Mapping, list, tuple)) for x in value):
            return kit.para(kit.fmt_value(list(value)))
        shown = "".join(f"<li>{generic(x, depth + 1)}</li>" for x in value[:MAX_GENERIC_ITEMS])
        more = kit.para(f"{len(value) - MAX_GENERIC_ITEMS} more items not shown.", "note") \
            if len(value) > MAX_GENERIC_ITEMS else ""
        return f"<ul>{shown}</ul>{more}"
    return kit.para(kit.fmt_value(value))


def _capped_kv(scalars: Mapping) -> str:
    """Key/value table. A long one (more than MAX_GENERIC_ITEMS entries: a value per rank) of
    numbers becomes one line: its largest entries, the median, the smallest; of anything else,
    the first rk.TOP entries; either says how many it left out."""
    if len(scalars) <= MAX_GENERIC_ITEMS:
        return kit.kv(scalars)
    items = list(scalars.items())
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for _, v in items):
        items.sort(key=lambda kv: -kv[1])
        line = lambda part: ", ".join(f"{k}: {kit.fmt_value(v)}" for k, v in part)  # noqa: E731
        median = kit.median(v for _, v in items)
        return kit.para(f"{len(items):,} entries. Largest: {line(items[:rk.OUTLIERS])}; median "
                        f"{kit.fmt_value(median)}; smallest: {line(items[-3:])}. Full data in "
                        "summary.json.")
    return (kit.kv(dict(items[:rk.TOP]))
            + kit.para(f"… {len(items) - rk.TOP:,} more entries not shown (of {len(items):,}); "
                       "full data in summary.json.", "note"))


def _section_module(name: str):
    try:
        return importlib.import_module(f"trainprof.reports.sections.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"trainprof.reports.sections.{name}":
            return None
        raise


def render_section(name: str, metrics, summary: dict) -> str:
    title = name.replace("_", " ")
    try:
        mod = _section_module(name)
        if mod is not None:
            title = getattr(mod, "TITLE", title)
            body = mod.render(metrics, summary)
        else:
            body = generic(metrics)
    except Exception as e:  # noqa: BLE001 - one broken section must not lose the report
        body = (kit.para(f"This section could not be rendered ({type(e).__name__}: {e}).")
                + f'<pre class="error">{kit.esc(traceback.format_exc(limit=6))}</pre>')
    return (f'<section id="s-{kit.esc(name)}"><details open><summary>{kit.esc(title)}'
            f'</summary>{body}</details></section>')


def _section_order(metrics: Mapping) -> list[str]:
    try:
        # lazy: optional dependency (the report renders without the analyzers)
        from trainprof.analyzers import ANALYZER_MODULES
    except Exception:  # noqa: BLE001
        ANALYZER_MODULES = ()
    known = [n for n in ANALYZER_MODULES if n in metrics]
    return known + [n for n in metrics if n not in known]


def _problems(summary: dict) -> str:
    problems = kit.input_problems(summary)  # the coverage line is shown with the findings
    errors = [e for e in (summary.get("errors") or [])]
    if not problems and not errors:
        return ""
    out = ["<h2>Analysis problems</h2>"]
    if errors:
        out.append("<h3>Analyzers that failed</h3>")
        for e in errors:
            if isinstance(e, Mapping):
                out.append(f"<p><b>{kit.esc(e.get('analyzer'))}</b>: {kit.esc(e.get('error'))}</p>")
                if e.get("traceback"):
                    out.append(f'<details><summary>traceback</summary><pre class="error">'
                               f'{kit.esc(e["traceback"])}</pre></details>')
            else:
                out.append(kit.para(e))
    if problems:
        out.append("<h3>Input that could not be (fully) read</h3><ul class=\"problems\">")
        out.extend(f"<li>{kit.esc(p)}</li>" for p in problems[:MAX_PROBLEMS])
        out.append("</ul>")
        if len(problems) > MAX_PROBLEMS:
            out.append(kit.para(f"… {len(problems) - MAX_PROBLEMS:,} more not shown (of "
                                f"{len(problems):,}); all of them are in summary.json.", "note"))
    return "".join(out)


def render_html(summary: dict) -> str:
    if not isinstance(summary, Mapping):
        summary = {}
    metrics = summary.get("metrics") or {}
    if not isinstance(metrics, Mapping):
        metrics = {}
    sections = "".join(render_section(n, metrics[n], summary) for n in _section_order(metrics))
    if not sections:
        sections = kit.para("No analyzer produced metrics for this run.", "note")
    title = f"trainprof — {_get(summary, 'run', 'dir', default='report')}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{kit.esc(title)}</title><style>{CSS}{act.CSS}</style></head><body>"
            f"{_header(summary)}<main>{_lead(summary)}{_findings(summary)}<h2>Metrics</h2>{sections}"
            f"{_problems(summary)}</main><footer>generated {kit.esc(summary.get('generated_at'))}"
            f" by trainprof {kit.esc(summary.get('trainprof_version'))} — self-contained, works offline"
            "</footer></body></html>\n")


def _lead(summary: dict) -> str:
    try:
        return act.lead_html(summary)
    except Exception as e:  # noqa: BLE001 - the rest of the report still renders
        return kit.para(f"The actions could not be rendered ({type(e).__name__}: {e}).", "note")


def write_html(summary: dict, path) -> Path:
    """Render the report and write it atomically (a reader never sees half a file)."""
    path = Path(path)
    text = render_html(summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
