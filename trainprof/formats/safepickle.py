"""A data-only unpickler for files from other people's jobs (flight-recorder dumps, CUDA
allocator snapshots), bounded in the memory a small file can make us spend.

Unpickling runs code named by the file, and even plain data can be a bomb: a 509-byte pickle
whose lists share one nested list expands to 10^7 nodes once written out as JSON; an 11-byte
``LONG_BINPUT`` with index 2^28 makes CPython's C unpickler allocate and clear a 2 GB memo. So
``loads`` works in three passes:

1. **Opcode scan** (before anything is built): only the opcodes of plain data are admitted —
   dict, list, tuple, set, frozenset, str, bytes, bytearray (all copied from the file itself),
   int, float, bool, None, and the memo. Every opcode that imports or calls something
   (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, NEWOBJ, INST, OBJ, EXT*, PERSID, out-of-band buffers)
   is refused: the real formats hold none (torch's C++ pickler and ``pickle.dump`` of the
   snapshot dict write plain data). Memo indices must be sequential, as every pickler writes
   them.
2. **Load** with the C unpickler (find_class and persistent_load refuse as well: defence in
   depth).
3. **Expansion budget**: the loaded value is a graph whose shared references JSON, the report
   and every analyzer expand. Its size written out as a tree (nodes, and bytes of strings) is
   computed once per distinct container and compared with a budget real dumps never approach:
   ``4 x file size + 100 000`` nodes and ``64 x file size + 16 MB`` of string bytes (real dumps
   and snapshots measure 0.3 nodes and 2-3 string bytes per file byte: snapshots share frame
   dicts, nothing multiplies). Reference cycles and nesting deeper than 64 are refused too.

A refusal raises the caller's error class with a message naming the file and the limit.
"""

from __future__ import annotations

import io
import pickle
import struct

NODES_PER_BYTE, NODE_FLOOR = 4, 100_000
STR_BYTES_PER_BYTE, STR_BYTES_FLOOR = 64, 16 << 20
MAX_DEPTH = 64

# opcode byte -> how its argument is laid out
_NOARG, _FIXED, _COUNTED, _LINE = range(4)
_OPS: dict[int, tuple] = {}


def _op(code: bytes, kind: int, n: int = 0, fmt: str = "") -> None:
    _OPS[code[0]] = (kind, n, fmt)


for _c in b"(.012N\x88\x89]ael)t\x85\x86\x87}dsu\x8f\x90\x91\x94":
    _op(bytes([_c]), _NOARG)
# fixed-size arguments
for _c, _n in ((b"K", 1), (b"M", 2), (b"J", 4), (b"G", 8), (b"h", 1), (b"j", 4), (b"\x80", 1),
               (b"\x95", 8)):
    _op(_c, _FIXED, _n)
_op(b"q", _FIXED, 1, "<B")   # BINPUT
_op(b"r", _FIXED, 4, "<I")   # LONG_BINPUT
# a length, then that many bytes
for _c, _n, _f in ((b"\x8c", 1, "<B"), (b"U", 1, "<B"), (b"C", 1, "<B"), (b"X", 4, "<I"),
                   (b"T", 4, "<i"), (b"B", 4, "<I"), (b"\x8d", 8, "<Q"), (b"\x8e", 8, "<Q"),
                   (b"\x96", 8, "<Q"), (b"\x8a", 1, "<B"), (b"\x8b", 4, "<i")):
    _op(_c, _COUNTED, _n, _f)
# text protocol 0: the argument runs to the end of the line
for _c in b"ILFSVg":
    _op(bytes([_c]), _LINE)
_op(b"p", _LINE, 0, "put")    # PUT
_NAMES = {0x63: "GLOBAL", 0x93: "STACK_GLOBAL", 0x52: "REDUCE", 0x62: "BUILD", 0x81: "NEWOBJ",
          0x92: "NEWOBJ_EX", 0x69: "INST", 0x6F: "OBJ", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4",
          0x50: "PERSID", 0x51: "BINPERSID", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}


_SKIP = [-1] * 256  # bytes of argument to skip for opcodes that need no inspection; -1: look
for _c, (_kind, _n, _fmt) in _OPS.items():
    if _kind == _NOARG and _c not in (0x2E, 0x94):
        _SKIP[_c] = 0
    elif _kind == _FIXED and not _fmt:
        _SKIP[_c] = _n


_UNICODE = {0x8C, 0x58, 0x8D}


def _global_name(data: bytes, i: int, c: int, strings: tuple) -> str:
    """'module.name' a GLOBAL / STACK_GLOBAL asks for (for the message; '' if unknown)."""
    try:
        if c == 0x63:  # GLOBAL: "module\nname\n"
            parts = data[i + 1:i + 513].split(b"\n")[:2]
            return ".".join(p.decode("ascii", "replace") for p in parts)
        if c == 0x93 and all(strings):
            return ".".join(data[a:a + n][:200].decode("utf-8", "replace") for a, n in strings)
    except (ValueError, TypeError):
        pass
    return ""


def _memo_error(source, idx, memo, error):
    return error(f"{source}: refusing to load: memo index {idx} out of sequence (expected at "
                 f"most {memo}); no pickler writes that")


