"""litgpt's Fabric loop under disttrain_zero3 on 2 CPU processes: ``fabric.setup_module`` then
``fabric.setup_optimizers``, ``fabric.clip_gradients(max_norm=...)`` every step; the same with ``fabric.setup(model,
optimizer)`` and under disttrain_zero3_offload; what clipping refuses. Usage: zero3_fabric_loop.py OUT"""

import os
import sys

import lightning as L
import torch

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import mean_over_ranks, rank_batch, tiny_llama, write_result  # noqa: E402

STEPS, MAX_NORM, LR = 4, 0.5, 0.2


def launched(strategy: str) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # under torchrun: the processes exist already
    return fabric


def train(strategy: str, separate: bool) -> dict:
    fabric = launched(strategy)
    model = tiny_llama()
    if separate:  # litgpt's order: the optimizer is made from the set-up (partitioned) parameters
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    else:
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    losses, norms = [], []
    for step in range(STEPS):
        ids = rank_batch(step, fabric.global_rank, fabric.world_size)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    refused = {}
    ids = rank_batch(0, fabric.global_rank, fabric.world_size)
    fabric.backward(model(input_ids=ids, labels=ids).loss)
    for name, kwargs in (("clip_val", {"clip_val": 1.0}), ("norm_type", {"max_norm": 1.0, "norm_type": "inf"})):
        try:
            fabric.clip_gradients(model, optimizer, **kwargs)
        except (ValueError, NotImplementedError) as e:
            refused[name] = f"{type(e).__name__}: {e}"
    if separate:  # Fabric's own checks of setup_optimizers still run
        for name, args in (("none", ()), ("twice", (optimizer,))):
            try:
                fabric.setup_optimizers(*args)
            except (ValueError, RuntimeError) as e:
                refused[f"setup_optimizers_{name}"] = f"{type(e).__name__}: {e}"
    return {"losses": losses, "norms": norms, "refused": refused}


def optimizer_before_model() -> str:
    fabric = launched("disttrain_zero3")
    try:
        fabric.setup_optimizers(torch.optim.SGD(tiny_llama().parameters(), lr=LR))
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


write_result({
    "separate": train("disttrain_zero3", separate=True),
    "joint": train("disttrain_zero3", separate=False),
    "offload_separate": train("disttrain_zero3_offload", separate=True),
    "optimizer_before_model": optimizer_before_model(),
})
