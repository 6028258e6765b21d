"""Hostile inputs in one process: pickle bombs through formats/safepickle.py and the CLI, markup
and escapes printed as text."""

from __future__ import annotations

import json
import pickle
import shutil
import struct

import pytest

import paths
from hostile_inputs_shared import analyze, cli, problems_with, shared_list_bomb
from trainprof.formats import safepickle


FIXTURES = paths.FIXTURES / "gpu"


class Refused(Exception):
    pass


@pytest.mark.parametrize("path", ["h100_oom_snapshot.pickle", "h100_hang_run/ranks/rank-00000/flight-recorder.pkl"])
def test_real_dumps_load_unchanged_and_far_below_the_budget(path):
    data = (FIXTURES / path).read_bytes()
    obj = safepickle.loads(data, path, Refused)
    assert obj == pickle.loads(data)
    nodes, strs = safepickle.expanded_size(obj, 10**12, 10**15, path, Refused)
    node_budget, str_budget = safepickle.budgets(len(data))
    # measured: 0.31-0.34 values and 1.8-2.7 string bytes per file byte
    assert nodes < len(data) / 2 and strs < 4 * len(data)
    assert node_budget > 10 * nodes and str_budget > 10 * strs


@pytest.mark.parametrize("depth,refused", [(4, False), (5, True), (6, True), (7, True)])
def test_shared_references_are_bounded_by_the_expanded_size(depth, refused):
    data = pickle.dumps({"entries": shared_list_bomb(depth)}, protocol=2)
    assert len(data) < 200
    if refused:  # 10^5..10^7 values from < 200 bytes: past 4 x size + 100 000
        with pytest.raises(Refused, match="expand to more than"):
            safepickle.loads(data, "x.pkl", Refused)
    else:
        assert safepickle.loads(data, "x.pkl", Refused) == {"entries": shared_list_bomb(depth)}


def test_cycles_deep_nesting_and_shared_strings():
    a: list = []
    a.append(a)
    with pytest.raises(Refused, match="reference cycle"):
        safepickle.loads(pickle.dumps(a), "c.pkl", Refused)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(Refused, match="nested deeper than 64"):
        safepickle.loads(pickle.dumps(deep), "d.pkl", Refused)
    big = "x" * 100_000  # one string shared 1000 times: 100 MB written out, from a 100 kB file
    with pytest.raises(Refused, match="bytes of strings"):
        safepickle.loads(pickle.dumps([big] * 1000), "s.pkl", Refused)


@pytest.mark.parametrize("payload,what", [
    (b"\x80\x02cbuiltins\nbytearray\nJ\x00\x94\x35\x77\x85R.", "GLOBAL builtins.bytearray"),
    (b"\x80\x04\x8c\x08builtins\x8c\x05bytes\x93J\x00\x94\x35\x77\x85R.", "STACK_GLOBAL builtins.bytes"),
    (b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 28) + b".", "memo index 268435456 out of sequence"),
    (b"\x80\x05\x96" + struct.pack("<Q", 2_000_000_000) + b"ab.", "truncated"),
])
def test_constructors_and_allocation_bombs_are_refused_before_loading(payload, what):
    with pytest.raises(Refused, match=what):
        safepickle.loads(payload, "b.pkl", Refused)


def test_every_protocol_of_plain_data_loads():
    data = {"a": [1, 2.5, None, True, "s", (1, 2)], "b": {"c": -(2**70)}}
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        assert safepickle.loads(pickle.dumps(data, protocol=proto), "p.pkl", Refused) == data


def test_allocation_bombs_through_the_cli_stay_small(tmp_path):
    """Bare snapshot files (analyze SNAPSHOT): each refused with the file named, in bounded memory."""
    cases = {"bytearray.pickle": b"\x80\x02cbuiltins\nbytearray\nJ\x00\x94\x35\x77\x85R.",
             "memo.pickle": b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 28) + b".",
             "bomb.pickle": pickle.dumps({"segments": shared_list_bomb(7)}, protocol=2)}
    d = tmp_path / "snaps"
    d.mkdir()
    for name, data in cases.items():
        (d / name).write_bytes(data)
    res, summary = analyze(tmp_path, d)
    res.bounded()
    assert res.rc == 0
    for name in cases:
        assert len(problems_with(summary, name, "refusing to load")) == 1, summary["problems"]


def test_hang_prints_frames_with_markup_and_escapes_as_text(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "h100_hang_run", run)
    evil = "[/x]\x1b[31mRED\x1b]0;title\x07\u202e"
    dump = run / "ranks/rank-00000/hang-dump.json"
    doc = json.loads(dump.read_text())

    def taint(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "function" and isinstance(v, str):
                    o[k] = v + evil
                else:
                    taint(v)
        elif isinstance(o, list):
            for x in o:
                taint(x)

    taint(doc)
    dump.write_text(json.dumps(doc))
    res = cli(tmp_path, "hang", run).bounded()
    assert res.rc == 0, res.stderr
    assert "MarkupError" not in res.stderr and "[/x]" in res.stdout
    assert "\x1b" not in res.stdout and "\u202e" not in res.stdout and "\\x1b[31m" in res.stdout
    res = cli(tmp_path, "hang", run, "--json").bounded()
    assert "\x1b" not in res.stdout  # JSON escapes control characters; the data is kept whole

    def strings(o):
        if isinstance(o, dict):
            o = list(o.values())
        return [o] if isinstance(o, str) else [x for v in o for x in strings(v)] \
            if isinstance(o, list) else []

    assert any(evil in x for x in strings(json.loads(res.stdout)))


def test_terminal_summary_prints_every_input_string_as_text():
    import io

    from rich.console import Console

    from trainprof.reports.terminal import render_terminal

    evil = "\x1b[2J\x9b31m[/x][bold]\u202e"
    summary = {"run": {"dir": f"/runs/{evil}", "world_size": 2, "device": evil},
               "metrics": {}, "findings": [{"severity": "warning", "kind": f"k{evil}", "ranks": [0],
                                            "message": f"op {evil} is slow"}],
               "problems": [evil], "errors": []}
    buf = io.StringIO()
    render_terminal(summary, report_path=f"/r/{evil}", console=Console(file=buf, width=200))
    out = buf.getvalue()
    assert not any(c in out for c in "\x1b\x9b\u202e"), repr(out)
    assert "[/x][bold]" in out and "\\x1b[2J" in out and "\\u202e" in out
