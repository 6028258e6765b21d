"""Flight-recorder dumps: a data-only unpickler that refuses code, JSON dumps, gloo's quirks,
and the cross-rank match by sequence number (missing ranks, op/size mismatches)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from trainprof.analyzers import _flight_recorder as fr


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "flight-recorder.pkl"
    path.write_bytes(pickle.dumps({"version": "2.10", "entries": [_Evil(marker)]}))
    with pytest.raises(fr.FlightRecorderError) as e:
        fr.load(path)
    assert str(path) in str(e.value) and "system" in str(e.value) and "refused" in str(e.value)
    assert not marker.exists()  # nothing ran
    # Other ways in: a builtin that evaluates, an arbitrary class, every pickle protocol.
    for payload in (b"cbuiltins\neval\n(S'1+1'\ntR.", b"cos\nsystem\n(S'true'\ntR."):
        path.write_bytes(payload)
        with pytest.raises(fr.FlightRecorderError, match="refused"):
            fr.load(path)
    for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):
        path.write_bytes(pickle.dumps(_Evil(marker), protocol=proto))
        with pytest.raises(fr.FlightRecorderError, match="refused"):
            fr.load(path)
    assert not marker.exists()


def test_plain_data_pickles_load_under_every_protocol(tmp_path):
    data = {"version": "2.10", "pg_config": {}, "pg_status": {"0": {"last_enqueued_collective": 3,
            "last_started_collective": -1, "last_completed_collective": 2}},
            "entries": [_entry("0", 3, "all_reduce", [[4]])]}
    for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):
        p = tmp_path / f"d{proto}.pkl"
        p.write_bytes(pickle.dumps(data, protocol=proto))
        d = fr.load(p)
        assert d["format"] == "pickle" and d["pg_status"]["0"] == {"enqueued": 3, "started": -1,
                                                                   "completed": 2}
        assert d["entries"][0]["op"] == "all_reduce" and d["entries"][0]["seq"] == 3


def test_bad_files_name_the_file(tmp_path):
    p = tmp_path / "flight-recorder.pkl"
    p.write_bytes(pickle.dumps({"entries": []})[:-3])  # truncated
    with pytest.raises(fr.FlightRecorderError, match="not a readable pickle") as e:
        fr.load(p)
    assert str(p) in str(e.value)
    p.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(fr.FlightRecorderError, match="expected a dict"):
        fr.load(p)
    j = tmp_path / "flight-recorder.json"
    j.write_text('{"entries": [')
    with pytest.raises(fr.FlightRecorderError, match="not valid JSON") as e:
        fr.load(j)
    assert str(j) in str(e.value)


def _entry(pg, seq, op, sizes, backend="gloo", p2p=False, retired=False):
    return {"record_id": seq, "pg_id": int(pg), "process_group": (pg, "default_pg"),
            "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0,
            "op_id": seq, "profiling_name": f"{backend}:{op}", "time_created_ns": 1000 + seq,
            "input_sizes": sizes, "input_dtypes": ["Float"], "output_sizes": sizes,
            "output_dtypes": ["Float"], "state": "scheduled", "retired": retired,
            "timeout_ms": 1800000, "is_p2p": p2p,
            "frames": [{"name": op, "filename": "/x/torch/distributed/distributed_c10d.py",
                        "line": 3245}, {"name": "train_step", "filename": "/job/train.py",
                                        "line": 42}]}


def _dump(pg_status, entries, pg_config=None):
    # gloo writes pg_config with one empty-named entry (torch 2.13)
    return {"version": "2.10",
            "pg_config": pg_config if pg_config is not None else {"": {"name": "", "desc": "",
                                                                       "ranks": "[]"}},
            "comm_lib_version": "",
            "pg_status": {pg: {"last_enqueued_collective": e, "last_started_collective": -1,
                               "last_completed_collective": c} for pg, (e, c) in pg_status.items()},
            "entries": entries}


def _load_all(tmp_path, raw: dict[int, dict], fmt="pickle"):
    out = {}
    for r, d in raw.items():
        p = tmp_path / f"r{r}.{'pkl' if fmt == 'pickle' else 'json'}"
        p.write_bytes(pickle.dumps(d) if fmt == "pickle" else json.dumps(d).encode())
        out[r] = fr.load(p)
    return out


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_missing_rank_found_by_sequence_number(tmp_path, fmt):
    # ranks 0,1,3 enqueued all_reduce #5 and wait; rank 2 stopped after #4 (gloo: state stays
    # 'scheduled', pg_config empty). Rank 3's ring buffer no longer holds #1-#2.
    raw = {}
    for r in range(4):
        top = 4 if r == 2 else 5
        first = 3 if r == 3 else 1
        raw[r] = _dump({"0": (top, 4)}, [_entry("0", s, "all_reduce", [[4]], retired=s <= 4)
                                         for s in range(first, top + 1)])
    dumps = _load_all(tmp_path, raw, fmt)
    assert all(d["pg_config"] == {} for d in dumps.values())  # the empty gloo key is dropped
    cmp = fr.compare(dumps)
    assert cmp["mismatches"] == []
    assert cmp["missing"] == [{"pg": "0", "seq": 5, "op": "all_reduce", "waiting_ranks": [0, 1, 3],
                               "missing_ranks": [2], "missing_last_enqueued": {"2": 4}}]
    assert [e["seq"] for e in cmp["inflight"]["0"]] == [5] and cmp["inflight"]["2"] == []
    assert cmp["inflight"]["1"][0]["frame"] == {"file": "/job/train.py", "line": 42,
                                                "function": "train_step"}
    assert cmp["groups"]["0"]["ranks"] == [0, 1, 2, 3]


def test_op_and_size_mismatch_at_one_sequence_number(tmp_path):
    def ranks_entries(r):
        es = [_entry("0", 1, "all_reduce", [[4]], retired=True),
              _entry("0", 2, "all_gather" if r == 2 else "all_reduce", [[2]] if r == 2 else [[1]]),
              _entry("1", 1, "broadcast", [[8]] if r != 1 else [[16]])]
        # p2p entries never count as desync (send vs recv)
        es.append(_entry("0", 1, "send" if r % 2 else "recv", [[4]], p2p=True))
        return es

    raw = {r: _dump({"0": (2, 1), "1": (1, 0)}, ranks_entries(r)) for r in range(4)}
    cmp = fr.compare(_load_all(tmp_path, raw))
    by_pg = {m["pg"]: m for m in cmp["mismatches"]}
    sigs = {v["op"]: v["ranks"] for v in by_pg["0"]["by_signature"].values()}
    assert by_pg["0"]["seq"] == 2 and sigs == {"all_reduce": [0, 1, 3], "all_gather": [2]}
    sizes = sorted((v["input_sizes"], v["ranks"]) for v in by_pg["1"]["by_signature"].values())
    assert sizes == [([[8]], [0, 2, 3]), ([[16]], [1])]
    assert cmp["missing"] == []  # everyone enqueued the same count


def test_real_gloo_dump_roundtrip(tmp_path):
    """A dump taken from torch 2.13's flight recorder on a 1-rank gloo group reads in both forms.
    In a fresh interpreter: the flight recorder is process-wide, and the groups other tests of
    the same worker made and destroyed would be in it (their entries, their group ids)."""
    script = f"""
