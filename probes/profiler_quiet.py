"""Keep what trainprof's own profiler window makes torch print out of the job's fd 2.

torch's profiler writes straight to file descriptor 2 from C++: kineto's ``USDT: ...
profiler_start`` / ``profiler_stop`` when the window starts and stops recording, and, with
memory profiling, c10's ``CPUAllocator.cpp ... Memory block of unknown size was allocated
before the profiling started`` the first time a block allocated before the window is freed
(then once per 1,000 such frees); and kineto's ``ERROR: External init callback must run in
same thread as registerClient`` when the window starts on a thread other than the one that
imported torch (Ray Train runs ``train_func`` on a thread of its worker; the profiler works
all the same). Three or four lines per rank on a wrapped job's stderr, and in the file of a
job that reused fd 2 for data.

- Each call trainprof makes into its profiler (start, step, stop, the export) runs with fd 2
  pointed at a temporary file (``quiet()``); afterwards fd 2 is restored and whatever else was
  written meanwhile (another thread of the job) is written back to it, only the profiler's own
  lines (NOISE) left out.
- The allocator's line is drawn inside such a call: a small block allocated before the window
  (``Primer``) is freed in the step that starts recording, so the message is printed there and
  its counter moves on (the job's next 999 frees of older blocks print nothing).

fd 2 is touched only for the length of these calls; a job that closed fd 2 gets nothing
redirected. The job's own profiler is never wrapped.
"""

from __future__ import annotations

import contextlib
import os
import re

NOISE = re.compile(rb"profiler_start|profiler_stop|CPUAllocator\.cpp:\d+\] Memory block of unknown "
                   rb"size|libkineto|ActivityProfilerController|External init callback must run in "
                   rb"same thread as registerClient")
MAX_KEEP = 1 << 20  # bytes written back at most (a job thread logging meanwhile)


@contextlib.contextmanager
def quiet():
    """Run the body with fd 2 redirected to a temporary file; then restore fd 2 and write back
    what is not the profiler's noise."""
    try:
        saved = os.dup(2)
    except OSError:  # fd 2 closed: nothing to protect
        yield
        return
    tmp = None
    try:
        import tempfile

        tmp = tempfile.TemporaryFile()
        os.dup2(tmp.fileno(), 2)
    except OSError:
        os.close(saved)
        if tmp is not None:
            tmp.close()
        yield
        return
    try:
        yield
    finally:
        try:
            os.dup2(saved, 2)
        finally:
            os.close(saved)
        _write_back(tmp)


def _write_back(tmp) -> None:
    try:
        tmp.seek(0)
        data = tmp.read(MAX_KEEP)
    except OSError:
        data = b""
    finally:
        tmp.close()
    if not data:
        return
    kept = b"".join(line for line in data.splitlines(keepends=True) if not NOISE.search(line))
    while kept:
        try:
            n = os.write(2, kept)
        except OSError:
            return
        kept = kept[n:]


class Primer:
    """A CPU block allocated before the window, freed (inside quiet()) when recording starts."""

    def __init__(self):
        try:
            import torch

            self._block = torch.empty(16)
        except Exception:  # noqa: BLE001 - only a nicety
            self._block = None

    def fire(self) -> None:
        self._block = None