def scan(data: bytes, source: str, error: type[Exception]) -> None:
    """Pass 1: admit only plain-data opcodes with sequential memo indices (see module doc)."""
    n = len(data)
    i = 0
    memo = 0
    strings: tuple = (None, None)
    skip = _SKIP
    unpack = struct.unpack_from
    while i < n:
        c = data[i]
        s = skip[c]
        if s >= 0:
            i += 1 + s
            continue
        spec = _OPS.get(c)
        if spec is None:
            what = _NAMES.get(c)
            if what:
                target = _global_name(data, i, c, strings)
                raise error(f"{source}: refusing to load: the pickle asks for {what}"
                            + (f" {target}" if target else "") + f" at byte {i}; importing or "
                            f"calling code is refused, a dump holds only plain data (this file "
                            f"may be something else, or malicious)")
            raise error(f"{source}: not a readable pickle (unknown opcode 0x{c:02x} at byte {i})")
        kind, size, fmt = spec
        i += 1
        if kind == _NOARG:
            if c == 0x2E:  # STOP: the unpickler reads no further
                return
            memo += 1      # MEMOIZE
        elif kind == _FIXED:  # BINPUT / LONG_BINPUT: sequential indices only
            if i + size > n:
                break
            idx = unpack(fmt, data, i)[0]
            if idx > memo:
                raise _memo_error(source, idx, memo, error)
            memo = max(memo, idx + 1)
            i += size
        elif kind == _COUNTED:
            if i + size > n:
                break
            length = unpack(fmt, data, i)[0]
            if length < 0 or i + size + length > n:
                raise error(f"{source}: not a readable pickle (truncated data at byte {i})")
            if c in _UNICODE:  # the last two strings name a STACK_GLOBAL's target
                strings = (strings[1], (i + size, length))
            i += size + length
        else:  # _LINE
            j = data.find(b"\n", i)
            if j < 0:
                break
            if fmt == "put":
                try:
                    idx = int(data[i:j])
                except ValueError:
                    raise error(f"{source}: not a readable pickle (bad PUT at byte {i})") from None
                if idx > memo:
                    raise _memo_error(source, idx, memo, error)
                memo = max(memo, idx + 1)
            i = j + 1
    raise error(f"{source}: not a readable pickle (truncated: no STOP opcode)")


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, source, error):
        super().__init__(f)
        self._source, self._error = source, error

    def find_class(self, module, name):
        raise self._error(f"{self._source}: refusing to load: the pickle references "
                          f"{module}.{name}; a dump holds only plain data")

    def persistent_load(self, pid):
        raise self._error(f"{self._source}: refusing to load: the pickle uses persistent ids")


_LEAVES = (str, bytes, bytearray)


def expanded_size(obj, node_budget: int, byte_budget: int, source: str,
                  error: type[Exception]) -> tuple[int, int]:
    """(nodes, string bytes) of ``obj`` written out as a tree; refuses past the budgets, on a
    reference cycle and on nesting deeper than MAX_DEPTH. Cost: one visit per distinct
    container."""
    memo: dict[int, tuple[int, int]] = {}
    active: set[int] = set()

    def over(n, b):
        if n > node_budget:
            raise error(f"{source}: refusing to load: its shared references expand to more than "
                        f"{node_budget:,} values (the limit for a file of this size; real dumps "
                        f"stay far below)")
        if b > byte_budget:
            raise error(f"{source}: refusing to load: its shared references expand to more than "
                        f"{byte_budget:,} bytes of strings (the limit for a file of this size)")

    def children(x):
        if type(x) is dict:
            for k, v in x.items():
                yield k
                yield v
        else:
            yield from x

    if not isinstance(obj, (dict, list, tuple, set, frozenset)):
        return 1, len(obj) if isinstance(obj, _LEAVES) else 0
    # stack of [container, child iterator, nodes, bytes]
    stack = [[obj, children(obj), 1, 0]]
    active.add(id(obj))
    while stack:
        top = stack[-1]
        for ch in top[1]:
            t = type(ch)
            if t is dict or t is list or t is tuple or t is set or t is frozenset:
                known = memo.get(id(ch))
                if known is not None:
                    top[2] += known[0]
                    top[3] += known[1]
                    over(top[2], top[3])
                    continue
                if id(ch) in active:
                    raise error(f"{source}: refusing to load: the data holds a reference cycle "
                                f"(real dumps never do)")
                if len(stack) >= MAX_DEPTH:
                    raise error(f"{source}: refusing to load: nested deeper than {MAX_DEPTH} levels "
                                f"(real dumps nest fewer than 10)")
                active.add(id(ch))
                stack.append([ch, children(ch), 1, 0])
                break
            top[2] += 1
            if t is str or t is bytes or t is bytearray:
                top[3] += len(ch)
        else:
            stack.pop()
            active.discard(id(top[0]))
            memo[id(top[0])] = (top[2], top[3])
            over(top[2], top[3])
            if stack:
                stack[-1][2] += top[2]
                stack[-1][3] += top[3]
                over(stack[-1][2], stack[-1][3])
            else:
                return top[2], top[3]
    raise AssertionError("unreachable")


def budgets(file_bytes: int) -> tuple[int, int]:
    return (NODE_FLOOR + NODES_PER_BYTE * file_bytes,
            STR_BYTES_FLOOR + STR_BYTES_PER_BYTE * file_bytes)


def loads(data: bytes, source: str, error: type[Exception]):
    """Plain data from a pickle, or ``error`` naming ``source`` and what was refused."""
    scan(data, source, error)
    try:
        obj = _Unpickler(io.BytesIO(data), source, error).load()
    except error:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, RecursionError, OverflowError, struct.error) as e:
        raise error(f"{source}: not a readable pickle ({type(e).__name__}: {e})") from None
    nodes, strs = budgets(len(data))
    expanded_size(obj, nodes, strs, source, error)
    return obj
