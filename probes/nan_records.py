"""The NaN watch's records of non-finite values and the candidates kept for a replay (a part of
probes/nan_watch.py's NanWatch)."""

from __future__ import annotations

import math
import time

from trainprof.probes.nan_values import _finite


class RecordBuilder:
    """The NaN watch's records of non-finite values and the candidates kept for a replay; mixed
    into NanWatch."""

    def _nonfinite_record(self, step, kind, phase, role, call, vals, tensors, created, first, t_ns):
        from trainprof.probes import nan_locate  # lazy: start-up time of the job's ranks

        rec = {"kind": "nonfinite", "step": step, "t_ns": t_ns or time.time_ns(), "phase": phase,
               "role": role, "created": bool(created), "first": bool(first)}
        if kind in ("fwd", "gout", "gin"):
            rec["module"] = call.name
            rec["module_class"] = type(call.module).__name__
        elif kind == "loss":
            rec["module"] = "<loss>"
        elif kind == "grads":
            total, norms, params = call
            bad = [p for p, n in zip(params, norms) if not math.isfinite(float(n))]
            rec["module"] = "<parameters>"
            rec["params_nonfinite"] = len(bad)
            names = [self._param_name(p) for p in bad[:5]]
            rec["first_params"] = [n for n in names if n]
        else:
            rec["module"] = "<optimizer>"
        try:
            if kind == "fwd":
                in_v, out_v = vals
                rec["inputs_max_abs"] = in_v
                rec["outputs_max_abs"] = out_v
                if tensors is not None:
                    ins, outs = tensors
                    rec["inputs"] = [nan_locate.stats(t) for t in ins[:4]]
                    rec["output"] = nan_locate.stats(next(t for t, v in zip(outs, out_v) if not _finite(v)))
                    rec["value"] = nan_locate.value_kind(rec["output"])
            elif tensors is not None:
                s = nan_locate.stats(tensors[0])
                rec["output" if kind == "loss" else "grad"] = s
                rec["value"] = nan_locate.value_kind(s)
            if "value" not in rec:
                v = next((x for x in (vals[1] if kind == "fwd" else vals) if not _finite(x)), None)
                rec["value"] = "nan" if v is not None and math.isnan(v) else "inf"
        except Exception as e:  # noqa: BLE001
            rec["evidence_error"] = f"{type(e).__name__}: {e}"
        if kind == "gin":
            rec["grad_output_finite"] = bool(call.gout_ok)
        if created:
            rec["evidence"] = ("inputs finite, output non-finite" if phase == "forward" else
                               "gradient w.r.t. outputs finite, gradient w.r.t. inputs non-finite"
                               if kind == "gin" else "first non-finite value of the step")
        self._write(rec)
        if self.detected_step is None:
            self.detected_step = step
        return rec

    def _candidate(self, rec, call, kind, tensors):
        """Keep what a replay of this module call needs (immediate mode only)."""
        if kind not in ("fwd", "gin") or call is None or call.module is None or self.replayed:
            return
        if any(c[0].get("module") == rec.get("module") and c[2]["phase"] == rec["phase"]
               for c in self.candidates):
            return  # the same module again (another micro-batch)
        torch = self.torch

        def clone(x):
            if isinstance(x, torch.Tensor):
                return x.detach().clone().requires_grad_(x.requires_grad) if x.is_floating_point() else x.detach().clone()
            if isinstance(x, (tuple, list)):
                return type(x)(clone(y) for y in x)
            if isinstance(x, dict):
                return {k: clone(v) for k, v in x.items()}
            return x

        if kind == "fwd":
            if call.args is None:
                return
            material = {"phase": "forward", "args": clone(call.args), "kwargs": clone(call.kwargs or {}),
                        "grads": None}
        else:
            if call.args is None:
                return
            now = [t._version for t in self._floats(call.args, []) + self._floats(call.kwargs or {}, [])]
            if call.versions is not None and now != call.versions:
                rec_note = "inputs were modified in place after the call; no replay"
                self._write({"kind": "op", "step": rec["step"], "module": rec["module"],
                                "phase": "backward", "op": None, "note": rec_note})
                return
            n = max(call.gouts) + 1 if call.gouts else 0
            grads = [clone(call.gouts.get(i)) for i in range(n)]
            material = {"phase": "backward", "args": clone(call.args), "kwargs": clone(call.kwargs or {}),
                        "grads": grads}
        self.candidates.append((rec, call.module, material))
