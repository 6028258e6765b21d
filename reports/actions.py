"""The report's lead: "What to change first" (summary.json ``actions``: each fix with its
estimated saving, its evidence in one sentence and a link to its finding and section), a stacked
per-step breakdown of the step, and evidence written as sentences rather than raw tables.
Renders only: every figure comes from the summary (analyzers/advice.py, analyzers/estimates.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from trainprof.reports import kit, svg

MAX_ACTIONS = 8
MAX_STEPS = 64  # bars in the per-step chart (the latest steps past that)

# the breakdown's parts: (key in the source's per-step rows, label, colour)
GPU_OVERVIEW_PARTS = (("kernel", "kernel", "#2f9e44"), ("memcpy", "memcpy", "#1c7ed6"),
                      ("memset", "memset", "#74c0fc"), ("communication", "communication", "#e03131"),
                      ("runtime", "runtime", "#ae3ec9"), ("dataloader", "data loading", "#f59f00"),
                      ("cpu_exec", "CPU exec", "#e8590c"), ("other", "other", "#adb5bd"))
COMM_COMPUTE_PARTS = (("compute_ms", "compute", "#2f9e44"), ("overlapped_ms", "comm hidden under compute", "#74c0fc"),
                      ("exposed_comm_ms", "exposed comm", "#e03131"), ("data_ms", "data loading", "#f59f00"),
                      ("other_ms", "other", "#868e96"), ("idle_ms", "idle", "#dee2e6"))
RUN_PARTS = (("busy", "own work", "#2f9e44"), ("data", "waiting for input", "#f59f00"),
             ("wait", "waiting in collectives", "#e03131"))


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def saving_text(a: Mapping) -> str:
    """'saves ≈ 40.1 ms/step (37 %): 108.4 → 68.3 ms'."""
    return (f"saves ≈ {kit.fmt_ms(a.get('saving_ms'))}/step ({kit.fmt_pct(a.get('saving_fraction'))}): "
            f"{kit.fmt_ms(a.get('step_ms_before'))} → {kit.fmt_ms(a.get('step_ms_after'))}")


def gain_text(a: Mapping) -> str:
    """An action's line under its fix: its saving, or for a finding that stopped the job or made
    it compute wrong values (``blocked``) why it comes first: 'critical: the job hung; fix
    this before any speed-up'."""
    if a.get("blocked"):
        return f"{a.get('severity') or 'error'}: {a['blocked']}; fix this before any speed-up"
    return saving_text(a)


def coverage_is_the_input(summary: Mapping) -> bool:
    """Whether what was not analyzed is just the nature of the input (bare profiler traces carry
    no run directory's streams: summary.json coverage.input_only), to be said plainly rather
    than as an error."""
    cover = summary.get("coverage")
    return isinstance(cover, Mapping) and cover.get("input_only") is True


def start_up_text(summary: Mapping) -> str | None:
    su = (((summary.get("metrics") or {}).get("launch") or {}).get("job") or {}).get("start_up")
    return su.get("text") if isinstance(su, Mapping) else None


def lead_html(summary: Mapping) -> str:
    """'What to change first', then the per-step breakdown chart."""
    acts = [a for a in (summary.get("actions") or []) if isinstance(a, Mapping)][:MAX_ACTIONS]
    out = ["<h2 id=\"actions\">What to change first</h2>"]
    if acts:
        items = []
        for a in acts:
            i = a.get("finding")
            links = [f'<a href="#f-{kit.esc(i)}">finding</a>' if isinstance(i, int) else "",
                     f'<a href="#{kit.esc(a.get("section"))}">section</a>' if a.get("section") else ""]
            cls = "blocked" if a.get("blocked") else "saving"
            items.append(f"<li><b>{kit.esc(a.get('fix'))}</b> <span class=\"kind\">[{kit.esc(a.get('kind'))}]</span>"
                         f"<br><span class=\"{cls}\">{kit.esc(gain_text(a))}</span><br>"
                         f"{kit.esc(a.get('evidence'))} — {' · '.join(x for x in links if x)}</li>")
        out.append(f"<ol class=\"actions\">{''.join(items)}</ol>")
        more = len(summary.get("actions") or []) - len(acts)
        if more > 0:
            out.append(kit.para(f"{more} more in the findings below.", "note"))
    else:
        out.append(kit.para(_no_action_text(summary)))
    su = start_up_text(summary)
    if su:
        out.append(kit.para("Start-up: " + su, "note"))
    chart = breakdown_html(summary)
    if chart:
        out.append(chart)
    return "".join(out)


def _no_action_text(summary: Mapping) -> str:
    if summary.get("nothing_analyzed"):
        return "Nothing to suggest: nothing was analyzed (see below)."
    if start_up_text(summary) and not summary.get("findings"):
        return ("Nothing diagnosed: the profiled window shows start-up, not steady-state "
                "training (below); profile later steps to see what to change.")
    fs = summary.get("findings") or []
    if fs:
        return ("No change with a measured saving of 5 % of the step or more; the findings below "
                "say what was found.")
    return "Nothing to change: no finding in what was analyzed."


