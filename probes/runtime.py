"""The per-process probe singleton: activation, lookup and shutdown.

Kept free of torch imports so that `trainprof.set_run_info()` and friends cost nothing when no
probes are active.
"""

from __future__ import annotations

import os
import sys
import threading

from trainprof import settings
from trainprof.settings import check

ENV_RUN_DIR = "TRAINPROF_RUN_DIR"          # set by `trainprof wrap`: where this run is written
ENV_PROFILE_STEPS = "TRAINPROF_PROFILE_STEPS"  # e.g. "3-4" (inclusive) or "none"
ENV_DISABLE = "TRAINPROF_DISABLE"          # 1/true/yes/on turns every probe off; 0/false/no/off do not

_lock = threading.RLock()
_session = None
_run_info: dict = {}
_failed = False
_aside = False  # another process of this run is this rank (probes/rank_claim.py): no probes here


def enabled() -> bool:
    return bool(os.environ.get(ENV_RUN_DIR)) and not settings.value(ENV_DISABLE) \
        and not _failed and not _aside


def active():
    """The running ProbeSession of this process, or None."""
    s = _session
    if s is not None and s.pid != os.getpid():  # a forked child (e.g. a DataLoader worker)
        return None
    return s


def activate(reason: str):
    """Start the probes in this process (idempotent). Returns the session or None."""
    global _session, _failed, _aside
    if not enabled():
        return None
    with _lock:
        if active() is not None:
            return _session
        run_dir = os.environ[ENV_RUN_DIR]
        try:
            from trainprof.probes import rank_claim  # lazy: start-up time of the job's bootstrap

            if rank_claim.stands_aside(run_dir):  # a process a rank started, not a rank
                _aside = True
                return None
        except Exception:  # noqa: BLE001 - undecided: probe this process, as before
            rank_claim = None
        try:
            _warn_bad_settings()
            # lazy: breaks a cycle probes.runtime<->probes.session
            from trainprof.probes.session import ProbeSession

            _session = ProbeSession(run_dir, reason=reason, run_info=_run_info)
        except Exception as e:  # noqa: BLE001 - a probe failure must never stop the job
            _failed = True
            warn(f"probes disabled in this process: {type(e).__name__}: {e}")
            return None
        try:
            if rank_claim is not None:
                rank_claim.claim(run_dir, _session.rank, int(_session.meta.get("world_size") or 1))
        except Exception as e:  # noqa: BLE001
            warn(f"rank claim not recorded: {type(e).__name__}: {e}")
        return _session


def _warn_bad_settings() -> None:
    """`trainprof wrap` refuses bad TRAINPROF_* values before the job starts; a job that starts
    a session itself (trainprof.session()) gets one warning per bad value instead."""
    try:
        for problem in check(os.environ)[1]:
            if not problem.startswith("TRAINPROF_PROBES_OFF"):  # the session names unknown probes
                warn(f"{problem} (`trainprof wrap` refuses it)")
    except Exception:  # noqa: BLE001 - advice only
        pass


def remember_run_info(info: dict) -> None:
    _run_info.update(info)
    s = active()
    if s is not None:
        s.update_meta(run_info=dict(_run_info))


def shutdown() -> None:
    global _session
    with _lock:
        s = active()
        _session = None
    if s is not None:
        try:
            from trainprof.probes import rank_claim  # lazy: start-up time of the job's bootstrap

            rank_claim.release()  # a process without a session claims no rank
        except Exception:  # noqa: BLE001
            pass
        s.close()


def warn(msg: str) -> None:
    try:
        sys.stderr.write(f"trainprof: {msg}\n")
    except Exception:  # noqa: BLE001
        pass


_prctl = None


def name_native_thread() -> None:
    """Give the calling probe thread its OS name ("trainprof-tick" -> "tp-tick", 15
    characters at most): `top -H`, py-spy and /proc/PID/task/*/comm then tell the probes' own
    threads apart from the job's (`benchmarks/bench_probe_attribution.py samples` sums their CPU
    by it)."""
    global _prctl
    try:
        if not sys.platform.startswith("linux"):
            return
        if _prctl is None:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        name = threading.current_thread().name
        if not name.startswith("trainprof-"):  # never rename the job's own threads
            return
        name = "tp-" + name[len("trainprof-"):]
        _prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - a name is a convenience
        pass
