"""Reading input files that may come from anywhere: regular files only, with size limits.

Run directories, traces, dumps and snapshots are copied off clusters and attached to bug
reports, so every reader goes through here:

- only regular files are read: a FIFO, a device (a stream symlinked to /dev/zero), a socket or a
  directory named like an input is refused without blocking (stat before it is opened, so a
  device is never opened; fstat again on a descriptor opened with O_NONBLOCK);
- each file is read up to a limit (``max_input_bytes()``: 1024 MB by default,
  ``TRAINPROF_MAX_INPUT_MB`` or ``trainprof analyze --max-input-mb`` change it); small JSON
  documents (manifest.json, meta.json, hang dumps) up to 1/16 of it;
- gzip data is inflated up to the same limit, and, unless the limit was set explicitly, to at
  most max(64 MB, 100 x the compressed size): real profiler traces compress 10-20x, a gzip bomb
  1000x.

A refusal raises ``InputRefused`` (an OSError, so readers that already turn OSError into one
problem line naming the file keep doing so) whose message names the file and the limit.
"""

from __future__ import annotations

import os
import stat
import zlib

ENV = "TRAINPROF_MAX_INPUT_MB"
DEFAULT_MAX_INPUT_MB = 1024
SMALL_DOC_FRACTION = 16      # manifest.json, meta.json, hang dumps: limit / 16 (64 MB by default)
GZIP_RATIO = 100             # inflating more than this (past GZIP_RATIO_FLOOR) is a bomb ...
GZIP_RATIO_FLOOR = 64 << 20  # ... unless the user set the limit explicitly
_CHUNK = 8 << 20

_override_mb: float | None = None  # set by --max-input-mb (inherited by forked trace workers)


class InputRefused(OSError):
    """An input that is not read: not a regular file, or larger than the limit. The message
    names the file and, for sizes, the limit and how to raise it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "input refused"


class SettingError(ValueError):
    """TRAINPROF_MAX_INPUT_MB holds something that is not a positive number."""


def set_max_input_mb(mb: float | None) -> None:
    """The limit for this process (and the workers it forks); None: back to the environment."""
    global _override_mb
    if mb is not None and not (mb > 0):
        raise SettingError(f"--max-input-mb must be a positive number of MB, got {mb}")
    _override_mb = mb


def _configured_mb() -> float | None:
    if _override_mb is not None:
        return _override_mb
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not (mb > 0) or mb != mb or mb == float("inf"):
        raise SettingError(f"{ENV}={raw!r}: expected a positive number of MB (default "
                           f"{DEFAULT_MAX_INPUT_MB})")
    return mb


def check_setting() -> None:
    """Raise SettingError now (for a CLI to refuse at start) if the environment's value is bad."""
    _configured_mb()


def _mb_or_none() -> float | None:
    """The configured limit; a bad environment value reads as unset here (the CLIs refuse it at
    start with check_setting, `wrap` with the other TRAINPROF_* settings): never raise mid-read."""
    try:
        return _configured_mb()
    except SettingError:
        return None


def explicit_limit() -> bool:
    return _mb_or_none() is not None


def max_input_bytes() -> int:
    mb = _mb_or_none()
    return int((mb if mb is not None else DEFAULT_MAX_INPUT_MB) * (1 << 20))


