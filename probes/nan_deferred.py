"""The NaN watch's deferred (CUDA) steps: flags copied without a sync, read at a later step
boundary (a part of probes/nan_watch.py's NanWatch)."""

from __future__ import annotations

import math




class DeferredSteps:
    """The NaN watch's deferred (CUDA) steps: flags copied without a sync, read at a later step
    boundary; mixed into NanWatch."""

    def _queue(self, entry):
        """Deferred mode: one concatenation and one non-blocking copy per step."""
        torch = self.torch
        vals, layout = [], []
        for kind, call, v, t_ns in entry["events"]:
            flat = v if kind != "fwd" else v[0] + v[1]
            layout.append(len(flat))
            vals += [x for x in flat if x is not None]
        for key in ("grad", "params"):
            if entry[key] is not None and not isinstance(entry[key], float):
                vals.append(entry[key])
        if entry["loss"] is not None:
            vals += entry["loss"] if isinstance(entry["loss"], list) else list(entry["loss"].reshape(-1))
        dev = [v for v in vals if isinstance(v, torch.Tensor)]
        if not dev:
            self._write_step(entry)
            return
        flat = torch.stack([v.float().reshape(()) if isinstance(v, torch.Tensor)
                            else torch.tensor(v, device=dev[0].device) for v in vals])
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda)
        host.copy_(flat, non_blocking=True)
        ev = None
        if flat.is_cuda:
            ev = torch.cuda.Event()
            ev.record()
        entry.update(host=host, cuda_event=ev)
        self._pending.append(entry)

    def _resolve_pending(self, wait=False):
        keep = []
        for e in self._pending:
            ev = e.get("cuda_event")
            if ev is not None and not ev.query():
                if not wait:
                    keep.append(e)
                    continue
                ev.synchronize()  # only at shutdown
            try:
                self._replay_events(e)
            except Exception as ex:  # noqa: BLE001
                self._fail(ex)
        self._pending = keep

    def _replay_events(self, e):
        """Feed a deferred step's events to its resolver with the copied host values."""
        vals = e["host"].tolist()
        pos = 0
        res = e["resolver"]
        for kind, call, v, t_ns in e["events"]:
            flat = v if kind != "fwd" else v[0] + v[1]
            host = []
            for x in flat:
                if x is None:
                    host.append(None)
                else:
                    host.append(vals[pos])
                    pos += 1
            if kind == "fwd":
                n = len(v[0])
                hv = (host[:n], host[n:])
            else:
                hv = host
            res.feed(kind, call, hv, None, t_ns)
        for key in ("grad", "params"):
            if e[key] is not None and not isinstance(e[key], float):
                e[key] = vals[pos]
                pos += 1
        if e["loss"] is not None:
            e["loss"] = vals[pos:]
        e["events"] = []
        self._write_step(e)

    def _write_step(self, e):
        loss = e["loss"]
        if loss is not None and not isinstance(loss, list):
            loss = loss.tolist()
        grad = e["grad"]
        grad = float(grad) if grad is not None and not isinstance(grad, float) else grad
        params = e["params"]
        if params is not None and math.isfinite(params):
            self._params_ok_step = max(e["step"], self._params_ok_step or 0)
        fin = [x for x in (loss or []) if x is not None]
        res = e["resolver"]
        rec = {"kind": "step", "step": e["step"], "t_ns": e["t_ns"],
               "loss": (sum(fin) / len(fin)) if fin and all(map(math.isfinite, fin)) else None,
               "loss_sum": sum(fin) if fin and all(map(math.isfinite, fin)) else None,
               "n_loss": len(fin), "loss_finite": all(map(math.isfinite, fin)) if fin else None,
               "grad_norm": grad if grad is not None and math.isfinite(grad) else None,
               "grad_finite": math.isfinite(grad) if grad is not None else None,
               "params_finite": math.isfinite(params) if params is not None else None,
               "params_every": self.params_interval,
               "modules_finite": res.first is None or res.first.get("role") in
               ("loss", "parameter_grads", "parameters"),
               "module_calls": e["calls"], "root_calls": e.get("roots", 0), "mode": self.modules_mode}
        if res.first is not None:
            rec["first_nonfinite"] = {k: res.first.get(k) for k in ("phase", "module", "role", "value")}
        self._write(rec)
