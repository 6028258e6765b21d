"""Stream files that hold nothing: empty or torn per-rank streams, said by name.

A probe opens a stream file on its first record (trainprof/rundir/files.py JsonlWriter), so a
stream file of 0 bytes is a write that failed (a full disk, a quota) and a file that does not
end in a newline was cut mid-record (the writer killed, the disk filled). Either way the
analyses that read the stream lose data: each such file is a problem line naming it, an
analysis whose stream holds no record on any rank is listed as not analyzed, and a run
directory none of whose stream files holds a complete record is "nothing analyzed" (exit 3),
never "nothing looks wrong".

Costs one ``stat`` and a read of the last byte per stream file (the first MB of a torn one).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from trainprof.rankranges import ranges

SUFFIX = ".jsonl"
PROBE = 1 << 20  # bytes of a torn file searched for one complete line
# analyses that read a stream (stream name -> analyses, as listed under coverage)
ANALYSES_OF = {
    "steps": ("step time", "stragglers over every step", "slow steps"),
    "collectives": ("stragglers over every step", "collective desync / mismatch"),
    "nan": ("NaN origin",),
    "heartbeat": ("hang",),
    "pipeline": ("pipeline bubble",),
    "memory": ("memory over the steps",),
}


@dataclass
class StreamHealth:
    empty: dict[str, list[int]] = field(default_factory=dict)   # stream -> ranks with 0 bytes
    torn: dict[str, list[int]] = field(default_factory=dict)    # stream -> ranks cut mid-record
    files: int = 0                                              # stream files seen
    with_data: dict[str, list[int]] = field(default_factory=dict)  # stream -> ranks with a line

    @property
    def any_data(self) -> bool:
        return any(self.with_data.values())

    def lost_streams(self) -> list[str]:
        """Streams present but without a complete record on any rank (empty or torn files)."""
        return sorted(s for s in set(self.empty) | set(self.torn) if not self.with_data.get(s))


def check(run) -> StreamHealth:
    """Every rank folder's stream files: which are empty, which torn, which hold a line."""
    h = StreamHealth()
    for r in sorted(run._cache.get("rank_dirs") or ()):
        d = run.rank_path(r)
        try:
            names = sorted(e.name for e in os.scandir(d) if e.name.endswith(SUFFIX))
        except OSError:
            continue  # an unreadable folder is the reader's problem line
        for name in names:
            if outside_link(d / name, d.parent.parent):
                continue  # refused by the reader, with a problem naming it
            state = _state(d / name)
            if state is None:
                continue
            h.files += 1
            stream = name[:-len(SUFFIX)]
            if state == "empty":
                h.empty.setdefault(stream, []).append(r)
            elif state == "torn":
                h.torn.setdefault(stream, []).append(r)
            if state in ("ok", "torn-with-lines"):
                h.with_data.setdefault(stream, []).append(r)
            if state == "torn-with-lines":
                h.torn.setdefault(stream, []).append(r)
    return h


def _state(p: Path) -> str | None:
    """"empty", "torn" (no complete line), "torn-with-lines", "ok"; None when not a regular
    file (the reader says why)."""
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size == 0:
            return "empty"
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if os.pread(fd, 1, st.st_size - 1) == b"\n":
            return "ok"
        head = os.pread(fd, min(st.st_size, PROBE), 0)
        return "torn-with-lines" if b"\n" in head else "torn"
    except OSError:
        return None
    finally:
        os.close(fd)


def problems(run, h: StreamHealth) -> list[str]:
    """One line per stream with empty files, one per stream with torn files, naming the files
    (the first one and the ranks)."""
    out = []
    n = len(run._cache.get("rank_dirs") or ())
    for stream, rs in sorted(h.empty.items()):
        first = run.rank_path(rs[0]) / f"{stream}{SUFFIX}"
        out.append(f"{first}{_others(rs)}: empty (0 bytes) on {_ranks(rs, n)}: the rank opened it "
                   f"but nothing reached the disk (a full disk or a failed write?); "
                   f"{_what(stream)} saw no data there")
    for stream, rs in sorted(h.torn.items()):
        if stream == "heartbeat":
            continue  # the hang analysis says it, with what the torn beat means
        first = run.rank_path(rs[0]) / f"{stream}{SUFFIX}"
        out.append(f"{first}{_others(rs)}: torn, ends mid-record on {_ranks(rs, n)} (the writer "
                   f"was stopped or the disk filled): the unfinished record is skipped")
    return out


def _others(rs: list[int]) -> str:
    return f" (and the same file of {len(rs) - 1} more rank{'s' * (len(rs) > 2)})" if len(rs) > 1 else ""


def _ranks(rs: list[int], n: int) -> str:
    head = "rank" if len(rs) == 1 else "ranks"
    return f"{head} {ranges(rs)}" + (f" ({len(rs)} of {n})" if len(rs) > 1 else "")


def _what(stream: str) -> str:
    a = ANALYSES_OF.get(stream)
    return ", ".join(a) if a else "the analyses reading it"


def not_analyzed(h: StreamHealth) -> list[dict]:
    """Coverage entries for the analyses whose stream holds no record on any rank because its
    files are empty or torn."""
    out: dict[str, dict] = {}
    for stream in h.lost_streams():
        for a in ANALYSES_OF.get(stream, ()):
            out.setdefault(a, {"analysis": a, "needs": f"{stream}{SUFFIX}, empty or torn on every "
                                                       f"rank that has it (see problems)"})
    return list(out.values())


def nothing_readable(run, h: StreamHealth) -> str | None:
    """Why a run directory with rank folders gives nothing to analyze: none of its stream
    files holds a complete record and no profiler trace is there. None otherwise."""
    if h.any_data or not h.files:
        return None
    try:
        if run.profiler_traces():
            return None
    except Exception:  # noqa: BLE001 - an unreadable profiler/ is the trace analyzers' problem
        pass
    n_empty = sum(map(len, h.empty.values()))
    n_torn = sum(map(len, h.torn.values()))
    return (f"none of the {h.files} stream file(s) of {len(run._cache.get('rank_dirs') or ())} "
            f"rank(s) holds a complete record ({n_empty} empty, {n_torn} torn: see problems) and "
            f"there is no profiler trace: a full disk or a failed write while the job ran?")


def outside_link(p: Path, root: Path) -> str | None:
    """Why stream file ``p`` must not be read: a symbolic link (its own or a folder's on the way)
    that resolves outside the run directory ``root``. None when it stays inside."""
    try:
        real, top = os.path.realpath(p), os.path.realpath(root)
    except (OSError, ValueError):
        return None
    if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
        return None
    return (f"{p}: a symbolic link to {real}, outside the run directory; not read (copy the "
            f"file into the run directory to analyze it)")
