"""CUDA caching-allocator snapshots (``torch.cuda.memory._dump_snapshot``): safe loading and a
small model of segments, blocks and trace entries.

Snapshots are pickles, and unpickling runs code named by the file. Users hand us snapshots from
other people's jobs, so they are loaded with the data-only unpickler of trainprof/formats/safepickle.py:
it builds only the builtin containers and primitives a snapshot consists of (dict, list, tuple,
str, bytes, int, float, bool, None), refuses every global (class, function) and every file whose
shared references would expand beyond what a real snapshot holds, with an error naming the file.
The file itself is read only if it is a regular file within the input limit (trainprof/safeio.py).

Format (torch 2.x; older snapshots lack ``requested_size`` and some trace fields)::

    {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
                   "requested_size", "stream", "segment_type": "large"|"small",
                   "segment_pool_id": (a, b), "is_expandable", "frames",
                   "blocks": [{"address", "size", "requested_size",
                               "state": "active_allocated"|"active_awaiting_free"|"inactive",
                               "frames"}]}],
     "device_traces": [[{"action": "alloc"|"free_requested"|"free_completed"|"segment_alloc"|
                         "segment_free"|"segment_map"|"segment_unmap"|"oom"|"snapshot",
                         "addr", "size", "stream", "time_us", "frames",
                         "device_free" (oom only)}]],    # one list per device
     "allocator_settings": {...}}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainprof import safeio
from trainprof.formats import safepickle

ACTIVE_STATES = ("active_allocated", "active_awaiting_free")
FREE_STATE = "inactive"


class SnapshotError(Exception):
    """A snapshot that cannot be loaded; the message names the file and what is wrong."""


def safe_load(data: bytes, source: str = "<bytes>"):
    """Unpickle ``data`` allowing plain data only, within the expansion budget."""
    return safepickle.loads(data, source, SnapshotError)


@dataclass
class Block:
    address: int
    size: int
    state: str
    requested_size: int | None = None
    frames: list = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def free(self) -> bool:
        return self.state == FREE_STATE


@dataclass
class Segment:
    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str              # "large" (> 1 MiB requests) or "small"
    pool_id: tuple                 # (0, 0) = default pool; others: graphs / mem pools
    is_expandable: bool
    blocks: list[Block]

    @property
    def pool(self) -> str:
        """Free blocks only serve requests of the same device, stream, size class and pool."""
        extra = "" if tuple(self.pool_id) in ((), (0, 0)) else f" pool {tuple(self.pool_id)}"
        return f"cuda:{self.device} stream {self.stream} {self.segment_type}{extra}"


@dataclass
class TraceEntry:
    action: str
    addr: int
    size: int
    stream: int = 0
    time_us: int | None = None
    device_free: int | None = None
    frames: list = field(default_factory=list)


@dataclass
class Snapshot:
    source: str
    segments: list[Segment]
    traces: dict[int, list[TraceEntry]]   # device -> entries, oldest first
    allocator_settings: dict = field(default_factory=dict)

    def blocks(self):
        for s in self.segments:
            yield from ((s, b) for b in s.blocks)

    def ooms(self) -> list[tuple[int, TraceEntry]]:
        return [(d, e) for d, es in self.traces.items() for e in es if e.action == "oom"]


def _int(x, what: str, source: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise SnapshotError(f"{source}: {what} should be an integer, got {type(x).__name__}")
    return x


def from_dict(obj, source: str = "<snapshot>") -> Snapshot:
    """Validate and convert a snapshot dictionary (as torch.cuda.memory._snapshot() returns)."""
    try:
        return _from_dict(obj, source)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise SnapshotError(f"{source}: not an allocator snapshot (a field has the wrong type: "
                            f"{type(e).__name__}: {e})") from None


def _from_dict(obj, source: str) -> Snapshot:
    if not isinstance(obj, dict) or "segments" not in obj:
        got = type(obj).__name__ if not isinstance(obj, dict) else f"keys {sorted(obj)[:6]}"
        raise SnapshotError(f"{source}: not an allocator snapshot (expected a dict with "
                            f"'segments' and 'device_traces'; got {got})")
    segments = []
    for i, s in enumerate(obj.get("segments") or []):
        where = f"segments[{i}]"
        if not isinstance(s, dict):
            raise SnapshotError(f"{source}: {where} is not a dict")
        blocks = []
        for j, b in enumerate(s.get("blocks") or []):
            if not isinstance(b, dict) or "size" not in b or "state" not in b:
                raise SnapshotError(f"{source}: {where}.blocks[{j}] lacks size/state")
            req = b.get("requested_size")
            blocks.append(Block(address=int(b.get("address") or 0),
                                size=_int(b["size"], f"{where}.blocks[{j}].size", source),
                                state=str(b["state"]),
                                requested_size=int(req) if isinstance(req, int) else None,
                                frames=b.get("frames") or []))
        if "total_size" not in s:
            raise SnapshotError(f"{source}: {where} lacks total_size")
        segments.append(Segment(
            device=int(s.get("device") or 0), address=int(s.get("address") or 0),
            total_size=_int(s["total_size"], f"{where}.total_size", source),
            stream=int(s.get("stream") or 0), segment_type=str(s.get("segment_type") or "large"),
            pool_id=tuple(s.get("segment_pool_id") or (0, 0)),
            is_expandable=bool(s.get("is_expandable")), blocks=blocks))
    traces: dict[int, list[TraceEntry]] = {}
    for dev, entries in enumerate(obj.get("device_traces") or []):
        out = []
        for e in entries or []:
            if not isinstance(e, dict) or "action" not in e:
                raise SnapshotError(f"{source}: device_traces[{dev}] holds an entry without 'action'")
            out.append(TraceEntry(action=str(e["action"]), addr=int(e.get("addr") or 0),
                                  size=int(e.get("size") or 0), stream=int(e.get("stream") or 0),
                                  time_us=e.get("time_us"), device_free=e.get("device_free"),
                                  frames=e.get("frames") or []))
        if out:
            traces[dev] = out
    return Snapshot(source=source, segments=segments, traces=traces,
                    allocator_settings=obj.get("allocator_settings") or {})


def load_snapshot(path) -> Snapshot:
    """Read a snapshot pickle safely (see the module docstring); SnapshotError names the file."""
    path = Path(path)
    try:
        data = safeio.read_limited(path, what="snapshot")
    except safeio.InputRefused as e:
        raise SnapshotError(str(e)) from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None
    if not data.startswith(b"\x80"):
        raise SnapshotError(f"{path}: not a pickle (torch.cuda.memory._dump_snapshot writes one)")
    return from_dict(safe_load(data, str(path)), str(path))


def looks_like_snapshot(path) -> bool:
    """Cheap check used to recognise bare snapshot files: a pickle by name or magic byte."""
    p = Path(path)
    if not safeio.is_regular(p):
        return False
    if p.suffix in (".pickle", ".pkl"):
        return True
    try:
        fd, _ = safeio.open_regular(p)
    except OSError:
        return False
    with open(fd, "rb") as f:
        return f.read(1) == b"\x80"
