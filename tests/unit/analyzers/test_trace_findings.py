"""What `trainprof analyze TRACES/` says about bare profiler traces, on small synthetic
Kineto-shaped CPU (gloo) traces built here: the part of a straggler's excess that its message
names (and the host events in it), a straggler judged over one whole-trace window (no
ProfilerStep), a plain DDP job's default group labelled `world`, the units of a whole-trace
window, a single process without the inter-rank noise, and the coverage line not counted as
an input problem."""

from __future__ import annotations

from synth import STEP_US, ev, rank_events, summary_of, write_job
import json

import pytest



def stragglers(s: dict) -> list:
    return [f for f in s["findings"] if f["kind"] == "straggler"]


# ------------------------------------------------------------------ the straggler's message
@pytest.mark.parametrize("late,part,says,not_says", [
    ("sleep", "other", ["is sleeping 20.0 ms/step longer than its peers (in <built-in function "
                        "sleep>; 20.0 ms/step more in host code outside torch ops)"],
     ["computes", "<module>", "spends"]),
    ("host", "other", ["spends 20.0 ms/step more than its peers in host code outside torch ops "
                       "— most in train.py(30): spin (+20.0 ms/step)"], ["computes", "sleeping"]),
    ("compute", "compute", ["computes 20.0 ms/step longer than its peers"], ["host code"]),
    ("idle", "idle", ["spends 20.0 ms/step more than its peers with no op recorded in the trace "
                      "(sleeping, waiting, or Python/host code the trace does not record — "
                      "record with with_stack=True to see which)"],
     ["computes", "host code outside", "is idle", "off the CPU"]),
])
def test_straggler_message_names_the_part_that_holds_the_excess(tmp_path, late, part, says, not_says):
    s = summary_of(write_job(tmp_path / late, [rank_events(None), rank_events(late)]))
    (f,) = stragglers(s)
    assert f["ranks"] == [1] and f["evidence"]["excess_in"] == part
    by_part = f["evidence"]["excess_by_part_ms_per_step"]
    assert max(by_part, key=by_part.get) == f"{part}_ms"
    for text in says:
        assert text in f["message"], f["message"]
    for text in not_says:
        assert text not in f["message"], f["message"]
    if late == "sleep":  # the innermost event holds the time, not the Python frame around it
        assert f["evidence"]["excess_other_by_name_ms_per_step"] == {
            "<built-in function sleep>": pytest.approx(20.0)}
        rows = [r for r in s["metrics"]["comm_compute"]["per_step"] if r["rank"] == 1]
        assert all(r["other_by_name_ms"] == {"<built-in function sleep>": pytest.approx(20.0)}
                   for r in rows)


def test_straggler_message_states_the_net_excess_and_the_parts_that_offset_it(tmp_path):
    # rank 1 has no op recorded for 20 ms/step, runs its aten::mm 1 ms instead of 5 and so
    # idles 4 ms more at the step's end (24 ms with no op), a net 20 ms more outside
    # communication: the message states the net and the parts that offset each other
    s = summary_of(write_job(tmp_path / "offset", [rank_events(None),
                                                   rank_events("idle", mm_us=1_000)]))
    (f,) = stragglers(s)
    parts = f["evidence"]["excess_by_part_ms_per_step"]
    assert parts["idle_ms"] == pytest.approx(24.0, abs=0.1)
    assert parts["compute_ms"] == pytest.approx(-4.0, abs=0.1)
    e = f["evidence"]["excess_ms_per_step"]
    assert e == pytest.approx(20.0, abs=0.1)
    assert (f"(net {e:.1f} ms/step more outside communication, "
            in f["message"]), f["message"]
    assert "step: no op recorded +24.0, torch ops -4.0 ms/step, each a median)" in f["message"]
    # without an offsetting part: the excess alone
    (g,) = stragglers(summary_of(write_job(tmp_path / "plain", [rank_events(None),
                                                                rank_events("idle")])))
    assert "(20.0 ms/step more outside communication, " in g["message"]
    assert "net " not in g["message"] and "each a median" not in g["message"]


