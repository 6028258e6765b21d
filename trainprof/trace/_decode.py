"""Chrome-trace bytes -> plain column lists (trainprof/trace/_columns.py), in one pass, in
parallel pieces where the trace is large.

Each document is decoded by the C scan, the typed msgspec decoder or the tolerant orjson path
(trainprof/trace/_document.py). All run with the cyclic GC paused: the decoders create hundreds
of thousands of containers that are never cyclic, and GC passes over them cost as much as the
decode itself.

A large trace is decoded in pieces by forked children (``decode(data, pieces=k)``): Kineto writes
one event per block, so ``"\n  },\n  {\n"`` separates two events of the traceEvents array and,
holding raw newlines (never inside a JSON string), cannot fall inside a string. Each piece is
made a document of its own, decoded, and the columns come back pickled; any surprise (another
layout, a child that fails) falls back to decoding the whole document here. A gzip trace is cut
while it inflates (``decode_stream``): a child starts on the first part as soon as it is
inflated, and this process inflates and decodes the last.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle

import numpy as np

from trainprof.trace._columns import Columns
from trainprof.trace._document import DecodeError, _from_dicts, _typed, msgspec


@contextlib.contextmanager
def gc_paused():
    """The cyclic GC off for a block that builds many non-cyclic containers (nests)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# Per piece: fork, copy-on-write faults, pickling and merging cost ~10 ms, the decode of ~2 MB;
# pieces of 8 MB or more pay that back when a CPU is idle (9.8 MB in 2 pieces: this process's
# CPU time 53 -> 37 ms, the child's 36 ms).
PIECE_MIN_BYTES = 8 << 20
# This process's piece, relative to a child's: it also frees its structs and merges the others'
# columns, and a Kineto trace's first part (CPU ops, memory events) has more events per byte.
OWN_SHARE = 0.8
# decode_stream: this process's (last) piece relative to a child's (first) ones. It inflates the
# rest of the file after the last fork and merges the children's columns, but a trace's last
# part (GPU kernels, flows) holds fewer complete events per byte.
STREAM_OWN_SHARE = 1.2
_EVENTS_AT = b'\n  "traceEvents": ['
_BETWEEN = b"\n  },\n  {\n"