def max_doc_bytes() -> int:
    return max(1 << 20, max_input_bytes() // SMALL_DOC_FRACTION)


def fmt_mb(n: int) -> str:
    mb = n / (1 << 20)
    return f"{mb:.0f} MB" if mb >= 10 else f"{mb:.3g} MB" if mb >= 0.1 else f"{n:,} bytes"


def _how_to_raise() -> str:
    return f"raise it with --max-input-mb or {ENV}"


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike) -> tuple[int, int]:
    """(fd, size) of a regular file opened for reading; InputRefused for anything else. Never
    blocks: anything but a regular file is refused by stat before it is opened (a device is
    never opened), and, should it be swapped in between, opened with O_NONBLOCK and refused by
    fstat."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise InputRefused(f"{path}: {_kind(mode)}, not a regular file; not read")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) \
        | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputRefused(f"{path}: {_kind(st.st_mode)}, not a regular file; not read")
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def is_regular(path: str | os.PathLike) -> bool:
    """True for a regular file (following symlinks); False for anything else or an error."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_limited(path: str | os.PathLike, limit: int | None = None, what: str = "file") -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes (max_input_bytes()).
    Raises OSError (InputRefused for a non-regular or too large file)."""
    limit = max_input_bytes() if limit is None else limit
    fd, size = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        if size > limit:
            raise InputRefused(f"{path}: {fmt_mb(size)}, larger than the {fmt_mb(limit)} limit for "
                               f"a {what}; not read ({_how_to_raise()})")
        data = f.read(min(size, limit) + 1)
        if size < len(data) <= limit:  # it grew while we read
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise InputRefused(f"{path}: grew past the {fmt_mb(limit)} limit for a {what} while "
                           f"being read; not read ({_how_to_raise()})")
    return data


def read_doc(path: str | os.PathLike) -> bytes:
    """A small JSON document (manifest.json, meta.json, a hang dump)."""
    return read_limited(path, max_doc_bytes(), "JSON document")


def inflate_limit(compressed: int) -> tuple[int, str]:
    """(bytes, description) a gzip file of ``compressed`` bytes may inflate to."""
    limit = max_input_bytes()
    if explicit_limit():
        return limit, f"the {fmt_mb(limit)} limit"
    ratio_cap = max(GZIP_RATIO_FLOOR, GZIP_RATIO * compressed)
    if ratio_cap < limit:
        return ratio_cap, (f"{fmt_mb(ratio_cap)} ({GZIP_RATIO}x its compressed size: real traces "
                           f"compress 10-20x, this looks like a gzip bomb)")
    return limit, f"the {fmt_mb(limit)} limit"


class GzipError(ValueError):
    """Corrupt or truncated gzip data."""


def gunzip_limited(raw: bytes, path, zlib_mod=zlib) -> bytes:
    """Inflate (possibly concatenated) gzip members, refusing past inflate_limit(len(raw))."""
    out = list(gunzip_chunks(raw, path, zlib_mod))
    return out[0] if len(out) == 1 else b"".join(out)


def gunzip_chunks(raw: bytes, path, zlib_mod=zlib, chunk: int = _CHUNK):
    """gunzip_limited's output as it is inflated, in chunks of at most ``chunk`` bytes (a reader
    can start on the first part of a large file while the rest inflates). Raises InputRefused
    past inflate_limit(len(raw)) and GzipError on corrupt or truncated data, at the chunk where
    it is found."""
    limit, desc = inflate_limit(len(raw))
    total = 0
    data = raw
    while True:
        try:
            d = zlib_mod.decompressobj(wbits=31)
        except zlib_mod.error as e:
            raise GzipError(f"{path}: corrupt gzip data ({e})") from None
        buf = data
        while True:
            try:
                out = d.decompress(buf, chunk)
            except zlib_mod.error as e:
                raise GzipError(f"{path}: corrupt gzip data ({e})") from None
            total += len(out)
            if total > limit:
                raise InputRefused(f"{path}: inflates past {desc}; not read ({_how_to_raise()})")
            if out:
                yield out
            buf = d.unconsumed_tail
            if d.eof or (not buf and not out):
                break
        if not d.eof:
            raise GzipError(f"{path}: truncated gzip file (ends before the end of the stream)")
        data = d.unused_data
        if not data:
            break


def gzip_size_hint(raw: bytes) -> int:
    """The inflated size a gzip file's trailer states (ISIZE: its last member's size mod 2**32):
    a hint for planning work, never a limit (0 when absent)."""
    return int.from_bytes(raw[-4:], "little") if len(raw) >= 18 else 0
