"""Run a probe's patch right after a module of the job is first executed, without importing
it ahead: importing torch.distributed.pipelining (DTensor, dynamo) costs 1-3 s of CPU per
rank, paid by every job that never uses it.

``when_imported(name, fn)`` calls ``fn(module)`` at once when ``name`` is already imported,
else once, right after the job's own import of it finished executing. One finder on
``sys.meta_path`` serves every probe; it costs one dict lookup per import. ``fn`` must not
raise (probes wrap their patches); an exception is only warned about.
"""

from __future__ import annotations

import importlib.abc
import sys

from trainprof.probes import runtime

_CALLBACKS: dict[str, list] = {}  # module name -> patches waiting for its import


def _run(name: str, module, fns) -> None:
    for fn in fns:
        try:
            fn(module)
        except Exception as e:  # noqa: BLE001 - never raise into the job's import
            runtime.warn(f"patch of {name} failed: {type(e).__name__}: {e}")


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the watched module's spec with the finders after it, and wraps its loader's
    exec_module once (set back after the call), so the patches run on the executed module."""

    def __init__(self):
        self._busy: set = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _CALLBACKS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        loader = getattr(spec, "loader", None)
        # only a loader whose exec_module is its class's (set back after one call) is wrapped
        if loader is None or not hasattr(loader, "exec_module") or \
                "exec_module" in getattr(loader, "__dict__", {"exec_module": None}):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module):
            try:
                del loader.exec_module
            except AttributeError:
                pass
            exec_module(module)
            _run(fullname, module, _CALLBACKS.pop(fullname, ()))

        loader.exec_module = exec_then_patch
        return spec


_finder: _Finder | None = None


def when_imported(name: str, fn) -> None:
    """``fn(module)`` now if ``name`` is imported, else right after the job imports it (a
    patch already waiting for ``name`` is not added twice)."""
    global _finder
    module = sys.modules.get(name)
    if module is not None:
        _run(name, module, [fn])
        return
    waiting = _CALLBACKS.setdefault(name, [])
    if fn not in waiting:
        waiting.append(fn)
    if _finder is None or _finder not in sys.meta_path:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)
