"""Allocator snapshots: the restricted unpickler and the segment/block model."""

from __future__ import annotations

import os
import pickle

import pytest

from trainprof.formats.snapshot import SnapshotError, from_dict, load_snapshot, safe_load


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would run os.system(...)
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [_Evil(marker)]}))
    pickle.loads(pickle.dumps(_Evil(tmp_path / "control")))  # the payload does work unrestricted
    assert (tmp_path / "control").exists()
    with pytest.raises(SnapshotError) as e:
        load_snapshot(path)
    assert str(path) in str(e.value) and "system" in str(e.value)
    assert not marker.exists()


def test_non_snapshot_inputs_name_the_file(tmp_path):
    bad = tmp_path / "a.pickle"
    bad.write_bytes(b"\x80\x04not really")
    with pytest.raises(SnapshotError, match=str(bad)):
        load_snapshot(bad)
    other = tmp_path / "b.pickle"
    other.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(SnapshotError, match="not an allocator snapshot"):
        load_snapshot(other)
    text = tmp_path / "c.pickle"
    text.write_text("hello")
    with pytest.raises(SnapshotError, match="not a pickle"):
        load_snapshot(text)


def test_builtin_containers_load():
    obj = {"a": [1, 2.5, None, True], "b": (0, 0), "c": {"x": "y"}, "d": b"raw"}
    assert safe_load(pickle.dumps(obj)) == obj


def test_model_of_segments_blocks_and_traces(tmp_path):
    raw = {
        "segments": [{"device": 0, "address": 4096, "total_size": 3 << 20, "stream": 0,
                      "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                      "blocks": [{"address": 4096, "size": 2 << 20, "requested_size": 2000000,
                                  "state": "active_allocated", "frames": []},
                                 {"address": 4096 + (2 << 20), "size": 1 << 20, "state": "inactive"}]}],
        "device_traces": [[{"action": "alloc", "addr": 4096, "size": 2 << 20, "stream": 0,
                            "time_us": 5, "frames": []},
                           {"action": "oom", "addr": 0, "size": 8 << 20, "stream": 0,
                            "device_free": 1 << 20}]],
    }
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(raw))
    s = load_snapshot(path)
    assert s == from_dict(raw, str(path))
    seg = s.segments[0]
    assert [b.active for b in seg.blocks] == [True, False] and seg.blocks[1].requested_size is None
    assert seg.pool == "cuda:0 stream 0 large"
    (dev, oom), = s.ooms()
    assert dev == 0 and oom.size == 8 << 20 and oom.device_free == 1 << 20
