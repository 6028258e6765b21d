"""Coexistence with the job's own profiler.

A process can hold one profiler session (Kineto or legacy) at a time: starting a second raises
"Profiler is already enabled on this thread", and two interleaved sessions leave the profiler in
a state that can crash the process. So trainprof's window steps aside for the job's:

  * install() wraps the functions every Python profiler start goes through
    (torch.autograd.profiler._prepare_profiler / _enable_profiler — used by torch.profiler.profile,
    torch.autograd.profiler.profile, emit_nvtx, emit_itt — and the legacy profiler's
    _enable_profiler_legacy). When the job (not trainprof) calls one, the session is told first
    (ProbeSession.job_profiler_started): it stops and discards its own window, without exporting
    a partial trace, and never starts one again. Then the job's call runs unchanged.
  * install() runs when torch is imported (probes/bootstrap.py), so a start before the probes
    activate is remembered too (started_before_session()); enabled_now() says whether a profiler
    is on that started before install() (a job importing trainprof late, trainprof.session()).
  * The job's Chrome-trace exports (export_chrome_trace, which tensorboard_trace_handler calls)
    are reported to the session (ProbeSession.job_profiler_trace) once written, so the analysis
    can use the job's trace when trainprof has none.

trainprof's own profiler calls run inside ``ours()`` and pass through untouched. Every wrapper
calls the original exactly once with the job's arguments and returns its result or raises its
exception; trainprof's part of it only warns on failure.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

from trainprof.probes import runtime

_tls = threading.local()  # .ours: depth of trainprof's own profiler calls; .exporting: in an export
_installed = False
_before_session: dict | None = None  # the job's first profiler start while no session existed


@contextlib.contextmanager
def ours():
    """Mark trainprof's own profiler calls on this thread (the wrappers let them through)."""
    _tls.ours = getattr(_tls, "ours", 0) + 1
    try:
        yield
    finally:
        _tls.ours -= 1


def _is_ours() -> bool:
    return getattr(_tls, "ours", 0) > 0


def enabled_now() -> bool:
    """A profiler session is on for this thread (the job's: trainprof's is checked separately)."""
    try:
        import torch

        return bool(torch._C._autograd._profiler_enabled())
    except Exception:  # noqa: BLE001 - an older or newer torch without it: assume not
        return False


def _caller() -> dict:
    """Where the job started its profiler: the torch API it called and its own line."""
    import sys

    api, where = None, None
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__") or ""
        if mod == "torch" or mod.startswith("torch."):
            api = f"{mod}.{getattr(f.f_code, 'co_qualname', f.f_code.co_name)}"
        elif not mod.startswith(("trainprof.", "contextlib")):
            where = f"{f.f_code.co_filename}:{f.f_lineno}"
            break
        f = f.f_back
    return {"api": api, "where": where}


def started_before_session() -> dict | None:
    """The job's first profiler start seen before the probes activated (a prepared session is
    not visible otherwise: torch has no flag for it), or None."""
    return _before_session


def _notify_start(kind: str) -> None:
    global _before_session
    try:
        s = runtime.active()
        if s is not None:
            s.job_profiler_started({"kind": kind, **_caller()})
        elif _before_session is None:
            _before_session = {"kind": kind, **_caller(), "before_probes": True}
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job profiler check failed: {type(e).__name__}: {e}")


def _notify_trace(path) -> None:
    try:
        s = runtime.active()
        if s is not None and os.path.isfile(path):
            s.job_profiler_trace(os.path.abspath(path))
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"could not record the job's trace {path}: {type(e).__name__}: {e}")


def _wrap_start(original, kind: str):
    @functools.wraps(original)
    def start(*args, **kwargs):
        if not _is_ours():
            _notify_start(kind)
        return original(*args, **kwargs)

    start._trainprof_original = original
    return start


def _wrap_export(original):
    @functools.wraps(original)
    def export_chrome_trace(self, path, *args, **kwargs):
        # the outermost export of the job's: torch.profiler's calls the autograd profiler's
        # (on a temporary file when gzipping), which must not be recorded as well
        outer = not _is_ours() and not getattr(_tls, "exporting", False)
        if not outer:
            return original(self, path, *args, **kwargs)
        _tls.exporting = True
        try:
            result = original(self, path, *args, **kwargs)
        finally:
            _tls.exporting = False
        _notify_trace(path)
        return result

    export_chrome_trace._trainprof_original = original
    return export_chrome_trace


def _patch(owner, name: str, wrapper, *args) -> None:
    original = getattr(owner, name, None)
    if original is None or hasattr(original, "_trainprof_original"):
        return
    setattr(owner, name, wrapper(original, *args))


def install() -> None:
    """Wrap the profiler start and export paths (idempotent; failures only warn)."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        import torch.autograd.profiler as ap

        _patch(ap, "_prepare_profiler", _wrap_start, "profiler")
        _patch(ap, "_enable_profiler", _wrap_start, "profiler")
        _patch(ap.profile, "export_chrome_trace", _wrap_export)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job profiler detection unavailable: {type(e).__name__}: {e}")
    try:
        import torch.autograd.profiler_legacy as legacy

        _patch(legacy, "_enable_profiler_legacy", _wrap_start, "legacy profiler")
    except Exception:  # noqa: BLE001 - removed in some torch versions
        pass
    try:
        from torch.profiler import profiler as tp

        _patch(tp._KinetoProfile, "export_chrome_trace", _wrap_export)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job trace discovery unavailable: {type(e).__name__}: {e}")
