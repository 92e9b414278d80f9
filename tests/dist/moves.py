"""Checkpoints that move between strategies and world sizes (Fabric, CPU/gloo).
Usage: moves.py OUT SPEC LOAD STEPS SAVE [llama|vit]

The global batch is fixed (``global_batch(step, 2)``: 4 samples) whatever the world size; each data-parallel rank
trains on its share, so every layout computes the same loss as one process on the whole batch.
LOAD: a checkpoint folder to resume from into a fresh model (another seed) and optimizer, or "-" to start at step 0.
Then train STEPS steps and, unless SAVE is "-", save {"model", "optimizer", "step"} at SAVE.
"""

import os
import sys

import lightning as L
import torch
import torch.distributed as dist

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import global_batch, strategy_from_spec, tiny_llama, tiny_vit, vit_batch, write_result  # noqa: E402

spec, load, steps, save = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
family = sys.argv[6] if len(sys.argv) > 6 else "llama"
GLOBAL_WORLD = 2  # global_batch(step, 2): 4 samples per step, split over however many dp ranks there are

fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy_from_spec(spec, "fabric"))
fabric.launch()
engine = getattr(fabric.strategy, "engine", None)
dp_group = engine.data_parallel_group() if engine is not None else None  # None: all ranks
dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1

model = (tiny_llama if family == "llama" else tiny_vit)(seed=0 if load == "-" else 5)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)


def train_step(i: int) -> float:
    if family == "llama":
        ids = global_batch(i, GLOBAL_WORLD)[dp_rank::dp_size]
        loss = model(input_ids=ids, labels=ids).loss
    else:
        images, labels = vit_batch(i)
        loss = torch.nn.functional.cross_entropy(model(images[dp_rank::dp_size]), labels[dp_rank::dp_size])
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    value = loss.detach().clone()  # every dp rank has an equal share: the global loss is the dp mean
    if dist.is_initialized():
        dist.all_reduce(value, group=dp_group)
    return value.item() / dp_size


state = {"model": model, "optimizer": optimizer, "step": 0}
if load != "-":
    fabric.load(load, state)
start = state["step"]
losses = [train_step(i) for i in range(start, start + steps)]
if save != "-":
    fabric.save(save, {**state, "step": start + steps})
write_result({"start": start, "losses": losses})
