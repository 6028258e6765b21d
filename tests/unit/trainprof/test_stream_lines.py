"""Reading a stream whose long lines repeat across ranks (every member of a group writes the same
groups.jsonl line, the NaN watch the same root record): a line read clean on one rank is not
parsed again on the others, with the same records and the same problems as the careful reader."""

from __future__ import annotations

import json

from trainprof.rundir.files import iter_jsonl
from trainprof.rundir.streams import read_records

MEMBERS = list(range(300))  # a line of > 1 KB
WORLD = json.dumps({"pg": "0", "ranks": MEMBERS, "mesh_dim": "dp", "backend": "gloo", "size": 300})


def _write(path, lines):
    path.write_text("".join(x + "\n" for x in lines))
    return path


def _careful(path, stream):
    problems: list[str] = []
    return list(iter_jsonl(path, problems, stream)), problems


def test_repeated_lines_give_the_careful_readers_records(tmp_path):
    shared: dict = {}
    files = [_write(tmp_path / f"g{r}.jsonl",
                    [WORLD, json.dumps({"pg": f"p{r}", "ranks": [r], "size": 1}), WORLD])
             for r in range(3)]
    got = []
    for f in files:
        problems: list[str] = []
        recs = read_records(f, problems, "groups", shared)
        assert (recs, problems) == _careful(f, "groups")
        got.append(recs)
    # one member list for the whole run, one dict per record (a record changed on one rank
    # does not change another's)
    assert got[0][0]["ranks"] is got[2][2]["ranks"]
    assert len({id(r) for recs in got for r in recs}) == 9
    got[1][0]["pg"] = "changed"
    assert got[2][0]["pg"] == "0"


def test_a_bad_line_beside_a_known_one_is_reported_as_before(tmp_path):
    shared: dict = {}
    read_records(_write(tmp_path / "a.jsonl", [WORLD]), [], "groups", shared)  # WORLD now known
    bad_type = json.dumps({"pg": "1", "ranks": MEMBERS[:-1] + ["x"], "size": 300})
    cases = {"malformed": [WORLD, "{not json", WORLD],
             "wrong type": [WORLD, bad_type],
             "no pg": [WORLD, json.dumps({"ranks": MEMBERS})],
             "torn tail": [WORLD]}
    for name, lines in cases.items():
        f = _write(tmp_path / f"{name}.jsonl", lines)
        if name == "torn tail":
            f.write_text(f.read_text() + WORLD[:50])
        problems: list[str] = []
        recs = read_records(f, problems, "groups", shared)
        assert (recs, problems) == _careful(f, "groups"), name
        assert len(recs) == sum(1 for x in lines if x == WORLD), name
        if name != "torn tail":
            assert problems, name


def test_nan_root_record_repeats_and_step_records_do_not(tmp_path):
    shared: dict = {}
    root = json.dumps({"kind": "root", "step": 0, "replayable": True, "replay_with": MEMBERS})
    for r in range(2):
        f = _write(tmp_path / f"n{r}.jsonl",
                   [root] + [json.dumps({"kind": "step", "step": s, "loss": 1.0 + r + s})
                             for s in range(3)])
        problems: list[str] = []
        recs = read_records(f, problems, "nan", shared)
        assert (recs, problems) == _careful(f, "nan")
        assert [x.get("loss") for x in recs[1:]] == [1.0 + r + s for s in range(3)]
