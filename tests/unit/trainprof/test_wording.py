"""Messages read as English: counts agree with their nouns, one rank is "rank 3", a 1:1 split of
stack groups has no majority, epoch timestamps render as times, and the terminal header names
what was analyzed (not ".")."""

from __future__ import annotations

import io

from rich.console import Console

from trainprof.reports import kit
from trainprof.reports.terminal import render_terminal
from trainprof.wording import plural, ranks_phrase, share_label, verb, wall_time


def test_plural_and_rank_phrases():
    assert [plural(n, "rank") for n in (0, 1, 2, 1024)] == ["0 ranks", "1 rank", "2 ranks", "1,024 ranks"]
    assert plural(1, "NaN") == "1 NaN" and plural(3, "bus", "buses") == "3 buses"
    assert ranks_phrase([1]) == "rank 1" and ranks_phrase([0, 1]) == "ranks 0, 1"
    assert ranks_phrase(list(range(100))) == "ranks 0–99"
    assert ranks_phrase(list(range(0, 20, 2))) == "ranks 0, 2, 4, 6, 8, 10, 12, 14 … and 2 more"
    assert verb(1, "waits", "wait") == "waits" and verb(2, "waits", "wait") == "wait"


def test_a_tie_has_no_majority():
    assert share_label(1, [1, 1]) == "tied"
    assert share_label(3, [3, 1]) == "majority" and share_label(1, [3, 1]) == "minority"
    assert share_label(2, [2]) == "all ranks"


def test_epoch_nanoseconds_render_as_a_time():
    ns = 1795613450908265471
    assert wall_time(ns) == "2026-11-25 13:30:50.908 UTC"
    html = kit.table([{"rank": 1, "detected_ns": ns, "bytes": 123456}])
    assert "2026-11-25 13:30:50.908 UTC" in html and "1,795,613" not in html
    assert "123,456" in html  # other numbers as before
    assert "2026-11-25 13:30:50.908 UTC" in kit.kv({"t_ns": ns})
    assert "12,345" in kit.kv({"wait_ns": 12345})  # a duration stays a number


def _header(run: dict, metrics: dict | None = None) -> str:
    buf = io.StringIO()
    render_terminal({"run": run, "metrics": metrics or {}, "findings": []},
                    console=Console(file=buf, width=200, highlight=False))
    return buf.getvalue()


def test_terminal_header_counts_and_names_the_input():
    out = _header({"dir": "run_single", "world_size": 1, "exit_code": 7},
                  {"step_time": {"job": {"median_ms": 13.1, "p90_ms": 13.1, "steps": 1}}})
    assert "trainprof run_single: 1 rank, exit 7" in out and "1 steps" not in out and "(p90 13.1 ms, 1 step)" in out
    one = _header({"dir": "/tmp/t", "world_size": 2,
                   "input": {"inputs": ["tb/vm_1.pt.trace.json"], "files": 1, "traces_read": 1}})
    assert one.startswith("trainprof tb/vm_1.pt.trace.json: 2 ranks")
    folder = _header({"dir": "/tmp/t/tb", "world_size": 2, "input": {"inputs": ["."], "files": 2}})
    assert folder.startswith("trainprof /tmp/t/tb: 2 ranks") and "trainprof .:" not in folder


def test_stage_imbalance_names_one_rank_as_rank():
    import pandas as pd

    from trainprof.analyzers.pipeline import _imbalance

    df = pd.DataFrame([{"step": st, "stage": s, "compute_ms_per_mb": 3.0 if s == 1 else 1.0,
                        "span_ms_per_mb": 3.0} for st in range(4) for s in (0, 1)])
    _, (f,) = _imbalance(df, {}, {0: [0], 1: [1]})
    assert f.message.startswith("pipeline stage 1 (rank 1) computes 3.0 ms"), f.message
    _, (g,) = _imbalance(df, {}, {0: [0, 2], 1: [1, 3]})
    assert g.message.startswith("pipeline stage 1 (ranks 1, 3) computes"), g.message