def decode(data: bytes, fast: bool = True, pieces: int = 1) -> Columns:
    """Raise DecodeError on invalid JSON, TypeError/ValueError on a JSON that is no trace.
    pieces > 1: decode that many parts of a large Kineto trace in parallel processes."""
    with gc_paused():
        if fast and msgspec is not None:
            try:
                if pieces > 1 and hasattr(os, "fork"):
                    c = _decode_pieces(data, min(pieces, len(data) // PIECE_MIN_BYTES))
                    if c is not None:
                        return c
                return _typed(data)
            except msgspec.ValidationError:
                pass  # valid JSON of unexpected shape: the tolerant path sorts it out
            except msgspec.DecodeError as e:
                raise DecodeError(str(e)) from None
        return _from_dicts(data)


def _cuts(data: bytes, k: int) -> list[int]:
    """Offsets of the ``}`` closing an event where the traceEvents array can be cut in k parts,
    the first (this process's) OWN_SHARE the size of each other."""
    start = data.find(_EVENTS_AT)
    if start < 0 or k < 2:
        return []
    step = (len(data) - start) / (k - 1 + OWN_SHARE)
    cuts: list[int] = []
    for j in range(1, k):
        at = start + int((j - 1 + OWN_SHARE) * step)
        p = data.find(_BETWEEN, max(at, cuts[-1] + 4 if cuts else start))
        if p < 0:
            break
        cuts.append(p + 3)
    return cuts


def _piece(data: bytes, cuts: list[int], i: int) -> bytes:
    head = b'{"traceEvents": [' if i else b""
    lo = cuts[i - 1] + 2 if i else 0          # past "}," of the previous piece's last event
    hi = cuts[i] + 1 if i < len(cuts) else len(data)
    return b"".join((head, memoryview(data)[lo:hi], b"]}" if i < len(cuts) else b""))  # one copy


def _fork_decoder(make_piece) -> tuple[int, int]:
    """(pid, read end of a pipe) of a forked child that decodes ``make_piece()`` and writes its
    pickled columns to the pipe, then leaves without cleanup."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # child
        code = 1
        try:
            os.close(r)
            out = pickle.dumps(_typed(make_piece()), protocol=5)
            with os.fdopen(w, "wb") as fh:
                fh.write(out)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _collect(kids: list) -> list[Columns] | None:
    """The children's columns in order (``kids`` emptied as they are reaped); None when one
    failed (the caller decodes the whole document, which says what is wrong)."""
    parts = []
    while kids:
        pid, r = kids[0]
        with os.fdopen(r, "rb", closefd=False) as fh:
            payload = fh.read()
        os.close(r)
        kids.pop(0)
        _, status = os.waitpid(pid, 0)
        if status != 0 or not payload:
            return None
        parts.append(pickle.loads(payload))
    return parts


def _reap(kids: list) -> None:
    for pid, r in kids:  # not collected: a failure
        os.close(r)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except OSError:
            pass
    kids.clear()


def _decode_pieces(data: bytes, k: int) -> Columns | None:
    cuts = _cuts(data, k)
    if not cuts:
        return None
    # this process's piece is copied before forking: after it, the first write to each page of
    # the heap the children share costs a copy-on-write fault (a 4x slower copy)
    own = _piece(data, cuts, 0)
    kids: list = []
    try:
        for i in range(1, len(cuts) + 1):
            kids.append(_fork_decoder(lambda i=i: _piece(data, cuts, i)))
        parts = [_typed(own)]
        del own
        rest = _collect(kids)
        if rest is None:
            return None  # the whole document, decoded here, says what is wrong
        parts += rest
    except (msgspec.ValidationError, msgspec.DecodeError, OSError, pickle.UnpicklingError, EOFError):
        return None
    finally:
        _reap(kids)
    return _concat(parts)


class _Spans:
    """Byte ranges of a document held as the chunks it was inflated in (no joined copy)."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.starts: list[int] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.starts.append(self.size)
        self.size += len(chunk)

    def views(self, lo: int, hi: int) -> list:
        out = []
        for c, s in zip(self.chunks, self.starts):
            if s + len(c) <= lo or s >= hi:
                continue
            out.append(memoryview(c)[max(lo - s, 0):min(hi - s, len(c))])
        return out

    def joined(self) -> bytes:
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)


def decode_stream(chunks, size_hint: int, pieces: int, fast: bool = True):
    """Decode a document as it is inflated: once ``chunks`` (an iterator of its bytes) has
    passed each of the first pieces' share of ``size_hint`` bytes, a forked child decodes that
    piece while this process inflates the rest, then decodes the last piece itself. Returns
    (columns, None, size, True) or, when it did not decode the document (a small one, no fork,
    another layout, a piece that failed), (None, the document's bytes, size, whether pieces were
    tried) for ``decode``. Errors of ``chunks`` (input limits, corrupt gzip) pass
    through, after any children are stopped."""
    spans = _Spans()
    k = min(pieces, size_hint // PIECE_MIN_BYTES)
    if not (fast and msgspec is not None and hasattr(os, "fork") and k >= 2):
        for ch in chunks:
            spans.add(ch)
        return None, spans.joined(), spans.size, False
    unit = size_hint / (k - 1 + STREAM_OWN_SHARE)
    cuts: list[int] = []        # offsets of the "}" closing each child's last event
    kids: list = []
    failed = False              # a fork that failed: no more pieces, the document decoded whole
    with gc_paused():
        try:
            for ch in chunks:  # its errors (input limits, corrupt gzip) propagate
                spans.add(ch)
                if failed or len(cuts) >= k - 1 or spans.size < (len(cuts) + 1) * unit:
                    continue
                if not cuts and spans.chunks[0].find(_EVENTS_AT, 0, 1 << 24) < 0:
                    failed = True  # not Kineto's layout
                    continue
                at = max(int((len(cuts) + 1) * unit) - spans.starts[-1], 0)
                p = ch.find(_BETWEEN, at)
                if p < 0:
                    continue  # the next chunk holds the cut
                cut = spans.starts[-1] + p + 3
                lo = cuts[-1] + 2 if cuts else 0
                head = b'{"traceEvents": [' if lo else b""
                views = spans.views(lo, cut + 1)
                try:
                    kids.append(_fork_decoder(lambda h=head, v=views: b"".join((h, *v, b"]}"))))
                except OSError:
                    failed = True
                    continue
                cuts.append(cut)
            if failed or not kids:
                return None, spans.joined(), spans.size, bool(kids)
            own = b"".join((b'{"traceEvents": [', *spans.views(cuts[-1] + 2, spans.size)))
            try:
                last = _typed(own)
            except (msgspec.ValidationError, msgspec.DecodeError):
                last = None
            del own
            try:
                parts = _collect(kids) if last is not None else None
            except (OSError, pickle.UnpicklingError, EOFError):
                parts = None
        finally:
            _reap(kids)
    if parts is None:
        return None, spans.joined(), spans.size, True
    return _concat(parts + [last]), None, spans.size, True


def _concat(parts: list[Columns]) -> Columns:
    c = Columns()
    offset = 0
    for p in parts:
        for k, v in p.meta.items():
            c.meta.setdefault(k, v)
        for col in ("dims", "types", "concrete", "mem"):
            getattr(c, col).extend(getattr(p, col))
        for col in set(c.launch) | set(p.launch):  # absent in a part: NaN rows
            c.launch[col] = np.concatenate([c.launch.get(col, np.full(offset, np.nan)),
                                            p.launch.get(col, np.full(len(p), np.nan))])
        for row in p.comm:
            row["row"] += offset
            c.comm.append(row)
        c.n_events += p.n_events
        c.n_bad += p.n_bad
        offset += len(p)
    for col in ("ts", "dur", "pid", "tid", "stream", "corr", "ext"):
        setattr(c, col, np.concatenate([getattr(p, col) for p in parts]))
    for col in ("name", "cat"):  # one set of distinct values, codes renumbered into it
        seen: dict = {}
        codes = []
        for p in parts:
            pc, pv = getattr(p, col)
            remap = np.fromiter((seen.setdefault(v, len(seen)) for v in pv), np.int64, len(pv))
            codes.append(remap[pc] if len(pc) else pc)
        setattr(c, col, (np.concatenate(codes), list(seen)))
    return c
