"""The run directory contract: crash-safe writers and tolerant, precise readers."""

from __future__ import annotations

import json

import pytest

from trainprof.rundir.files import JsonlWriter, RunDirError, iter_jsonl, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir


def test_torn_last_line_is_tolerated_and_other_damage_reported(tmp_path):
    run = tmp_path / "run"
    d = rank_dir(run, 3)
    w = JsonlWriter(d / "steps.jsonl")
    for i in range(3):
        w.write({"step": i, "dur_ms": 10.0 + i})
    w.close()
    with open(d / "steps.jsonl", "a") as f:
        f.write('{"step": 3, "dur_')  # the writer was killed mid-record
    problems: list[str] = []
    recs = list(iter_jsonl(d / "steps.jsonl", problems))
    assert [r["step"] for r in recs] == [0, 1, 2] and problems == []

    lines = (d / "steps.jsonl").read_text().split("\n")
    lines.insert(1, "garbage")
    (d / "steps.jsonl").write_text("\n".join(lines))
    rd = RunDir(run)
    assert rd.ranks == [3]
    assert list(rd.steps()["step"]) == [0, 1, 2]
    assert any("steps.jsonl:2: malformed" in p for p in rd.problems)


def test_writer_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    w = JsonlWriter(blocker / "sub" / "s.jsonl")  # parent is a file: cannot create
    w.write({"a": 1})
    assert w.errors == 1


def test_handed_over_records_are_serialized_at_the_flush_in_order(tmp_path):
    path = tmp_path / "s.jsonl"
    w = JsonlWriter(path, deferred=True)
    w.write({"i": 0})
    batch = [{"i": 1, "t": None}, {"i": 2, "x": float("inf")}]
    w.write_records(batch)
    w.write_records([])                          # nothing to hand over: no empty entry
    w.write_text('{"i":3}\n')
    assert not path.exists()                     # the job's thread queued, did not serialize
    w.flush()
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["i"] for r in recs] == [0, 1, 2, 3] and recs[1]["t"] is None and recs[2]["x"] is None
    w.close()
    w.write_records([{"i": 4}])                  # after close: dropped, never raises
    assert len(path.read_text().splitlines()) == 4


def test_deferred_writer_queues_until_flush_and_loses_nothing_across_threads(tmp_path):
    import threading

    path = tmp_path / "s.jsonl"
    w = JsonlWriter(path, deferred=True)
    w.write({"i": -2})
    assert not path.exists()                    # queued, not written
    w.write({"i": -1, "x": float("nan")}, urgent=True)  # goes out with everything before it
    assert [json.loads(x)["i"] for x in path.read_text().splitlines()] == [-2, -1]
    assert json.loads(path.read_text().splitlines()[1])["x"] is None  # strict JSON: NaN -> null

    stop = threading.Event()

    def flusher():  # the session's flusher thread, racing the writers
        while not stop.is_set():
            w.flush()

    writers = [threading.Thread(target=lambda k=k: [w.write({"i": k * 10_000 + j}) for j in range(3000)])
               for k in range(3)]
    f = threading.Thread(target=flusher)
    f.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    f.join()
    w.close()
    got = [json.loads(x)["i"] for x in path.read_text().splitlines()]
    assert sorted(got[2:]) == sorted(k * 10_000 + j for k in range(3) for j in range(3000))
    for k in range(3):  # each thread's records stay in its order
        mine = [i for i in got[2:] if i // 10_000 == k]
        assert mine == sorted(mine)


def test_atomic_json_and_clear_errors(tmp_path):
    write_json_atomic(tmp_path / "m.json", {"a": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1}
    with pytest.raises(RunDirError, match="no such directory"):
        RunDir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="not a trainprof run directory"):
        RunDir(tmp_path / "empty")
    run = tmp_path / "run"
    rank_dir(run, 0).mkdir(parents=True)
    (rank_dir(run, 0) / "meta.json").write_text("{not json")
    rd = RunDir(run)
    assert rd.rank_meta(0) == {}
    assert any("meta.json: not valid JSON" in p for p in rd.problems)


def test_newer_schema_is_refused_with_the_version_named(tmp_path):
    from trainprof.rundir.files import SchemaVersionError

    write_json_atomic(tmp_path / "manifest.json", {"schema_version": 99})
    with pytest.raises(SchemaVersionError, match="schema_version 99 is newer than this trainprof reads"):
        RunDir(tmp_path)


def test_writer_after_close_never_reopens(tmp_path):
    path = tmp_path / "s.jsonl"
    w = JsonlWriter(path, deferred=True)
    w.write({"i": 0})
    w.close()
    w.write({"i": 1}, urgent=True)   # a probe thread that raced the close
    w._closed = False                # ...even one that passed the closed check
    w.write_text('{"i": 2}\n', urgent=True)
    assert [json.loads(x)["i"] for x in path.read_text().splitlines()] == [0] and w._fd is None
