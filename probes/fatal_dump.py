"""Python stacks of a rank killed by a fatal signal: ``ranks/rank-N/fatal-stacks.txt``.

A rank that gloo or NCCL aborts (a C++ ``terminate``: SIGABRT), or that crashes in native code
(SIGSEGV, SIGBUS, SIGFPE, SIGILL), runs none of Python's exit code: its collective in flight is
in no log. Python's ``faulthandler``, enabled here on a file of the rank's folder (every
thread), writes every thread's Python stack from inside the signal handler, then restores the
previous handler and re-raises the signal: the process ends with the same signal and exit code
as without it, and nothing is added to its stderr.

Only when the job has not enabled faulthandler itself (``faulthandler.is_enabled()``: its own
``faulthandler.enable()``, ``-X faulthandler`` or ``PYTHONFAULTHANDLER``): a job's own dumps
stay where it sends them. A job that enables it later takes it over (its call replaces ours).

The file starts with one header line naming the process and its main thread (faulthandler
names threads by id only); at a clean close a file with nothing past that header is removed
(the file stays open: faulthandler may still write to it until the process ends). The
analysis reads it through ``RunDir.fatal_stacks`` (analyzers/hang.py).
"""

from __future__ import annotations

import faulthandler
import os
import threading

from trainprof.probes import runtime
from trainprof.rundir.files import FATAL_STACKS

PREV = "fatal-stacks.prev.txt"  # the dump of the rank's previous process (a restart)
HEADER = "# trainprof fatal-stacks v1 pid={pid} main_thread=0x{ident:016x}\n"


class FatalDump:
    def __init__(self, path):
        self.path = path
        self.pid = os.getpid()
        self.file = None
        self.header_len = 0

    def start(self) -> bool:
        if faulthandler.is_enabled():  # the job's own: never taken away
            return False
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            os.replace(self.path, self.path.with_name(PREV))  # a restarted rank's
        f = os.fdopen(_high_fd(self.path), "w", encoding="ascii")  # kept open until exit
        try:
            header = HEADER.format(pid=self.pid, ident=threading.main_thread().ident or 0)
            f.write(header)
            f.flush()
            self.header_len = len(header)
            faulthandler.enable(file=f, all_threads=True)
        except BaseException:
            f.close()
            _unlink(self.path)
            raise
        self.file = f  # referenced for the process's life (faulthandler writes to its fd)
        return True

    def close(self) -> None:
        """A clean end: remove the file when no dump was written (only trainprof's own file)."""
        if self.file is None or os.getpid() != self.pid:
            return
        try:
            if os.path.getsize(self.path) <= self.header_len:
                _unlink(self.path)
        except OSError:
            pass


HIGH_FD = 1000  # faulthandler writes to a descriptor number: keep it far from the job's


def _high_fd(path) -> int:
    """The file opened on a descriptor ≥ HIGH_FD (close-on-exec) where the limit allows: a job
    that closes its descriptors and opens its own files does not get this number back, so a
    dump never lands in a file of the job's."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        import fcntl

        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD)
    except (OSError, ImportError, AttributeError):
        return fd
    os.close(fd)
    return high


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def attach(session) -> None:
    fd = FatalDump(session.dir / FATAL_STACKS)
    try:
        if not fd.start():
            return
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"fatal-signal stacks not recorded: {type(e).__name__}: {e}")
        return
    session.state["fatal_dump"] = fd
    session.on_close(fd.close)
