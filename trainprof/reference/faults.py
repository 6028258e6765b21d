"""Fault injection with known ground truth (`--inject KIND:key=value,...`).

Each fault is applied by the training code at a named place; ``injected.json`` in the run
directory records what was injected. Analyzers never read that file; only tests do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

SPECS = {
    "straggler": {"required": {"rank", "delay_ms"}, "optional": {"from_step"}},
    "nan": {"required": {"rank", "step", "module"}, "optional": {"phase", "value"}},
    "hang": {"required": {"rank", "step"}, "optional": {"mode"}},
    "imbalance": {"required": {"stage", "extra_layers"}, "optional": set()},
    "slow_data": {"required": {"rank", "delay_ms"}, "optional": set()},
    "fragment": {"required": {"rank"}, "optional": set()},
}
INT_KEYS = {"rank", "step", "from_step", "stage", "extra_layers"}
CHOICES = {"phase": ("forward", "backward"), "value": ("nan", "inf"), "mode": ("sleep", "skip")}
DEFAULTS = {"nan": {"phase": "forward", "value": "nan"}, "hang": {"mode": "sleep"},
            "straggler": {"from_step": 0}}


class FaultSpecError(ValueError):
    pass


@dataclass
class Fault:
    kind: str
    params: dict
    performed: bool = True
    reason: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "params": self.params, "performed": self.performed, **self.extra}
        if "rank" in self.params:
            d.setdefault("ranks", [self.params["rank"]])
        if self.reason:
            d["reason"] = self.reason
        return d


def parse(spec: str) -> Fault:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in SPECS:
        raise FaultSpecError(f"--inject {spec!r}: unknown kind {kind!r} (one of {', '.join(SPECS)})")
    params = dict(DEFAULTS.get(kind, {}))
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise FaultSpecError(f"--inject {spec!r}: expected key=value, got {item!r}")
        allowed = SPECS[kind]["required"] | SPECS[kind]["optional"]
        if key not in allowed:
            raise FaultSpecError(f"--inject {spec!r}: {kind} takes {', '.join(sorted(allowed))}, not {key!r}")
        if key in INT_KEYS:
            try:
                params[key] = int(value)
            except ValueError:
                raise FaultSpecError(f"--inject {spec!r}: {key} must be an integer") from None
        elif key == "delay_ms":
            try:
                params[key] = float(value)
            except ValueError:
                raise FaultSpecError(f"--inject {spec!r}: delay_ms must be a number") from None
        else:
            if key in CHOICES and value not in CHOICES[key]:
                raise FaultSpecError(f"--inject {spec!r}: {key} must be one of {', '.join(CHOICES[key])}")
            params[key] = value
    missing = SPECS[kind]["required"] - params.keys()
    if missing:
        raise FaultSpecError(f"--inject {spec!r}: missing {', '.join(sorted(missing))}")
    return Fault(kind, params)


class Injector:
    """The faults that concern this rank, applied at the training loop's hook points."""

    def __init__(self, faults: list[Fault], rank: int, world: int):
        self.faults, self.rank = faults, rank
        for f in faults:
            r = f.params.get("rank")
            if r is not None and not 0 <= r < world:
                raise FaultSpecError(f"--inject {f.kind}: rank {r} outside world size {world}")
        self._frag_keep: list = []

    def mine(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.params.get("rank") == self.rank]

    # -- straggler: extra compute every step (a matmul loop, so it shows as compute)
    def straggle(self, step: int, device: torch.device) -> None:
        for f in self.mine("straggler"):
            if step < f.params["from_step"]:
                continue
            deadline = time.perf_counter() + f.params["delay_ms"] / 1e3
            if device.type == "cuda":
                # ~delay of GPU work without a host sync: cycles at ~1.4 GHz are a rough guide
                torch.cuda._sleep(int(f.params["delay_ms"] * 1.4e6))
                continue
            a = torch.randn(128, 128)
            while time.perf_counter() < deadline:
                a = torch.tanh(a @ a)

    def data_delay_s(self) -> float:
        return sum(f.params["delay_ms"] for f in self.mine("slow_data")) / 1e3

    # -- hang
    def hang_mode(self, step: int) -> str | None:
        for f in self.mine("hang"):
            if f.params["step"] == step:
                return f.params["mode"]
        return None

    # -- nan: hooks on the module that creates the value
    def install_nan_hooks(self, stage_modules: dict, step_ref: list) -> None:
        for f in self.mine("nan"):
            path = f.params["module"]
            module = stage_modules.get(path)
            if module is None:
                raise FaultSpecError(
                    f"--inject nan: module {path!r} is not on rank {self.rank}; its modules are: "
                    + ", ".join(sorted(p for p in stage_modules if p)[:40]))
            _install_nan(module, f.params, step_ref)

    # -- fragment: interleaved allocations whose frees leave holes in the caching allocator
    def fragment(self, step: int, device: torch.device) -> None:
        for f in self.mine("fragment"):
            if device.type != "cuda":
                continue
            keep = []
            for i in range(64):
                small = torch.empty(1 << 18 + (i % 5), dtype=torch.uint8, device=device)
                big = torch.empty((3 << 20) + i * 4096, dtype=torch.uint8, device=device)
                keep.append(small)
                del big
            self._frag_keep.append(keep)


def _corrupt(t: torch.Tensor, value: str) -> torch.Tensor:
    """A real op creating the non-finite value in a few elements: log of a negative number (NaN)
    or a multiplication that overflows (Inf)."""
    sl = t[..., :4]
    if value == "nan":
        bad = torch.log(-(sl.abs() + 1.0))
    else:
        bad = (sl.abs() + 1e38) * 1e4
    return torch.cat([bad, t[..., 4:]], dim=-1)


def _install_nan(module, params: dict, step_ref: list) -> None:
    step, value = params["step"], params["value"]
    if params["phase"] == "forward":
        def fwd_hook(mod, args, out):
            if step_ref[0] == step:
                return _corrupt(out, value)
            return None
        module.register_forward_hook(fwd_hook)
    else:
        def pre_hook(mod, args):
            if step_ref[0] == step and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                # the gradient this module's backward produces for its input
                args[0].register_hook(lambda g: _corrupt(g, value))
            return None
        module.register_forward_pre_hook(pre_hook)


def check_cpu_only(faults: list[Fault], device: torch.device) -> None:
    for f in faults:
        if f.kind == "fragment" and device.type != "cuda":
            f.performed = False
            f.reason = "fragmentation of the CUDA caching allocator has no effect on CPU"
            print(f"reference: warning: --inject fragment has no effect on {device.type}", flush=True)
