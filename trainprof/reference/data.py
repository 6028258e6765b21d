"""Deterministic synthetic token data: the same global batch per step whatever the layout.

Sequences follow a learnable rule (t[k+1] = (3*t[k] + 1) mod V, with 10 % random tokens) so the
loss falls during the demo. Each DP replica reads its slice of the global batch.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset


class SyntheticTokens(Dataset):
    """Item i = this replica's (inputs, targets) for step i."""

    def __init__(self, cfg, dp_rank: int, steps: int, delay_s: float = 0.0):
        self.cfg, self.dp_rank, self.steps, self.delay_s = cfg, dp_rank, steps, delay_s

    def __len__(self):
        return self.steps

    def __getitem__(self, step: int):
        if self.delay_s:
            time.sleep(self.delay_s)  # slow_data fault: the input pipeline starves this rank
        c = self.cfg
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + step)
        n = c.global_batch
        toks = torch.empty(n, c.seq_len + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(0, c.vocab, (n,), generator=g)
        for k in range(c.seq_len):
            toks[:, k + 1] = (3 * toks[:, k] + 1) % c.vocab
        noise = torch.rand(n, c.seq_len + 1, generator=g) < 0.1
        toks[noise] = torch.randint(0, c.vocab, (int(noise.sum()),), generator=g)
        per = n // c.dp
        mine = toks[self.dp_rank * per:(self.dp_rank + 1) * per]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def loader(cfg, dp_rank: int, delay_s: float = 0.0) -> DataLoader:
    return DataLoader(SyntheticTokens(cfg, dp_rank, cfg.steps, delay_s), batch_size=None,
                      shuffle=False, num_workers=0)
