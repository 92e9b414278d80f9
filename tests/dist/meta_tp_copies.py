"""A ViT built on the meta device under disttrain_megatron (tp=2, Fabric): what tensor parallelism leaves whole
(patch and position embeddings, head, norms) must be the same on both ranks of the group, and so their logits.
Usage: meta_tp_copies.py OUT"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

from disttrain.fabric import MegatronStrategy  # noqa: E402
from disttrain.vision import TrainConfig, ViTClassifier  # noqa: E402

MODEL = dict(img_size=16, patch_size=4, num_classes=10, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)


def main() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=MegatronStrategy(tensor_parallel_size=2))
    fabric.launch()
    fabric.seed_everything(0)
    vit = ViTClassifier(MODEL, TrainConfig(), total_steps=1)
    with fabric.init_module(empty_init=True):
        vit.configure_model()
    fabric.setup(vit)
    sums = {}
    for name, tensor in vit.model.named_parameters():
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        sums[name] = whole.double().sum().item()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    vit.model.eval()
    with torch.no_grad():
        logits = vit.model(x)
    write_result({"sums": sums, "logits": logits.tolist(), "rank": dist.get_rank()})


if __name__ == "__main__":
    main()
