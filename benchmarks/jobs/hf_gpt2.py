"""Hugging Face Trainer on a small GPT-2 built from a config (no download), synthetic tokens,
DDP over gloo on CPU, written the way the Trainer docs show. Used by
bench_probes_ab.py --whole-runs: `--module benchmarks/jobs/hf_gpt2.py`.

    python hf_gpt2.py [steps] [n_embd] [n_layer] [seq_len]
"""

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
n_embd = int(sys.argv[2]) if len(sys.argv) > 2 else 256
n_layer = int(sys.argv[3]) if len(sys.argv) > 3 else 4
seq = int(sys.argv[4]) if len(sys.argv) > 4 else 128


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, vocab):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=2048, n_positions=seq)
model = GPT2LMHeadModel(config)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps,
                             learning_rate=1e-4, logging_steps=10, save_strategy="no",
                             report_to=[], use_cpu=True, ddp_backend="gloo",
                             dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Tokens(8 * 2 * steps, 2048)).train()
