"""Regressions found reviewing the C scan (trainprof/trace/_kineto.c): documents the typed msgspec
decoder refuses that the scan took, columns that differed from the typed decoder's, and a memory
error that came back as another error. Each test failed on the scan as first written."""

from __future__ import annotations

import numpy as np
import pytest

from trainprof.trace import _document

pytestmark = pytest.mark.skipif(_document._kineto is None or _document.msgspec is None,
                                reason="the C scan is not built in this install")


def _typed_refuses(data: bytes) -> bool:
    try:
        _document._from_structs(_document._DECODER.decode(data))
    except (_document.msgspec.ValidationError, _document.msgspec.DecodeError, ValueError,
            RecursionError):
        return True
    return False


# msgspec checks every \u escape for a valid UTF-16 surrogate pair, also in the values and keys it
# skips; the scan checked only the four hex digits outside name/cat/pid/tid/instant names.
LONE_SURROGATES = [
    rb'{"traceEvents": [{"ph": "X", "foo": "\ud800"}]}',                   # unknown key of an event
    rb'{"traceEvents": [{"ph": "X", "foo": "\udc00"}]}',                   # a lone low surrogate
    rb'{"traceEvents": [{"ph": "X", "foo": "\ud800\u0041"}]}',             # high + non-low
    rb'{"junk": "\ud800", "traceEvents": []}',                             # unknown top-level key
    rb'{"traceEvents": [{"ph": "M", "name": "\udc00"}]}',                  # a skipped phase
    rb'{"traceEvents": [{"ph": "X", "args": {"grid": {"\udc00": 1}}}]}',   # a key inside a skipped value
    rb'{"traceEvents": [{"ph": "i", "name": "[memory]", "args": {"x": "\udc00"}}]}',
]


@pytest.mark.parametrize("data", LONE_SURROGATES, ids=range(len(LONE_SURROGATES)))
def test_a_lone_surrogate_escape_anywhere_is_left_to_the_typed_decoder(data):
    assert _typed_refuses(data)
    assert _document._from_scan(data) is None


# Any-typed fields the typed decoder decodes (so refuses invalid UTF-8, numbers beyond float and
# integers of thousands of digits) but the scan only skipped: the collective keys of an event with
# no collective / process group, and the memory keys of an instant event that is not '[memory]'.
UNDECODED_ANY = [
    b'{"traceEvents": [{"ph": "X", "args": {"dtype": "\xff"}}]}',
    b'{"traceEvents": [{"ph": "X", "args": {"Seq": 1e400}}]}',
    b'{"traceEvents": [{"ph": "X", "args": {"Collective name": null, "Rank": -1e400}}]}',
    b'{"traceEvents": [{"ph": "i", "name": "x", "args": {"Bytes": 1e400}}]}',
    b'{"traceEvents": [{"ph": "i", "args": {"Addr": 1e400}}]}',
    b'{"traceEvents": [{"ph": "X", "args": {"Seq": 1' + b"0" * 5000 + b'}}]}',  # "Integer value out of range"
]


@pytest.mark.parametrize("data", UNDECODED_ANY, ids=range(len(UNDECODED_ANY)))
def test_any_fields_the_typed_decoder_decodes_are_checked(data):
    assert _typed_refuses(data)
    assert _document._from_scan(data) is None


def test_negative_zero_integer_timestamp_is_positive_zero():
    """msgspec reads the integer literal -0 as int 0, so a float field gets +0.0 (-0.0 only from
    a float literal such as -0.0); the scan gave -0.0 (np.array_equal does not tell them apart)."""
    data = (b'{"traceEvents": [{"ph": "X", "ts": -0, "dur": -0},'
            b' {"ph": "i", "name": "[memory]", "ts": -0, "args": {}}]}')
    ref = _document._from_structs(_document._DECODER.decode(data))
    got = _document._from_scan(data)
    assert got is not None
    assert np.signbit(got.ts).tolist() == np.signbit(ref.ts).tolist() == [False]
    assert np.signbit(got.dur).tolist() == np.signbit(ref.dur).tolist() == [False]
    assert [np.signbit(m[0]) for m in got.mem] == [np.signbit(m[0]) for m in ref.mem] == [False]


def test_a_memory_error_is_raised_as_memory_error():
    """A memory error while the distinct names are decoded, then a tid string that is not UTF-8:
    the scan went on calling the C API with the MemoryError set and raised SystemError."""
    _testcapi = pytest.importorskip("_testcapi")
    if not hasattr(_testcapi, "set_nomemory"):
        pytest.skip("no _testcapi.set_nomemory")
    events = ",".join('{"ph":"X","name":"n%d","cat":"c","pid":"p%d","tid":1}' % (i, i) for i in range(30))
    data = ('{"traceEvents":[' + events + ',{"ph":"X","tid":"\xff"}]}').encode("latin-1")
    assert _document._kineto.scan(data) is None
    errors = set()
    for start in range(0, 400):
        _testcapi.set_nomemory(start, start + 1)
        try:
            _document._kineto.scan(data)
        except MemoryError:
            pass
        except Exception as e:  # noqa: BLE001 - what the test is about
            errors.add(f"{type(e).__name__}: {e}")
        finally:
            _testcapi.remove_mem_hooks()
    assert not errors
