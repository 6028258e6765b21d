"""Plain DistributedDataParallel training, written the way torch's DDP tutorial shows: an MLP of
realistic width for a CPU rank (8 x 1024 hidden, ~8.4M parameters, 3 DDP buckets at the default
25 MB), synthetic data. Used by bench_probes_ab.py --whole-runs:
`--module benchmarks/jobs/ddp_mlp.py`.

    python ddp_mlp.py [steps] [hidden] [batch]
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
dist.init_process_group("gloo")
torch.manual_seed(0)
layers = []
for _ in range(8):
    layers += [nn.Linear(hidden, hidden), nn.GELU()]
model = DDP(nn.Sequential(*layers, nn.Linear(hidden, 16)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(steps):
    x, y = torch.randn(batch, hidden, generator=g), torch.randint(0, 16, (batch,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
