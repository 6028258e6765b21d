"""Lightning (``lightning`` and ``pytorch_lightning``): a ``Callback`` added to every Trainer.

A step ends at the ``on_train_batch_end`` in which ``trainer.global_step`` advanced (an
optimizer update; the batches in between are gradient accumulation micro-steps). At
``on_train_start``: accumulate_grad_batches, the data-parallel size (the strategy's
``num_replicas``), dtype (``precision``), the LightningModule's size and, where it holds a
Hugging Face model, its config. Samples and tokens per step come from the batches
``on_train_batch_end`` receives. Works in every launch mode (the DDP subprocess launcher
re-runs the script, torchrun) since each process installs it when it imports Lightning. The
callback has no state to checkpoint and only warns if it fails.
"""

from __future__ import annotations

import importlib
import sys

from trainprof.probes.fw_tracker import Tracker, guard
from trainprof.probes.frameworks import after_init

_classes: dict = {}


def _dtype(precision) -> str:
    p = str(precision)
    return "bf16" if p.startswith("bf16") else "fp16" if p.startswith("16") else "fp32"


def _callback_class(package: str):
    callbacks = importlib.import_module(f"{package}.callbacks")
    name = package.split(".")[0]
    version = getattr(sys.modules.get(name), "__version__", None)

    class TrainprofCallback(callbacks.Callback):
        """Added by trainprof (`trainprof wrap`): step boundaries and run facts."""

        def __init__(self):
            self.tracker = Tracker(name, version, "on_train_batch_end where global_step advanced")
            self._global_step = None

        def __reduce__(self):  # pickled with its Trainer (ddp_spawn): a fresh one in the child
            return new_callback, (package,)

        def on_train_start(self, trainer, pl_module):
            guard(name, self._begin, trainer, pl_module)

        def _begin(self, trainer, pl_module):
            t = self.tracker
            try:
                dp = int(trainer.strategy.distributed_sampler_kwargs.get("num_replicas") or 1)
            except Exception:  # noqa: BLE001 - strategies without a distributed sampler
                dp = int(getattr(trainer, "world_size", 1) or 1)
            t.dp = max(1, dp)
            t.facts.update({"gradient_accumulation_steps": int(trainer.accumulate_grad_batches),
                            "dtype": _dtype(trainer.precision)})
            t.model_facts(pl_module)
            self._global_step = trainer.global_step
            t.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            guard(name, self._batch_end, trainer, batch)

        def _batch_end(self, trainer, batch):
            t = self.tracker
            t.count_micro()
            t.count_batch(batch)
            if self._global_step is not None and trainer.global_step != self._global_step:
                self._global_step = trainer.global_step
                t.end_step()

        def on_train_end(self, trainer, pl_module):
            guard(name, self.tracker.end)

    return TrainprofCallback, getattr(callbacks, "Checkpoint", None)


def _classes_of(package: str):
    if package not in _classes:
        _classes[package] = _callback_class(package)
    return _classes[package]


def new_callback(package: str):
    return _classes_of(package)[0]()


def _patch(module, package: str) -> None:
    def add(trainer):
        cls, checkpoint = _classes_of(package)
        cbs = trainer.callbacks
        if any(type(c).__name__ == "TrainprofCallback" for c in cbs):
            return
        # before the checkpoint callbacks, which Lightning keeps last
        at = next((i for i, c in enumerate(cbs) if checkpoint is not None and isinstance(c, checkpoint)),
                  len(cbs))
        cbs.insert(at, cls())

    after_init(module.Trainer, package.split(".")[0], add)


def patch_lightning(module) -> None:
    _patch(module, "lightning.pytorch")


def patch_pytorch_lightning(module) -> None:
    _patch(module, "pytorch_lightning")