# ------------------------------------------------------------------ one whole-trace window
def test_straggler_judged_over_one_whole_trace_window(tmp_path):
    s = summary_of(write_job(tmp_path / "strag", [rank_events(None, 5, profiler_steps=False),
                                                  rank_events("idle", 5, profiler_steps=False)]))
    (f,) = stragglers(s)
    assert f["ranks"] == [1] and f["evidence"]["whole_trace_window"] is True
    assert "one window over the whole trace" in f["message"] and "ms/step" not in f["message"]
    assert "rank 1 spends 100.0 ms more than its peers with no op recorded in the trace" in \
        f["message"], f["message"]
    assert f["evidence"]["excess_by_part_ms_per_step"]["idle_ms"] == pytest.approx(100.0, abs=0.1)
    assert "rank 0 waits" in f["message"]
    # the waiting rank is not blamed for exposed communication
    assert not [g for g in s["findings"] if g["kind"] == "exposed_comm"], s["findings"]
    assert s["metrics"]["comm_compute"]["waiting_for_late_ranks"]["late"] == [1]
    assert not [p for p in s["problems"] if "not judged" in p]


def test_whole_trace_window_clean_job_names_no_straggler_and_no_steps(tmp_path):
    # both ranks wait 15 ms of 30 in every iteration: exposed communication, no late rank; in
    # one window without steps every collective may be the last of its iteration (the one no
    # compute is left to hide): no saving can be shown, no finding
    s = summary_of(write_job(tmp_path / "clean", [
        rank_events(None, 5, profiler_steps=False, wait_us=15_000, early_us=3_000) for _ in range(2)]))
    assert not stragglers(s)
    assert s["metrics"]["trace_stragglers"]["whole_trace_window"] is True
    assert s["metrics"]["comm_compute"]["exposed_comm_fraction"] > 0.5
    assert not [f for f in s["findings"] if f["kind"] == "exposed_comm"], s["findings"]
    from trainprof.reports.terminal import key_metrics

    assert dict(key_metrics(s))["exposed communication"].endswith("of the traced window")


# ------------------------------------------------------------------ default group = world
def test_default_group_of_bare_gloo_traces_is_world(tmp_path):
    s = summary_of(write_job(tmp_path / "ddp", [rank_events(None, 3, early_us=3_000) for _ in range(2)]))
    cc = s["metrics"]["comm_compute"]
    assert cc["group_dims"] == {"0": "world"}
    assert {r["mesh_dim"] for r in cc["by_mesh_dim"]} == {"world"}
    (f,) = [f for f in s["findings"] if f["kind"] == "exposed_comm"]
    assert "exposed most in world" in f["message"] and "unknown" not in f["message"]


# ------------------------------------------------------------------ one process
def test_single_process_trace_has_no_inter_rank_noise(tmp_path):
    from trainprof.reports.terminal import key_metrics

    events = []
    for i in range(3):
        events += [ev(f"ProfilerStep#{i}", "user_annotation", i * STEP_US, STEP_US),
                   ev("aten::mm", "cpu_op", i * STEP_US, 20_000)]
    d = tmp_path / "one"
    d.mkdir()
    (d / "host_1.1.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    s = summary_of(d)
    assert s["run"]["world_size"] == 1
    assert "exposed communication" not in dict(key_metrics(s))
    cov = s["coverage"]
    missing = [m["analysis"] for m in cov["not_analyzed"]]
    assert missing == ["step time", "NaN origin", "hang"]
    assert "stragglers" not in cov["text"] and "desync" not in cov["text"]
    assert cov["not_applicable"] == ["stragglers over every step", "collective desync / mismatch"]
    # two ranks that communicate still have their headline and the inter-rank lines
    s2 = summary_of(write_job(tmp_path / "two", [rank_events(None, 3) for _ in range(2)]))
    assert "exposed communication" in dict(key_metrics(s2))
    assert "collective desync / mismatch" in [m["analysis"] for m in s2["coverage"]["not_analyzed"]]


# ------------------------------------------------------------------ problems vs coverage
def test_coverage_line_is_not_an_input_problem(tmp_path):
    from rich.console import Console

    from trainprof.reports.html import render_html
    from trainprof.reports.terminal import render_terminal

    s = summary_of(write_job(tmp_path / "ddp", [rank_events(None, 3) for _ in range(2)]))
    assert s["problems"] == [s["coverage"]["text"]]  # the only "problem" is the coverage line

    def terminal(summary):
        con = Console(record=True, width=200)
        render_terminal(summary, console=con)
        return con.export_text()

    assert "input problem" not in terminal(s)
    html = render_html(s)
    assert "Input that could not be (fully) read" not in html
    assert s["coverage"]["text"].split(";")[0] in html  # still shown, with the findings
    # a real input problem is still counted and listed
    bad = dict(s, problems=s["problems"] + ["x.json: truncated"])
    assert "1 input problem(s)" in terminal(bad)
    html = render_html(bad)
    assert "Input that could not be (fully) read" in html and "x.json: truncated" in html
