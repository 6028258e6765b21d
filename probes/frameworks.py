"""Framework-native step boundaries and run facts, with no change to the job.

Hugging Face ``transformers.Trainer``, Lightning and ``accelerate`` know what a training step is
and how big it is; the global optimizer-step hook sees only optimizer updates. install()
(called by probes/bootstrap.py in every process of a wrapped job) puts a finder on
``sys.meta_path`` that waits for a framework module to finish importing, then lets the
matching probes/fw_*.py add a callback or thin wrappers to it (probes/post_import.py). trainprof
never imports a framework the job does not; the finder costs one dict lookup per import.

  * ``transformers.trainer``             -> probes/fw_transformers.py (TrainerCallback)
  * ``lightning.pytorch.trainer.trainer`` / ``pytorch_lightning.trainer.trainer``
                                         -> probes/fw_lightning.py (Callback)
  * ``accelerate.accelerator``           -> probes/fw_accelerate.py (Accelerator, AcceleratedOptimizer)

How steps and facts are counted: probes/fw_tracker.py. Any failure only warns.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

from trainprof.probes import post_import, runtime

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


_APPLIED: set = set()  # framework modules patched in this process


def _patch(name: str):
    def patch(module) -> None:
        if name not in _APPLIED:
            _APPLIED.add(name)
            _apply(name, module)
    return patch


_PATCHES = {name: _patch(name) for name in TARGETS}


def install() -> None:
    """Watch for the frameworks' imports (idempotent; probes/post_import.py); patch those
    already imported. Off with ``TRAINPROF_PROBES_OFF=frameworks``."""
    off = os.environ.get("TRAINPROF_PROBES_OFF", "")
    if "frameworks" in {x.strip() for x in off.split(",")}:
        return
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None and not hasattr(module, _READY[name]):
            continue  # still executing (imported from inside it): its import is past watching
        if name not in _APPLIED:
            post_import.when_imported(name, _PATCHES[name])
