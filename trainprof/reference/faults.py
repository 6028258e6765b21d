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
    for key, low in (("rank", 0), ("step", 0), ("from_step", 0), ("stage", 0), ("extra_layers", 1),
                     ("delay_ms", 0)):
        if key in params and params[key] < low:
            raise FaultSpecError(f"--inject {spec!r}: {key} must be >= {low}")
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
        self._cycles_per_ms: float | None = None

    def mine(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.params.get("rank") == self.rank]

    # -- straggler: extra compute every step (a matmul loop / a spinning kernel, so it shows as
    # compute; deliberately not inside a record_function that would name the fault)
    def straggle(self, step: int, device: torch.device) -> None:
        for f in self.mine("straggler"):
            if step < f.params["from_step"]:
                continue
            if device.type == "cuda":
                # GPU work of ~delay_ms without a host sync; the spin rate is measured once
                torch.cuda._sleep(int(f.params["delay_ms"] * self._cuda_cycles_per_ms()))
                continue
            deadline = time.perf_counter() + f.params["delay_ms"] / 1e3
            a = torch.randn(128, 128)
            while time.perf_counter() < deadline:
                a = torch.tanh(a @ a)

    def _cuda_cycles_per_ms(self) -> float:
        if self._cycles_per_ms is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # warm-up: clocks ramp up
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            self._cycles_per_ms = 20_000_000 / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

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

    # -- fragment: holes between live blocks in the caching allocator's large pool
    def fragment(self, step: int, device: torch.device) -> None:
        """Once (at the first step), fill FRAG_SEGMENTS 20 MiB segments of the large pool with
        [hole 8 MiB][keep 2 MiB][hole 8 MiB][keep 2 MiB] and free the holes: 16 MiB of each
        segment stays reserved but only serves requests <= 8 MiB (inactive split bytes), for the
        rest of the run. Bounded: FRAG_SEGMENTS * 20 MiB reserved, nothing grows per step."""
        if device.type != "cuda" or self._frag_keep or not self.mine("fragment"):
            return
        holes = []  # all kept alive until every segment is laid out, else a hole is reused
        for _ in range(2 * FRAG_SEGMENTS):
            holes.append(torch.empty(FRAG_HOLE, dtype=torch.uint8, device=device))
            self._frag_keep.append(torch.empty(FRAG_KEEP, dtype=torch.uint8, device=device))
        del holes
        _FRAG_TO_EXIT.extend(self._frag_keep)  # until the process exits: the exit snapshot shows it


# The fragment fault's kept blocks, held past the training loop (the injector goes with it) so
# that the allocator snapshot trainprof writes at exit (TRAINPROF_MEMORY_HISTORY=1) still holds
# the holes between them.
_FRAG_TO_EXIT: list = []


# 20 segments x 16 MiB of holes = 320 MiB of inactive split bytes in 400 MiB reserved (80 %).
FRAG_SEGMENTS, FRAG_HOLE, FRAG_KEEP = 20, 8 << 20, 2 << 20


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
    """Called after tensor parallel / FSDP wrapped the module: the forward hook is appended, so it
    runs after TP's output hook and corrupts the local tensor; the pre-hook is prepended, so it
    sees the input before TP turns it into a DTensor."""
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
        module.register_forward_pre_hook(pre_hook, prepend=True)


def module_stage(path: str, layout: list[list[int]]) -> int | None:
    """The pipeline stage holding the module at ``path`` (unsharded model's names), or None."""
    parts = path.split(".")
    if parts[0] == "tok_emb":
        return 0
    if parts[0] in ("norm", "head"):
        return len(layout) - 1
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return next((s for s, ids in enumerate(layout) if int(parts[1]) in ids), None)
    return None


def validate(faults: list[Fault], full_model, layout: list[list[int]], pp: int, steps: int,
             world: int, coords_of) -> None:
    """Checks that need the model and the layout; run on every rank so all fail alike."""
    names = {n for n, _ in full_model.named_modules() if n}
    for f in faults:
        for key in ("step", "from_step"):
            if key in f.params and not 0 <= f.params[key] < steps:
                raise FaultSpecError(f"--inject {f.kind}: {key}={f.params[key]} is outside the "
                                     f"run's steps 0..{steps - 1}")
        if f.kind != "nan":
            continue
        path, rank = f.params["module"], f.params["rank"]
        if path not in names:
            examples = ", ".join(n for n in sorted(names) if n.count(".") <= 2 and not n.endswith("_norm"))
            raise FaultSpecError(f"--inject nan: no module {path!r} in the model; module paths are "
                                 f"those of the unsharded model, e.g. {examples}")
        if path.startswith("tok_emb") and f.params["phase"] == "backward":
            raise FaultSpecError("--inject nan: tok_emb has no input gradient (its input is token "
                                 "ids); use phase=forward or a later module")
        stage = module_stage(path, layout)
        if stage % pp != coords_of(rank)["pp"]:
            holders = [r for r in range(world) if coords_of(r)["pp"] == stage % pp]
            raise FaultSpecError(f"--inject nan: {path} lives in pipeline stage {stage}, which "
                                 f"rank {rank} does not hold (ranks {holders} do)")
        f.extra["stage"] = stage


def check_cpu_only(faults: list[Fault], device: torch.device) -> None:
    for f in faults:
        if f.kind == "fragment" and device.type != "cuda":
            f.performed = False
            f.reason = "fragmentation of the CUDA caching allocator has no effect on CPU"
            print(f"reference: warning: --inject fragment has no effect on {device.type}", flush=True)
