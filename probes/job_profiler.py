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
  * The time the job's profiler runs is reported as spans (ProbeSession.note_span, meta.json
    ``overhead_spans``): ``job_profiler`` from the job's first start call (_prepare_profiler /
    _enable_profiler, a schedule's warm-up included) to the end of its stop (_disable_profiler,
    also wrapped), ``job_trace_export`` around each export. The analysis leaves the steps they
    overlap out of step statistics, as it does trainprof's own profiler window. Spans that
    end before the probes activate are kept here until the session takes them.

trainprof's own profiler calls run inside ``ours()`` and pass through untouched. Every wrapper
calls the original exactly once with the job's arguments and returns its result or raises its
exception; trainprof's part of it only warns on failure.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

from trainprof.probes import runtime

_tls = threading.local()  # .ours: depth of trainprof's own profiler calls; .exporting: in an export
_installed = False
_before_session: dict | None = None  # the job's first profiler start while no session existed
_installed_ns = 0                 # when install() ran (wall clock): a profiler on before it ran since
_open_ns: int | None = None       # the job's profiler session running since (wall-clock ns)
_early_spans: list = []           # (kind, start_ns, end_ns) that ended while no session existed
MAX_EARLY_SPANS = 64


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


def _span(kind: str, start_ns: int, end_ns: int | None) -> None:
    try:
        s = runtime.active()
        if s is not None:
            s.note_span(kind, start_ns, end_ns)
        elif end_ns is not None and len(_early_spans) < MAX_EARLY_SPANS:
            _early_spans.append((kind, start_ns, end_ns))
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job profiler span not recorded: {type(e).__name__}: {e}")


def _open_span(t_ns: int) -> None:
    global _open_ns
    if _open_ns is None:  # a schedule's prepare, then its enable: one span
        _open_ns = t_ns
        _span("job_profiler", t_ns, None)


def _close_span(was_on: bool) -> None:
    global _open_ns
    start = _open_ns if _open_ns is not None else (_installed_ns if was_on else None)
    _open_ns = None
    if start is not None:
        _span("job_profiler", start, time.time_ns())


def adopt_running() -> None:
    """A profiler of the job's is on that started before install(): its span runs from then."""
    _open_span(_installed_ns or time.time_ns())


def spans_before_session() -> list[tuple]:
    """The job's profiler spans seen before the probes activated (the running one open: end
    None); handed over once."""
    out = list(_early_spans)
    _early_spans.clear()
    if _open_ns is not None:
        out.append(("job_profiler", _open_ns, None))
    return out


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
            t_ns = time.time_ns()
            _notify_start(kind)
            _open_span(t_ns)
        return original(*args, **kwargs)

    start._trainprof_original = original
    return start


def _wrap_stop(original):
    @functools.wraps(original)
    def stop(*args, **kwargs):
        if _is_ours():
            return original(*args, **kwargs)
        was_on = _open_ns is not None or enabled_now()
        try:
            return original(*args, **kwargs)
        finally:
            _close_span(was_on)

    stop._trainprof_original = original
    return stop


def _wrap_export(original):
    @functools.wraps(original)
    def export_chrome_trace(self, path, *args, **kwargs):
        # the outermost export of the job's: torch.profiler's calls the autograd profiler's
        # (on a temporary file when gzipping), which must not be recorded as well
        outer = not _is_ours() and not getattr(_tls, "exporting", False)
        if not outer:
            return original(self, path, *args, **kwargs)
        _tls.exporting = True
        t_ns = time.time_ns()
        try:
            result = original(self, path, *args, **kwargs)
        finally:
            _tls.exporting = False
            _span("job_trace_export", t_ns, time.time_ns())
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
    global _installed, _installed_ns
    if _installed:
        return
    _installed = True
    _installed_ns = time.time_ns()
    try:
        import torch.autograd.profiler as ap

        _patch(ap, "_prepare_profiler", _wrap_start, "profiler")
        _patch(ap, "_enable_profiler", _wrap_start, "profiler")
        _patch(ap, "_disable_profiler", _wrap_stop)
        _patch(ap.profile, "export_chrome_trace", _wrap_export)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job profiler detection unavailable: {type(e).__name__}: {e}")
    try:
        import torch.autograd.profiler_legacy as legacy

        _patch(legacy, "_enable_profiler_legacy", _wrap_start, "legacy profiler")
        _patch(legacy, "_disable_profiler_legacy", _wrap_stop)
    except Exception:  # noqa: BLE001 - removed in some torch versions
        pass
    try:
        from torch.profiler import profiler as tp

        _patch(tp._KinetoProfile, "export_chrome_trace", _wrap_export)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"job trace discovery unavailable: {type(e).__name__}: {e}")
