"""Framework-native step boundaries and run facts, with no change to the job.

Hugging Face ``transformers.Trainer``, Lightning and ``accelerate`` know what a training step is
and how big it is; the global optimizer-step hook sees only optimizer updates. install()
(called by probes/bootstrap.py in every process of a wrapped job) puts a finder on
``sys.meta_path`` that waits for a framework module to finish importing, then lets the
matching probes/fw_*.py add a callback or thin wrappers to it. trainprof never imports a
framework the job does not; the finder costs one set lookup per import.

  * ``transformers.trainer``             -> probes/fw_transformers.py (TrainerCallback)
  * ``lightning.pytorch.trainer.trainer`` / ``pytorch_lightning.trainer.trainer``
                                         -> probes/fw_lightning.py (Callback)
  * ``accelerate.accelerator``           -> probes/fw_accelerate.py (Accelerator, AcceleratedOptimizer)

How steps and facts are counted: probes/fw_tracker.py. Any failure only warns.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import os
import sys

from trainprof.probes import runtime

# module whose import we wait for -> (our module, its function taking the imported module)
TARGETS = {
    "transformers.trainer": ("trainprof.probes.fw_transformers", "patch"),
    "lightning.pytorch.trainer.trainer": ("trainprof.probes.fw_lightning", "patch_lightning"),
    "pytorch_lightning.trainer.trainer": ("trainprof.probes.fw_lightning", "patch_pytorch_lightning"),
    "accelerate.accelerator": ("trainprof.probes.fw_accelerate", "patch"),
}
_READY = {"transformers.trainer": "Trainer", "lightning.pytorch.trainer.trainer": "Trainer",
          "pytorch_lightning.trainer.trainer": "Trainer", "accelerate.accelerator": "Accelerator"}


def _apply(name: str, module) -> None:
    try:
        ours, fn = TARGETS[name]
        getattr(importlib.import_module(ours), fn)(module)
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"{name.split('.')[0]} integration not installed: {type(e).__name__}: {e}")


def after_init(cls, name: str, after) -> None:
    """Make ``cls.__init__`` call ``after(instance)`` once the original returned (guarded:
    a failure of ours only warns). Subclasses that call ``super().__init__`` get it too."""
    original = cls.__init__
    if getattr(original, "_trainprof", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            after(self)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"{name} integration error: {type(e).__name__}: {e}")

    __init__._trainprof = True
    cls.__init__ = __init__


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs _apply() right after a watched module executed (once per module)."""

    def __init__(self):
        self.pending = set(TARGETS)
        self._busy: set = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending or fullname in self._busy:
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
        self.pending.discard(fullname)
        exec_module = loader.exec_module

        def exec_then_patch(module):
            try:
                del loader.exec_module
            except AttributeError:
                pass
            exec_module(module)
            _apply(fullname, module)

        loader.exec_module = exec_then_patch
        return spec


_finder: _PostImportFinder | None = None


def install() -> None:
    """Watch for the frameworks' imports (idempotent); patch those already imported. Off with
    ``TRAINPROF_PROBES_OFF=frameworks``."""
    global _finder
    off = os.environ.get("TRAINPROF_PROBES_OFF", "")
    if "frameworks" in {x.strip() for x in off.split(",")}:
        return
    if _finder is None:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)
    for name in list(_finder.pending):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, _READY[name]):
            _finder.pending.discard(name)
            _apply(name, module)
