"""The short terminal summary printed after an analysis: run, key metrics, findings, report path.

Renders with rich (plain text when stdout is not a terminal) and tolerates any missing key: a
summary from an older or partial analysis still prints. Every string that came from an input
(paths, names, messages) is printed as text: control characters (ESC and the rest) are shown as
escapes, never sent to the terminal, and rich markup in it is escaped (``printable``/``text``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

from trainprof.reports import kit, ranks as rk
from trainprof.wording import plural
from trainprof.reports.actions import coverage_is_the_input, terminal_lines

SEVERITY_STYLES = {"critical": "bold white on red", "error": "bold red", "warning": "yellow",
                   "info": "cyan"}

# C0/C1 controls but newline and tab, DEL, and the Unicode format characters that reorder or
# hide text (bidi overrides and isolates, zero-width marks)
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e"
                          "\u2060-\u2069\ufeff]")


def printable(x) -> str:
    """str(x) safe to write to a terminal: control and format characters become visible
    escapes (ESC -> \\x1b)."""
    s = "" if x is None else str(x)
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), s)


def text(x) -> str:
    """printable(x) with rich markup escaped: for strings inside console.print markup."""
    from rich.markup import escape

    return escape(printable(x))


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def _first(*vals):
    for v in vals:
        if v is not None:
            return v
    return None


def key_metrics(summary: Mapping) -> list[tuple[str, str]]:
    """(label, formatted value) for the headline metrics present in the summary."""
    m = _get(summary, "metrics") or {}
    out = []
    job = _get(m, "step_time", "job") or {}
    if job.get("median_ms") is not None:
        txt = kit.fmt_ms(job["median_ms"])
        if job.get("p90_ms") is not None:
            n = job.get("steps")
            n_s = plural(n, "step") if isinstance(n, int) else f"{n or '?'} steps"
            txt += f" (p90 {kit.fmt_ms(job['p90_ms'])}, {n_s})"
        out.append(("step time (median)", txt + _partial(job)))
    if job.get("tokens_per_s") is not None:
        txt = f"{kit.fmt_value(float(job['tokens_per_s']))} tokens/s"
        mean = job.get("tokens_per_s_mean")
        if isinstance(mean, (int, float)) and mean < 0.9 * float(job["tokens_per_s"]):
            # slow steps weigh: the job's own rate (what a framework reports) is lower
            txt += (f" at the median step, {kit.fmt_value(float(mean))} tokens/s over all "
                    "analysed steps")
        out.append(("throughput", txt + _partial(job)))
    mfu = _first(_get(m, "roofline", "mfu"), _get(m, "roofline", "job", "mfu"))
    if isinstance(mfu, (int, float)):
        out.append(("MFU", kit.fmt_pct(mfu)))
    elif _get(m, "roofline", "job", "withheld"):
        out.append(("MFU", f"withheld: {_get(m, 'roofline', 'job', 'withheld')}"))
    cc = _get(m, "comm_compute") or {}
    exposed = _first(_get(cc, "exposed_comm_fraction"), _get(cc, "job", "exposed_comm_fraction"),
                     _get(cc, "exposed_fraction"), _get(cc, "job", "exposed_fraction"))
    if isinstance(exposed, (int, float)) and _has_comm(summary, cc):
        whole = [r.get("whole_trace_window") for r in (cc.get("per_rank") or []) if isinstance(r, Mapping)]
        of = " of the traced window" if whole and all(whole) else " of step time"
        out.append(("exposed communication", kit.fmt_pct(exposed) + of
                    + _partial(_get(cc, "job"))))
    bubble = _first(_get(m, "pipeline", "bubble_fraction"), _get(m, "pipeline", "job", "bubble_fraction"))
    if isinstance(bubble, (int, float)):
        out.append(("pipeline bubble", kit.fmt_pct(bubble)))
    elif _get(m, "pipeline", "withheld"):
        out.append(("pipeline bubble", f"withheld: {_get(m, 'pipeline', 'withheld')}"))
    return out


def _has_comm(summary: Mapping, cc: Mapping) -> bool:
    """Whether the job communicates at all: not for one process, nor when no rank's trace holds
    any communication (its exposed share is then no figure to headline)."""
    if isinstance(cc, Mapping) and cc.get("per_rank") and isinstance(cc["per_rank"], list):
        comm = [r.get("comm_fraction") for r in cc["per_rank"] if isinstance(r, Mapping)]
        if comm and all(c == 0 for c in comm):
            return False
    return (_get(summary, "run", "world_size") or 0) != 1 or bool(_get(cc, "job", "comm_fraction"))


def _partial(job) -> str:
    """' (partial: 1 of 2 ranks)' for a job-level figure computed without every rank."""
    p = job.get("partial") if isinstance(job, Mapping) else None
    if not isinstance(p, Mapping):
        return ""
    return f" (partial: {p.get('ranks_reporting', p.get('ranks_present', '?'))} of " \
           f"{p.get('world_size', '?')} ranks)"


def _ranks(f: Mapping, summary: Mapping) -> str:
    from trainprof.reports.html import ranks_text  # lazy: start-up time of analyze --no-report

    return ranks_text(f.get("ranks"), summary, limit=4)


MAX_ROWS = 20


def _shown(findings: list) -> list:
    """Up to MAX_ROWS findings as they are; more: per kind the rk.FULL_PER_KIND most severe and
    one row standing for the rest of the kind (its ranks, capped)."""
    if len(findings) <= MAX_ROWS:
        return findings
    rows = []
    for kind, fs in rk.findings_by_kind(findings):
        rows += fs[:rk.FULL_PER_KIND]
        rest = fs[rk.FULL_PER_KIND:]
        if rest:
            rows.append({"severity": "", "kind": kind, "ranks": rk.finding_ranks(rest),
                         "message": f"… {len(rest):,} more {kind} findings (see the report)"})
    return rows


def render_terminal(summary, report_path=None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    escape = text  # every string below may come from the run: printable and markup-escaped

    if console is None:
        console = Console(highlight=False, soft_wrap=not sys.stdout.isatty())
    summary = summary if isinstance(summary, Mapping) else {}
    run = _get(summary, "run") or {}
    mesh = run.get("mesh") or {}
    mesh_s = kit.mesh_text(mesh)
    ws = run.get("world_size")
    bits = [f"{ws if ws is not None else '?'} rank{'' if ws == 1 else 's'}"]
    n_hosts = len(set(rk.hosts(summary).values()))
    if n_hosts > 1:
        bits.append(f"{n_hosts:,} hosts")
    if mesh_s:
        bits.append(mesh_s)
    if run.get("device"):
        bits.append(str(run["device"]))
    if run.get("exit_code") is not None:
        bits.append(f"exit {run['exit_code']}" + (f" (signal {run['signal']})" if run.get("signal") else ""))
    inp = run.get("input")
    console.print(f"[bold]trainprof[/bold] {escape(kit.input_label(run))}: {escape(', '.join(bits))}")
    if isinstance(inp, Mapping):  # bare profiler traces: how much of the input was analyzed
        console.print(escape(kit.input_text(inp)))
    prof = run.get("profiled")  # --profile-ranks: a subset recorded the profiler window
    if isinstance(prof, Mapping) and prof.get("text") and prof.get("count") != prof.get("of"):
        console.print(escape(str(prof["text"])))
    if run.get("state") in ("running", "stopped"):  # a snapshot of a run not (cleanly) over
        live = run.get("live") if isinstance(run.get("live"), Mapping) else {}
        console.print(f"[bold yellow]run {escape(str(run['state']))}[/bold yellow]: a snapshot at "
                      f"step {escape(str(run.get('last_step')))}" + (
                          f" ({escape(str(live['why']))})" if live.get("why") else ""))
    partial = run.get("partial")
    if isinstance(partial, Mapping):
        console.print(f"[bold yellow]partial run[/bold yellow]: {escape(partial_text(partial))}; "
                      f"job-level figures cover the ranks present only, MFU and the pipeline "
                      f"bubble are withheld")

    for label, value in key_metrics(summary):
        console.print(f"  {escape(label)}: [bold]{escape(value)}[/bold]")

    for line in terminal_lines(summary):  # what to change first, with its estimated saving
        console.print(escape(line))
    findings = [f for f in (summary.get("findings") or []) if isinstance(f, Mapping)]
    cover = summary.get("coverage")
    if findings and isinstance(cover, Mapping):  # bare traces: the nature of the input, said plainly
        label = "what this input allows" if coverage_is_the_input(summary) else "[yellow]coverage[/yellow]"
        console.print(f"{label}: {escape(str(cover.get('text', '')))}")
    if summary.get("nothing_analyzed"):
        console.print(f"[bold red]nothing analyzed[/bold red]: {escape(str(summary['nothing_analyzed']))}")
    elif not findings and isinstance(partial, Mapping):  # never "nothing wrong" about ranks not seen
        console.print(f"[yellow]no findings in the ranks analyzed[/yellow]: {escape(partial_text(partial))}")
    elif not findings and isinstance(cover, Mapping):  # nor about analyses that did not run
        console.print(f"[yellow]no findings in what was analyzed[/yellow]: {escape(str(cover.get('text', '')))}")
    elif not findings:
        console.print("[green]no findings[/green]: nothing looks wrong with this run")
    else:
        table = Table(title=f"{len(findings)} finding(s)", title_justify="left", show_lines=False,
                      expand=False)
        for col in ("severity", "kind", "ranks", "message"):
            table.add_column(col, overflow="fold")
        for f in _shown(findings):
            sev = str(f.get("severity", ""))
            table.add_row(f"[{SEVERITY_STYLES.get(sev, '')}]{escape(sev)}[/]" if sev in SEVERITY_STYLES
                          else escape(sev), escape(str(f.get("kind", ""))), escape(_ranks(f, summary)),
                          escape(rk.cap_numbers(f.get("message", ""))))
        console.print(table)
    n_err = len(summary.get("errors") or [])
    n_prob = len(kit.input_problems(summary))
    if n_err or n_prob:
        console.print(f"[yellow]{n_err} analyzer error(s), {n_prob} input problem(s)[/yellow] (see the report)")
    if report_path:
        console.print(f"report: {escape(str(report_path))}")


def partial_text(p: Mapping) -> str:
    missing = p.get("missing_ranks") or []
    shown = rk.rank_list(missing, 8) if isinstance(missing, list) else ""
    return (f"{p.get('ranks_present', '?')} of {p.get('world_size', '?')} ranks have files"
            + (f" (missing: {shown})" if shown else ""))