import time
from pathlib import Path
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from trainprof.analyzers import _flight_recorder as fr
out = Path({str(tmp_path)!r})
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    # gloo marks a work completed in the flight recorder from its own thread, a moment after
    # wait() returned: on a loaded host the first dump can still see it in flight
    for _ in range(200):
        (out / "flight-recorder.pkl").write_bytes(c10d._dump_fr_trace())
        d = fr.load(out / "flight-recorder.pkl")
        st = d["pg_status"][d["entries"][-1]["pg"]]
        if st["completed"] == st["enqueued"]:
            break
        time.sleep(0.01)
    (out / "flight-recorder.json").write_bytes(c10d._dump_fr_trace_json())
finally:
    dist.destroy_process_group()
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("flight-recorder.pkl", "flight-recorder.json"):
        d = fr.load(tmp_path / name)
        ops = [(e["op"], e["seq"]) for e in d["entries"] if not e["is_p2p"]]
        assert ops[-2:] == [("all_reduce", ops[-2][1]), ("broadcast", ops[-2][1] + 1)], (name, ops)
        assert d["entries"][-1]["input_sizes"] == [[3]]
        pg = d["entries"][-1]["pg"]
        assert d["pg_status"][pg]["completed"] == d["pg_status"][pg]["enqueued"]
        assert fr.inflight(d) == []