# --------------------------------------------------------------------------- per-step breakdown
def breakdown(summary: Mapping) -> dict | None:
    """{"title", "unit", "parts": [(label, colour)], "steps": [label], "values": [[per part]],
    "note"} from the richest per-step source the summary has, else None."""
    m = summary.get("metrics") or {}
    go = m.get("gpu_overview") or {}
    rows = go.get("per_step") if isinstance(go, Mapping) else None
    if isinstance(rows, list) and rows:
        return _from_rows(rows, GPU_OVERVIEW_PARTS, ("{}_ms", "{}"),
                          "Step breakdown (GPU overview: the TensorBoard plugin's categories)")
    st = m.get("stragglers") or {}  # a run directory: every step, not only the profiled ones
    if isinstance(st, Mapping) and st.get("busy_ms_by_rank"):
        return _from_run(st)
    cc = m.get("comm_compute") or {}
    rows = cc.get("per_step") if isinstance(cc, Mapping) and not cc.get("withheld") else None
    if isinstance(rows, list) and rows:
        return _from_rows(rows, COMM_COMPUTE_PARTS, ("{}",),
                          "Step breakdown of the profiled steps (mean over ranks)")
    return None


def _from_rows(rows: list, parts, keys, title: str) -> dict | None:
    by_step: dict = {}
    for r in rows:
        if not isinstance(r, Mapping) or r.get("step") is None or r.get("warmup"):
            continue
        vals = []
        for key, _, _ in parts:
            v = next((r.get(k.format(key)) for k in keys if _num(r.get(k.format(key)))), 0.0)
            vals.append(float(v))
        by_step.setdefault(r.get("run_step") if r.get("run_step") is not None else r["step"], []).append(vals)
    if not by_step:
        return None
    steps = sorted(by_step, key=lambda s: (not isinstance(s, int), s))[-MAX_STEPS:]
    values = [[sum(v[i] for v in by_step[s]) / len(by_step[s]) for i in range(len(parts))] for s in steps]
    present = [i for i in range(len(parts)) if any(v[i] > 0 for v in values)]
    return {"title": title, "unit": "ms", "parts": [parts[i][1:] for i in present],
            "steps": [str(s) for s in steps], "values": [[v[i] for i in present] for v in values],
            "note": None}


def _from_run(st: Mapping) -> dict | None:
    """Each step, the rank the others wait for (most own work + input wait; run directory:
    steps, data and collective logs)."""
    steps = st.get("steps") or []
    kept = set(st.get("steps_analysed") or steps)  # warm-up and profiler-window steps left out
    busy, data, wait = (st.get(k) or {} for k in ("busy_ms_by_rank", "data_ms_by_rank", "wait_ms_by_rank"))
    labels, values = [], []
    at = [j for j, s in enumerate(steps) if s in kept][-MAX_STEPS:]
    for j in at:
        s = steps[j]
        best = None
        for r, row in busy.items():
            vals = [row[j] if j < len(row) else None,
                    (data.get(r) or [None] * len(steps))[j], (wait.get(r) or [None] * len(steps))[j]]
            vals = [float(v) if _num(v) else 0.0 for v in vals]
            if best is None or vals[0] + vals[1] > best[0] + best[1]:  # the one the others wait for
                best = vals
        if best is not None:
            labels.append(str(s))
            values.append(best)
    if not values:
        return None
    return {"title": "Step breakdown (each step, the rank the others wait for)", "unit": "ms",
            "parts": [p[1:] for p in RUN_PARTS], "steps": labels, "values": values,
            "note": "own work = step − waits in collectives − input wait (steps.jsonl, collectives.jsonl, "
                    "data.jsonl); the analysed steps (warm-up and profiler-window steps left out)"}


def breakdown_html(summary: Mapping) -> str:
    b = breakdown(summary)
    if not b:
        return ""
    n = len(b["steps"])
    top = max((sum(v) for v in b["values"]), default=0.0) or 1.0
    p = svg.Plot((-0.5, n - 0.5), (0, top * 1.05), width=min(1100, max(640, 16 * n + 420)), height=200,
                 title=b["title"], xlabel="step", ylabel="ms", xticks=svg.category_ticks(b["steps"]),
                 legend_at="right")
    for j, (s, vals) in enumerate(zip(b["steps"], b["values"])):
        y = 0.0
        for (label, colour), v in zip(b["parts"], vals):
            if v > 0:
                p.rect(j - 0.4, j + 0.4, y, y + v, colour, f"step {s} — {label}: {kit.fmt_ms(v)}")
                y += v
    for label, colour in b["parts"]:
        p.key(label, colour)
    return svg.figure(p.render(), b["title"]) + (kit.para(b["note"], "note") if b.get("note") else "")


# --------------------------------------------------------------------------- evidence
_PCT = ("fraction", "share", "_pct_of", "utilization")


