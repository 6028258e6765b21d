"""Hugging Face ``transformers.Trainer``: a ``TrainerCallback`` added to every Trainer.

A step ends at ``on_step_end`` (one optimizer update; ``on_substep_end`` counts the gradient
accumulation micro-steps). At ``on_train_begin``: gradient_accumulation_steps, the global batch
(``get_total_train_batch_size``: micro-batch × accumulation × data-parallel ranks), dtype
(bf16/fp16 flags), the model's size and config. Tokens per step: the Trainer's
``num_input_tokens_seen`` when the job tracks it, else the ``input_ids`` the model's forward
receives (a shape-reading pre-hook) × data-parallel ranks. The callback returns nothing (never
changes ``control``), holds no state to checkpoint, and only warns if it fails.
"""

from __future__ import annotations

import sys
import weakref

from trainprof.probes.fw_tracker import Tracker, guard
from trainprof.probes.frameworks import after_init

NAME = "transformers"
_cls = None


def _dtype(args) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def _callback_class():
    from transformers.trainer_callback import TrainerCallback

    version = getattr(sys.modules.get("transformers"), "__version__", None)

    class TrainprofCallback(TrainerCallback):
        """Added by trainprof (`trainprof wrap`): step boundaries and run facts."""

        def __init__(self, trainer=None):
            self._trainer = weakref.ref(trainer) if trainer is not None else lambda: None
            self._hook = None
            self.tracker = Tracker(NAME, version, "Trainer on_step_end")

        def __reduce__(self):  # pickled or deep-copied with its Trainer: a fresh one
            return _new_callback, ()

        def on_train_begin(self, args, state, control, model=None, **kw):
            guard(NAME, self._begin, args, state, model)

        def _begin(self, args, state, model):
            t, trainer = self.tracker, self._trainer()
            ga = int(args.gradient_accumulation_steps)
            per_device = int(getattr(trainer, "_train_batch_size", None) or args.per_device_train_batch_size)
            try:
                global_batch = int(trainer.get_total_train_batch_size(args))
            except Exception:  # noqa: BLE001 - older Trainers, or no Trainer at hand
                global_batch = per_device * ga * int(args.world_size)
            t.dp = max(1, global_batch // max(1, per_device * ga))
            t.facts.update({"gradient_accumulation_steps": ga, "global_batch": global_batch,
                            "dtype": _dtype(args)})
            if getattr(args, "tf32", None):
                t.facts["tf32"] = True
            if str(getattr(args, "include_num_input_tokens_seen", "no")) not in ("no", "False", "None"):
                t.tokens_seen = lambda: state.num_input_tokens_seen
            if model is not None:
                t.model_facts(model)
                if self._hook is None:
                    self._hook = t.count_forward_inputs(model)
            t.begin()

        def on_substep_end(self, args, state, control, **kw):
            self.tracker.count_micro()

        def on_step_end(self, args, state, control, **kw):
            self.tracker.count_micro()
            guard(NAME, self.tracker.end_step)

        def on_train_end(self, args, state, control, **kw):
            guard(NAME, self._end)

        def _end(self):
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.tracker.end()

    return TrainprofCallback


def _new_callback(trainer=None):
    global _cls
    if _cls is None:
        _cls = _callback_class()
    return _cls(trainer)


def _add_callback(trainer) -> None:
    handler = trainer.callback_handler
    if not any(type(c).__name__ == "TrainprofCallback" for c in handler.callbacks):
        handler.add_callback(_new_callback(trainer))


def patch(module) -> None:
    """Called once ``transformers.trainer`` has been imported by the job."""
    after_init(module.Trainer, NAME, _add_callback)
