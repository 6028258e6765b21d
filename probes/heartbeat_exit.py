"""How this process is ending: an uncaught exception, ``sys.exit(non-zero)``, or a signal the
job turned into one of those (SIGINT's KeyboardInterrupt, a handler calling sys.exit).

The probes' end-of-job work that talks to other ranks (the clock probe's end estimate) asks
``failure()`` first: a process dying of an error never waits on its peers (they may be gone,
and the launcher only stops the other ranks once this one has exited). The heartbeat writes a
``failure`` record at once (``on_failure``), so the analysis sees the failure, its exception
type and text, even when the process is killed while it exits.

Hooks are chained, never replaced: ``sys.excepthook`` and ``threading.excepthook`` note the
exception, then call the hook that was there before (which prints the traceback as usual);
``sys.exit`` notes its status, then calls the original. Nothing here changes what the job
prints, raises or exits with. A ``raise SystemExit(n)`` that bypasses ``sys.exit`` is not seen
(Python keeps no trace of it by the time atexit runs): such a process exits as a clean one.
An exception in a thread other than the main one is recorded (``thread_exception``) but does
not make the process a failing one: the job may go on.
"""

from __future__ import annotations

import os
import sys
import threading
import time

MAX_TEXT = 2000  # characters of an exception's text kept

_lock = threading.RLock()  # re-entrant: an exiting signal handler may run inside it
_pid: int | None = None     # the process whose failure is recorded
_hooked = False             # the hooks are in place (a forked child inherits them)
_failure: dict | None = None
_listeners: list = []


def _text(exc) -> str:
    try:
        s = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__
        s = "<unprintable>"
    return s[:MAX_TEXT]


def _exc_record(kind: str, exc_type, exc) -> dict:
    name = getattr(exc_type, "__qualname__", None) or getattr(exc_type, "__name__", "?")
    mod = getattr(exc_type, "__module__", None)
    full = name if mod in (None, "builtins") else f"{mod}.{name}"
    return {"kind": kind, "exc_type": full, "exc": _text(exc), "t_ns": time.time_ns(),
            "thread": threading.current_thread().name}


def _notify(rec: dict) -> None:
    for fn in list(_listeners):
        try:
            fn(rec)
        except Exception:  # noqa: BLE001 - never raise into the job's exit
            pass


def note(rec: dict) -> None:
    """Record how this process is failing (the first failure wins) and tell the listeners."""
    global _failure
    if os.getpid() != _pid:
        return  # a forked child (DataLoader worker): not this rank's process
    if rec.get("kind") != "thread_exception":
        with _lock:
            if _failure is not None:
                return
            _failure = rec
    _notify(rec)


def failure() -> dict | None:
    """How this process is failing ({kind: exception|exit, ...}), or None when it is not known
    to be (a clean exit, or a forked child)."""
    return _failure if os.getpid() == _pid else None


def on_failure(fn) -> None:
    """``fn(record)`` is called once per failure (and per thread exception), on the failing
    thread, before the previous hook runs."""
    if fn not in _listeners:
        _listeners.append(fn)


def exit_code_of(status) -> int:
    """The process exit code ``sys.exit(status)`` gives."""
    if status is None:
        return 0
    if isinstance(status, int):
        return int(status) & 0xFF  # what the OS keeps of it
    return 1  # a message: printed on stderr, exit code 1


def install() -> None:
    """Chain the hooks in this process (idempotent; a forked child installs its own)."""
    global _pid, _failure, _hooked
    with _lock:
        if _pid == os.getpid():
            return
        _pid, _failure = os.getpid(), None
        _listeners.clear()
        if _hooked:
            return
        _hooked = True
    prev_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        try:
            if not issubclass(exc_type, SystemExit):
                note(_exc_record("exception", exc_type, exc))
        except Exception:  # noqa: BLE001
            pass
        return prev_hook(exc_type, exc, tb)

    excepthook.__trainprof_previous__ = prev_hook
    sys.excepthook = excepthook

    prev_thread_hook = threading.excepthook

    def thread_excepthook(args):
        try:
            if args.exc_type is not None and not issubclass(args.exc_type, SystemExit):
                main = args.thread is threading.main_thread()
                note(_exc_record("exception" if main else "thread_exception", args.exc_type,
                                 args.exc_value))
        except Exception:  # noqa: BLE001
            pass
        return prev_thread_hook(args)

    thread_excepthook.__trainprof_previous__ = prev_thread_hook
    threading.excepthook = thread_excepthook

    prev_exit = sys.exit

    def exit(*args, **kwargs):  # noqa: A001 - stands in for sys.exit
        try:
            status = args[0] if args else kwargs.get("status")
            code = exit_code_of(status)
            if code != 0:
                rec = {"kind": "exit", "exit_code": code, "t_ns": time.time_ns(),
                       "thread": threading.current_thread().name}
                if status is not None and not isinstance(status, int):
                    rec["exc"] = _text(status)
                if threading.current_thread() is threading.main_thread():
                    note(rec)
        except Exception:  # noqa: BLE001
            pass
        return prev_exit(*args, **kwargs)

    exit.__trainprof_previous__ = prev_exit
    exit.__doc__ = getattr(prev_exit, "__doc__", None)
    # pickled by reference as sys.exit, as the original is (a spawned process's target)
    exit.__module__, exit.__name__, exit.__qualname__ = "sys", "exit", "exit"
    sys.exit = exit