def _fmt(key: str, v) -> str:
    k = str(key).lower()
    if _num(v) and any(t in k for t in _PCT) and abs(v) <= 1.5:
        return kit.fmt_pct(v)
    if _num(v) and (k.endswith("_ms") or "_ms_" in k):
        return kit.fmt_ms(v)
    return kit.fmt_value(v)


def _label(key: str) -> str:
    return str(key).replace("_ms_per_step", " per step").replace("_ms", "").replace("_", " ")


def _per_rank(v) -> bool:
    return isinstance(v, Mapping) and v and all(str(k).isdigit() for k in v) and \
        all(_num(x) for x in v.values())


STEP_KEYED = frozenset({"slow_ms"})  # evidence maps keyed by step, not rank (analyzers/slow_steps.py)


def _unit(key: str) -> str:
    """What a numeric-keyed evidence map's keys are: steps or ranks."""
    return "step" if key in STEP_KEYED or str(key).endswith("_by_step") else "rank"


def evidence_sentences(evidence: Mapping, limit: int = 6) -> list[str]:
    """The evidence as short sentences: scalars as 'label: value', per-rank maps as 'label:
    rank 0 29.9 %, rank 1 …' (largest first); nested tables are left to the raw view."""
    out, scalars = [], []
    for k, v in evidence.items():
        if _per_rank(v):
            items = sorted(v.items(), key=lambda kv: -float(kv[1]))
            u = _unit(k)
            shown = ", ".join(f"{u} {r} {_fmt(k, x)}" for r, x in items[:limit])
            more = f" and {len(items) - limit:,} more {u}s" if len(items) > limit else ""
            out.append(f"{_label(k)}: {shown}{more}.")
        elif _num(v) or isinstance(v, str):
            scalars.append(f"{_label(k)} {_fmt(k, v)}")
    if scalars:
        out.insert(0, "; ".join(scalars[:10]) + ".")
    return out


def rank_bars(evidence: Mapping) -> str:
    """A small bar chart of the first per-rank (or per-step) map of more than 2 entries (≤ 64 bars)."""
    for k, v in evidence.items():
        if _per_rank(v) and 2 < len(v) <= 64:
            items = sorted(((int(r), float(x)) for r, x in v.items()))
            top = max(x for _, x in items) or 1.0
            p = svg.Plot((-0.5, len(items) - 0.5), (0, top * 1.1), width=min(640, 14 * len(items) + 200),
                         height=90, ylabel=_label(k), xlabel=_unit(k),
                         xticks=svg.category_ticks([str(r) for r, _ in items]))
            for j, (r, x) in enumerate(items):
                p.rect(j - 0.35, j + 0.35, 0, x, "#e8a200", f"{_unit(k)} {r}: {_fmt(k, x)}")
            return svg.figure(p.render(), _label(k))
    return ""


def estimate_html(f: Mapping) -> str:
    """The finding's fix and estimate as two lines, the model and assumptions folded."""
    parts = []
    if f.get("fix"):
        parts.append(f'<div class="fix"><b>Fix:</b> {kit.esc(f["fix"])}</div>')
    e = f.get("estimate")
    if isinstance(e, Mapping):
        parts.append(f'<div class="fix"><b>Estimated gain:</b> {kit.esc(saving_text(e))} '
                     f'<span class="note">({kit.esc(e.get("basis"))})</span>'
                     f'<details><summary>how it was estimated</summary>{kit.para(e.get("model"))}'
                     + "<ul>" + "".join(f"<li>{kit.esc(x)}</li>" for x in e.get("assumptions") or [])
                     + "</ul></details></div>")
    return "".join(parts)


CSS = """
ol.actions{background:var(--card);border:1px solid var(--line);border-radius:6px;padding:10px 14px 10px 34px}
ol.actions li{margin:6px 0}
.saving{color:#2b8a3e;font-weight:600}
.blocked{color:#c92a2a;font-weight:600}
.fix{margin:4px 0}
.fix details summary{cursor:pointer;color:var(--muted);font-size:12px}
p.plain{color:var(--fg);background:#eef1f5;border:1px solid var(--line);padding:6px 10px;border-radius:4px}
"""


# --------------------------------------------------------------------------- terminal
def terminal_lines(summary: Mapping, limit: int = 5) -> list[str]:
    """'What to change first' for the terminal: one numbered item per action (plain text)."""
    acts = [a for a in (summary.get("actions") or []) if isinstance(a, Mapping)]
    out = []
    if acts:
        out.append("What to change first:")
        for n, a in enumerate(acts[:limit], 1):
            out.append(f"  {n}. {a.get('fix')} — {gain_text(a)}")
            out.append(f"     {a.get('kind')}: {a.get('evidence')}")
        if len(acts) > limit:
            out.append(f"  … {len(acts) - limit} more (see the report)")
    su = start_up_text(summary)
    if su:
        out.append("start-up: " + su)
    return out
