"""Throughput through Fabric + disttrain_ddp on 2 CPU processes, rank r training on r+1 sequences per step (unequal
on purpose: the global rate must be the ranks' sum, not rank 0's times two). Usage: throughput_run.py OUT"""

import os
import sys

import lightning as L
import torch

import disttrain  # noqa: F401  (registers the strategy names)
from disttrain.callbacks.throughput import Throughput

sys.path.insert(0, os.path.dirname(__file__))
from common import SEQ, VOCAB, tiny_llama, write_result  # noqa: E402

STEPS, EVERY = 4, 2

fabric = L.Fabric(accelerator="cpu", devices=2, strategy="disttrain_ddp")
if not os.environ.get("LT_CLI_USED"):
    fabric.launch()
model = tiny_llama()
tp = Throughput(transformer=model, every_n_steps=EVERY, peak_flops=1e12)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)

g = torch.Generator().manual_seed(fabric.global_rank)
for step in range(STEPS):
    ids = torch.randint(0, VOCAB, (fabric.global_rank + 1, SEQ), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    tp.step(fabric, {"input_ids": ids})

# This rank's own window, as Lightning's Throughput sees it, next to what was reported for the job.
local = tp._window.compute()
write_result({"metrics": tp.metrics, "local_tokens_per_s": local["device/items_per_sec"],
              "local_flops_per_s": local["device/flops_per_sec"], "tokens": tp._tokens})
