"""Where `trainprof analyze` may write summary.json and report.html, and what it does when it
cannot.

- ``--out DIR`` follows wrap's rule (trainprof/launch/outdir.py): the outputs go only into a directory
  that is missing, empty, a trainprof run directory, or that holds nothing but trainprof's own
  outputs (its summary.json and report.html, recognised by their content, and their
  temporaries); any other file there is the user's, and the analysis is refused (exit 2)
  rather than overwrite it.
- Temporaries a killed analyze left behind (``.summary.json.PID.TID.tmp``,
  ``.report.html.XXXXXXXX``) are removed before writing: those of a process that is gone, or
  older than STALE_S.
- A write that fails (a full disk, a read-only folder) raises OutputsNotWritten, which carries
  the summary: the findings are still printed (and ``--json`` still goes to stdout), then one
  line says what could not be written, exit code EXIT_NOT_WRITTEN.
- Every string of the summary is capped at MAX_STRING characters: an op name of 1 MB in a
  63 KB gzip trace must not make a 63 MB summary.json.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from trainprof.rundir.owned import ANALYSIS_OUTPUTS, read_run_manifest
from trainprof.rundir.owned import is_analysis_output as _is_analysis_output

EXIT_NOT_WRITTEN = 4  # analyzed, findings printed, but summary.json / report.html not written
STALE_S = 600.0  # a temporary this old is no live writer's
MAX_STRING = 4096  # characters of one string in summary.json (names, frames, messages)
_OWN_TMP = re.compile(r"\.(?:summary\.json|report\.html)(?:\.\d+\.\d+\.tmp|\.[A-Za-z0-9_]{8})")


class OutputsNotWritten(Exception):
    """The analysis ran, its outputs could not be written. ``summary``: what it found."""

    def __init__(self, summary: dict, path, err: OSError):
        self.summary, self.path, self.err = summary, path, err
        super().__init__(f"could not write {path} ({err.strerror or err})")


def foreign_files(out: Path) -> list[str] | None:
    """Entries of ``out`` trainprof did not write (sorted), [] when it may write there, None
    when ``out`` is missing."""
    try:
        names = sorted(os.listdir(out))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return [str(out)]
    if not names or read_run_manifest(out) is not None:
        return []
    bad = []
    for n in names:
        p = out / n
        if _OWN_TMP.fullmatch(n) and not p.is_symlink():
            continue
        if n in ANALYSIS_OUTPUTS and p.is_file() and not p.is_symlink() and _is_analysis_output(p):
            continue
        bad.append(n)
    return bad


def refusal(out: Path) -> str | None:
    """Why ``analyze --out out`` must not write there, or None."""
    try:
        bad = foreign_files(out)
    except OSError as e:
        return f"{out}: cannot list it ({e.strerror or e}); not written"
    if not bad:
        return None
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return (f"{out}: not empty and holds files trainprof did not write ({shown}); the outputs "
            f"go only into an empty folder, a trainprof run directory or one holding only "
            f"trainprof's own summary.json/report.html: use --out NEW_DIR")


def clean_stale_tmp(out: Path, names) -> list[str]:
    """Remove the temporaries of ``names`` (summary.json, report.html, FILE.summary.json, ...)
    that a killed writer left in ``out``: of a process that no longer runs, or older than
    STALE_S. Returns the names removed."""
    pats = [re.compile(re.escape(f".{n}.") + r"(?:(?P<pid>\d+)\.\d+\.tmp|[A-Za-z0-9_]{8})")
            for n in names]
    removed = []
    try:
        entries = [e for e in os.scandir(out) if e.name.startswith(".")]
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        m = next((m for p in pats if (m := p.fullmatch(e.name))), None)
        if m is None:
            continue
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            pid = m.group("pid")
            if pid and int(pid) != os.getpid() and not _alive(int(pid)) \
                    or now - e.stat(follow_symlinks=False).st_mtime > STALE_S:
                os.unlink(e.path)
                removed.append(e.name)
        except (OSError, ValueError):
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def cap_strings(obj, limit: int = MAX_STRING):
    """``obj`` with every string longer than ``limit`` cut (dict keys too), in place for
    containers; returns the (possibly new) object."""
    if isinstance(obj, str):
        return obj if len(obj) <= limit else obj[:limit] + f"… ({len(obj) - limit} more characters)"
    if isinstance(obj, dict):
        if any(isinstance(k, str) and len(k) > limit for k in obj):
            items = [(cap_strings(k, limit), v) for k, v in obj.items()]
            obj.clear()
            obj.update(items)
        for k, v in obj.items():
            if isinstance(v, (str, dict, list)):
                obj[k] = cap_strings(v, limit)
        return obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, (str, dict, list)):
                obj[i] = cap_strings(v, limit)
        return obj
    return obj
