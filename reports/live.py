"""`trainprof watch`'s view: one rich renderable from a live snapshot (analyzers/live.py).
Renders, computes nothing; every string from the run is printable and markup-escaped."""

from __future__ import annotations

from collections.abc import Mapping

from trainprof.reports.terminal import text as esc

STATE_STYLE = {"running": "bold green", "ended": "bold", "stopped": "bold red"}


def _ms(x) -> str:
    return "–" if not isinstance(x, (int, float)) else f"{x:,.1f} ms"


def _age(x) -> str:
    if not isinstance(x, (int, float)):
        return "–"
    return f"{x:,.0f} s" if x < 120 else f"{x / 60:,.1f} min"


def render_watch(snap: Mapping, rows: int = 20):
    """A Group: the header (state, steps/s, step time), the hang suspicion, the worst ranks
    (most behind first, at most ``rows``), and the last analysis' findings with their onsets."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    state = str(snap.get("state"))
    step = snap.get("last_step")
    at = f" at step {esc(step)}" if step is not None else ", no step finished yet"
    head = Text.from_markup(
        f"[bold]trainprof watch[/bold] {esc(snap.get('dir'))}: "
        f"[{STATE_STYLE.get(state, 'bold')}]{esc(state)}[/]{at} ({esc(snap.get('why'))})")
    rate = snap.get("steps_per_s")
    stats = Text.from_markup(
        f"last {snap.get('window_s', 0) / 60:.0f} min: "
        f"[bold]{'–' if rate is None else f'{rate:,.2f}'}[/bold] steps/s, step "
        f"[bold]{_ms(snap.get('step_ms'))}[/bold] median, {_ms(snap.get('step_ms_max'))} max; "
        f"{snap.get('ranks', 0):,} rank(s); last progress {esc(snap.get('last_progress') or '–')}")
    parts = [head, stats]
    hang = snap.get("hang")
    if isinstance(hang, Mapping):
        parts.append(Text.from_markup(f"[bold red]hang suspected[/bold red]: {esc(hang.get('text'))}"))
    worst = list(snap.get("worst") or [])
    t = Table(title=f"ranks, most behind first ({min(rows, len(worst))} of {len(worst)})",
              title_justify="left", show_edge=False)
    for c in ("rank", "last step", "lag (steps)", "step time", "heartbeat age", ""):
        t.add_column(c, justify="right" if c not in ("", "rank") else "left")
    for v in worst[:rows]:
        t.add_row(str(v.get("rank")), esc(v.get("last_step", "–")), esc(v.get("lag", "–")),
                  _ms(v.get("step_ms")), _age(v.get("age_s")), "closed" if v.get("closed") else "")
    if len(worst) > rows:
        t.add_row("…", "", "", "", "", f"{len(worst) - rows:,} more ranks")
    parts.append(t)
    parts.append(_findings(snap.get("analysis")))
    return Group(*parts)


def _findings(a):
    from rich.table import Table
    from rich.text import Text

    if not isinstance(a, Mapping):
        return Text("findings: no analysis yet (run `trainprof analyze RUN`, or `wrap "
                    "--analyze-every MIN`)", style="dim")
    fs = a.get("findings") or []
    title = f"findings of the analysis {_age(a.get('age_s'))} ago" + (
        f" (run {a.get('state')} then)" if a.get("state") else "")
    if not fs:
        return Text(f"{title}: none", style="green")
    t = Table(title=title, title_justify="left", show_edge=False)
    for c in ("severity", "kind", "ranks", "onset", "end", "what"):
        t.add_column(c, overflow="fold")
    for f in fs:
        o = f.get("onset") if isinstance(f.get("onset"), Mapping) else None
        e = f.get("end") if isinstance(f.get("end"), Mapping) else None
        rs = f.get("ranks") or []
        t.add_row(esc(f.get("severity")), esc(f.get("kind")),
                  esc(", ".join(map(str, rs[:6])) + (" …" if len(rs) > 6 else "")),
                  f"step {esc(o.get('step'))}" if o else "", f"step {esc(e.get('step'))}" if e else
                  ("ongoing" if o else ""), esc(str(f.get("message") or "")[:140]))
    if a.get("more"):
        t.add_row("", "", "", "", "", f"{a['more']} more in summary.json")
    return t
