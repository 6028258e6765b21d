"""``accelerate``: a plain training loop built on ``Accelerator``.

A step ends when ``AcceleratedOptimizer.step`` runs with ``sync_gradients`` (a real update, also
one the fp16 grad scaler skips; inside ``accelerator.accumulate()`` the micro-steps in between
do not step); ``Accelerator.backward`` counts the micro-steps. Facts: gradient_accumulation_steps,
``num_processes`` as the data-parallel size, dtype (``mixed_precision``), the prepared model's
size and config, and samples/tokens from the inputs its forward receives (a shape-reading
pre-hook on the model ``prepare()`` returns). Inside a ``transformers.Trainer`` (which runs on
accelerate) the Trainer's callback reports instead. Wrappers only add bookkeeping after the
original call returns, and only warn if that fails.
"""

from __future__ import annotations

import functools
import sys
import weakref

from trainprof.probes import fw_tracker
from trainprof.probes.fw_tracker import Tracker, guard

NAME = "accelerate"


def patch(module) -> None:
    """Called once ``accelerate.accelerator`` has been imported by the job."""
    Accelerator = module.Accelerator
    AcceleratedOptimizer = sys.modules["accelerate.optimizer"].AcceleratedOptimizer
    if getattr(AcceleratedOptimizer.step, "_trainprof", False):
        return
    version = getattr(sys.modules.get("accelerate"), "__version__", None)
    st: dict = {"tracker": None, "accelerator": None, "leader": None}

    def tracker() -> Tracker:
        if st["tracker"] is None:
            st["tracker"] = Tracker(NAME, version, "AcceleratedOptimizer.step with sync_gradients")
        return st["tracker"]

    def begin() -> None:
        t = tracker()
        acc = st["accelerator"]() if st["accelerator"] is not None else None
        if acc is not None:
            t.dp = max(1, int(acc.num_processes))
            t.facts.update({"gradient_accumulation_steps": int(acc.gradient_accumulation_steps),
                            "dtype": {"bf16": "bf16", "fp16": "fp16"}.get(str(acc.mixed_precision), "fp32")})
        t.begin()

    init, prepare_model, backward = Accelerator.__init__, Accelerator.prepare_model, Accelerator.backward
    opt_step = AcceleratedOptimizer.step

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        st["accelerator"] = weakref.ref(self)

    @functools.wraps(prepare_model)
    def _prepare_model(self, model, *args, **kwargs):
        out = prepare_model(self, model, *args, **kwargs)

        def note():
            t = tracker()
            if "n_params" not in t.meta:
                t.model_facts(model)
            t.count_forward_inputs(out)

        guard(NAME, note)
        return out

    @functools.wraps(backward)
    def _backward(self, loss, **kwargs):
        out = backward(self, loss, **kwargs)
        t = st["tracker"]
        if t is not None and t.owns():
            t.count_micro()
        return out

    @functools.wraps(opt_step)
    def step(self, *args, **kwargs):
        if fw_tracker._owner is None and not tracker().gave_up:
            guard(NAME, begin)  # the loop's first update: claim the boundaries before it runs
        out = opt_step(self, *args, **kwargs)
        t = st["tracker"]
        try:
            if t is not None and t.owns() and self.gradient_state.sync_gradients:
                if st["leader"] is None:
                    st["leader"] = id(self)
                if st["leader"] == id(self):  # with several optimizers, the first one's updates
                    t.end_step()
        except Exception as e:  # noqa: BLE001
            t.warn_once("step", f"{NAME} integration error: {type(e).__name__}: {e}")
        return out

    for fn in (__init__, _prepare_model, _backward, step):
        fn._trainprof = True
    Accelerator.__init__, Accelerator.prepare_model = __init__, _prepare_model
    Accelerator.backward = _backward
    AcceleratedOptimizer.step = step
