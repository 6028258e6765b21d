"""Plain DistributedDataParallel training of a small GPT-2, written the way torch's DDP tutorial
shows (a hand-written loop, no HF Trainer): the same model as hf_gpt2.py (GPT2LMHeadModel built
from a config, no download: 4 layers, 256 wide, 4 heads, vocab 2048, 3.7M parameters), seq 128,
batch 8 per rank, AdamW, synthetic token ids held in memory, gloo. Used by
bench_probes_ab.py --whole-runs (`--module benchmarks/jobs/ddp_gpt2.py`) and
bench_probe_attribution.py samples (`--script ...`).

    python ddp_gpt2.py [steps] [n_embd] [n_layer] [seq_len] [batch]
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
n_embd = int(sys.argv[2]) if len(sys.argv) > 2 else 256
n_layer = int(sys.argv[3]) if len(sys.argv) > 3 else 4
seq = int(sys.argv[4]) if len(sys.argv) > 4 else 128
batch = int(sys.argv[5]) if len(sys.argv) > 5 else 8
vocab = 2048
dist.init_process_group("gloo")
torch.manual_seed(0)
config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=seq)
model = DDP(GPT2LMHeadModel(config))
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(dist.get_rank())
tokens = torch.randint(0, vocab, (steps, batch, seq), generator=g)
for step in range(steps):
    x = tokens[step]
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
