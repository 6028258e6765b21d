"""A trace written so that its names collide in the C scan's hash tables: the scan's hash is keyed
by random bytes per process, so a file cannot be prepared against it; and even names that do
collide under the key in use (built here from the key, as an attacker cannot) cost the scan a
bounded number of probes: past the budget it leaves the document to the typed decoder, whose
dicts hash with the interpreter's keyed hash. Either way the columns are the typed decoder's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from trainprof.trace import _decode, _document

pytestmark = pytest.mark.skipif(_document._kineto is None or _document.msgspec is None,
                                reason="the C scan is not built in this install")

M64 = (1 << 64) - 1
C1 = 0xFF51AFD7ED558CCD  # the per-word mix of _kineto.c hash_bytes
C1_INV = pow(C1, -1, 1 << 64)
PRINTABLE = np.array([c for c in range(0x20, 0x7F) if c not in (0x22, 0x5C)], dtype=np.uint64)


def _mix(x):
    x = (x * np.uint64(C1)) & np.uint64(M64)
    return x ^ (x >> np.uint64(32))


def _unmix(y: int) -> int:
    y ^= y >> 32  # a shift by half the width undoes itself
    return (y * C1_INV) & M64


def colliding_names(key: int, count: int, seed: int = 0) -> list[str]:
    """``count`` distinct 22-character names whose quoted spans ('"' + name + '"', three words)
    hash alike under ``key``: the first word random, the last fixed, the middle one solved
    (each step of the hash is invertible given the key)."""
    rng = np.random.default_rng(seed)
    w3 = int.from_bytes(b"zzzzzzz\"", "little")
    h0 = np.uint64((key ^ 24) & M64)  # hash_bytes' start for a 24-byte span
    names: set[str] = set()
    h3 = None
    with np.errstate(over="ignore"):
        while len(names) < count:
            chars = PRINTABLE[rng.integers(0, len(PRINTABLE), size=(1 << 20, 7))]
            w1 = np.full(1 << 20, 0x22, dtype=np.uint64)  # the opening quote
            for i in range(7):
                w1 |= chars[:, i] << np.uint64(8 * (i + 1))
            h1 = _mix(h0 ^ w1)
            # the state after the third word, the same for every name (some targets leave no
            # printable middle word for these first words: another is drawn until one does)
            target = h3 if h3 is not None else int(rng.integers(0, 1 << 63)) * 2 + 1
            h2 = _unmix(target) ^ w3     # mix(h2 ^ w3) == target
            w2 = h1 ^ np.uint64(_unmix(h2))  # mix(h1 ^ w2) == h2
            ok = np.ones(len(w2), dtype=bool)
            for i in range(8):
                ok &= np.isin((w2 >> np.uint64(8 * i)) & np.uint64(0xFF), PRINTABLE)
            if not ok.any():
                continue
            h3 = target
            for a, b in zip(w1[ok], w2[ok]):
                raw = int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little") + b"zzzzzzz"
                names.add(raw[1:].decode("ascii"))
    return sorted(names)[:count]


def _doc(names) -> bytes:
    ev = [{"ph": "X", "cat": "cpu_op", "name": n, "pid": 1, "tid": 1, "ts": float(i), "dur": 0.5}
          for i, n in enumerate(names)]
    return json.dumps({"schemaVersion": 1, "traceEvents": ev}).encode()


def test_names_built_to_collide_cost_bounded_probes_and_read_right():
    k = _document._kineto
    key = 0x5DEECE66D1234567
    names = colliding_names(key, 600)
    assert len(set(names)) == 600
    data = _doc(names)
    try:
        k._set_hash_key(key)
        assert len({k._hash_span(f'"{n}"'.encode()) for n in names}) == 1  # they do collide
        assert k.scan(data) is None  # past the probe budget: the typed decoder's document
        ref = _document._from_structs(_document._DECODER.decode(data))
        assert list(ref.name[1]) == names and ref.n_events == 600
        assert list(_decode.decode(data).name[1]) == names  # what the analysis reads
        k._set_hash_key(key ^ 0xFFFF_0000_FFFF)  # under another key they are ordinary names
        assert k.scan(data) is not None
        scanned = _document._from_scan(data)
        assert list(scanned.name[1]) == names
        np.testing.assert_array_equal(scanned.name[0], ref.name[0])
    finally:
        k._set_hash_key(int.from_bytes(__import__("os").urandom(8), "little"))


def test_a_few_colliding_names_stay_on_the_fast_path():
    """A handful of names sharing a slot run is within the budget: the scan keeps them."""
    k = _document._kineto
    key = 0x0BADC0FFEE0DDF00
    names = colliding_names(key, 40, seed=1)
    data = _doc(names + ["aten::mm"] * 2000)
    try:
        k._set_hash_key(key)
        assert k.scan(data) is not None
        assert list(_document._from_scan(data).name[1]) == names + ["aten::mm"]
    finally:
        k._set_hash_key(int.from_bytes(__import__("os").urandom(8), "little"))


def test_the_key_differs_per_process():
    code = "from trainprof.trace import _kineto; print(_kineto._hash_span(b'\"aten::mm\"'))"
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(3)}
    assert len(seen) == 3
