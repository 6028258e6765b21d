"""Command-line configuration of the reference workload."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass
class Config:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    seq_len: int = 32
    vocab: int = 256
    micro_batches: int = 4
    global_batch: int = 16
    steps: int = 10
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dp_mode: str = "fsdp"
    dtype: str = "fp32"
    seed: int = 0
    device: str = "auto"
    backend: str = "auto"
    lr: float = 1e-3
    loss_file: str | None = None
    inject: list[str] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m trainprof.reference",
        description="Reference 3D-parallel (DP x PP x TP) decoder-only transformer training job "
                    "with fault injection. Run it under torchrun with dp*pp*tp processes.")
    d = Config()
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree (FSDP2 or replicate)")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline-parallel degree")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="pipeline micro-batches per step (gradient accumulation when pp=1)")
    p.add_argument("--global-batch", type=int, default=d.global_batch,
                   help="sequences per optimizer step across all DP replicas")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    p.add_argument("--virtual-stages", type=int, default=d.virtual_stages,
                   help="pipeline stages per rank (interleaved1f1b)")
    p.add_argument("--dp-mode", choices=("fsdp", "replicate"), default=d.dp_mode)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=d.dtype,
                   help="bf16 = autocast on CUDA (master weights stay fp32)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default=d.backend,
                   help="process-group backend (auto: nccl on CUDA, gloo on CPU); gloo lets "
                        "several ranks share one GPU")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--loss-file", default=None, help="rank 0 writes one JSON line per step {step, loss}")
    p.add_argument("--inject", action="append", default=[], metavar="KIND:key=value,...",
                   help="fault to inject (repeatable): straggler:rank=R,delay_ms=D[,from_step=S] | "
                        "nan:rank=R,step=S,module=PATH,phase=forward|backward,value=nan|inf | "
                        "hang:rank=R,step=S,mode=sleep|skip | imbalance:stage=K,extra_layers=N | "
                        "slow_data:rank=R,delay_ms=D | fragment:rank=R")
    a = p.parse_args(argv)
    cfg = Config(**{k: v for k, v in vars(a).items()})
    _validate(p, cfg)
    return cfg


def _validate(p: argparse.ArgumentParser, c: Config) -> None:
    for name in ("dp", "pp", "tp", "layers", "hidden", "heads", "seq_len", "vocab", "micro_batches",
                 "global_batch", "steps", "virtual_stages"):
        if getattr(c, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if c.hidden % c.heads:
        p.error(f"--hidden {c.hidden} must be divisible by --heads {c.heads}")
    if c.heads % c.tp:
        p.error(f"--heads {c.heads} must be divisible by --tp {c.tp}")
    if (4 * c.hidden) % c.tp:
        p.error(f"MLP width {4 * c.hidden} must be divisible by --tp {c.tp}")
    if c.global_batch % c.dp:
        p.error(f"--global-batch {c.global_batch} must be divisible by --dp {c.dp}")
    local = c.global_batch // c.dp
    if local % c.micro_batches:
        p.error(f"per-replica batch {local} must be divisible by --micro-batches {c.micro_batches}")
    if c.schedule != "interleaved1f1b" and c.virtual_stages != 1:
        p.error("--virtual-stages > 1 needs --schedule interleaved1f1b")
    if c.schedule == "interleaved1f1b":
        if c.pp < 2:
            p.error("interleaved1f1b needs --pp >= 2")
        if c.virtual_stages < 2:
            c.virtual_stages = 2
        if c.micro_batches % c.pp:
            p.error(f"interleaved1f1b needs --micro-batches divisible by --pp {c.pp}")
    if c.layers < c.pp * c.virtual_stages:
        p.error(f"--layers {c.layers} must be >= number of pipeline stages {c.pp * c.virtual_stages}")
