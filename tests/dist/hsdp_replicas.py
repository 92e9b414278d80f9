"""Hybrid sharding's replicas on 2 CPU processes (Fabric, ``hybrid_shard=True, shard_size=1``: two replicas of one
unsharded copy, the smallest HSDP): a ViT built on the meta device must start the same on both replicas, and
replicas fed different samples must train as Lightning's ``ddp`` does from the same weights (the gradients
all-reduced across them). Usage: hsdp_replicas.py OUT"""

from __future__ import annotations

import copy
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import meta_vit_classifier, whole, write_result  # noqa: E402

from disttrain.fabric import FSDPStrategy  # noqa: E402
from disttrain.vision import TrainConfig, ViTClassifier  # noqa: E402

MODEL = dict(img_size=16, patch_size=4, num_classes=10, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)


def train(fabric: L.Fabric, model: torch.nn.Module, steps: int = 3) -> tuple[list[float], list[float], dict[str, list]]:
    """SGD steps on this rank's own images, gradients clipped; the losses averaged over ranks, the gradient norms and
    the final weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    images = torch.Generator().manual_seed(100 + fabric.global_rank)
    losses, norms = [], []
    for _ in range(steps):
        x = torch.randn(4, 3, 16, 16, generator=images)
        y = torch.randint(0, 10, (4,), generator=images)
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.5).item())  # the whole model's norm
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    weights = {name: whole(p).detach().flatten()[:8].tolist() for name, p in model.module.named_parameters()}
    return losses, norms, weights


def main() -> None:
    hsdp = L.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(hybrid_shard=True, shard_size=1))
    vit = meta_vit_classifier(hsdp, MODEL)
    meta_sums = {name: whole(p).double().sum().item() for name, p in vit.model.named_parameters()}

    torch.manual_seed(1)
    start = ViTClassifier(MODEL, TrainConfig(), total_steps=1)
    start.configure_model()
    ddp = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    ddp.launch()  # in the launched processes: joins the process group already there
    ddp_losses, ddp_norms, ddp_weights = train(ddp, copy.deepcopy(start.model))
    hsdp_losses, hsdp_norms, hsdp_weights = train(hsdp, copy.deepcopy(start.model))
    write_result({"rank": dist.get_rank(), "meta_sums": meta_sums, "ddp_losses": ddp_losses, "ddp_norms": ddp_norms,
                  "hsdp_losses": hsdp_losses, "hsdp_norms": hsdp_norms, "ddp_weights": ddp_weights,
                  "hsdp_weights": hsdp_weights})


if __name__ == "__main__":
    main()
