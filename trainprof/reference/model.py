"""A small decoder-only transformer whose module paths do not depend on the parallel layout.

The full model names its blocks ``layers.<i>`` (a ModuleDict keyed by the global layer index), and a
pipeline stage keeps those names for the blocks it owns, so ``layers.1.mlp`` means the same module
in the unsharded model, in a pipeline stage and in findings.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # Under tensor parallelism q/k/v are column shards: the local width gives the local heads.
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (``layer_ids`` and the first/last flags)."""

    def __init__(self, vocab: int, hidden: int, heads: int, layer_ids, first: bool = True,
                 last: bool = True, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden) if first else None
        self.layers = nn.ModuleDict({str(i): Block(hidden, heads) for i in layer_ids})
        self.norm = nn.LayerNorm(hidden) if last else None
        self.head = nn.Linear(hidden, vocab, bias=False) if last else None
        self.autocast_dtype = autocast_dtype

    def forward(self, x):
        device_type = x.device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            h = self.tok_emb(x) if self.tok_emb is not None else x
            for block in self.layers.values():
                h = block(h)
            if self.head is not None:
                h = self.head(self.norm(h))
        return h.float() if self.head is not None else h


def build_full(cfg, n_layers: int) -> Transformer:
    """The unsharded model, initialized from the seed alone (identical on every rank and layout)."""
    torch.manual_seed(cfg.seed)
    return Transformer(cfg.vocab, cfg.hidden, cfg.heads, range(n_layers))


def extract_stage(full: Transformer, layer_ids, first: bool, last: bool, autocast_dtype) -> Transformer:
    """A stage module sharing nothing with ``full`` but holding copies of its weights."""
    cfg_hidden = full.layers["0"].attn.q.in_features
    heads = cfg_hidden // full.layers["0"].attn.head_dim
    vocab = (full.tok_emb or full.head).weight.shape[0]
    stage = Transformer(vocab, cfg_hidden, heads, layer_ids, first, last, autocast_dtype)
    sd = {k: v for k, v in full.state_dict().items() if k in stage.state_dict()}
    stage.load_state_dict(sd, strict=True)
    return stage


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def param_counts(model: Transformer) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    emb = model.tok_emb.weight.numel() if model.tok_emb is not None else 0
    return total, total - emb
