"""A ViT built on the meta device under disttrain_megatron (Fabric): what the ranks hold copies of must be the same on
each of them. ``tp``: 2 processes, tensor parallel; what it leaves whole (patch and position embeddings, head, norms)
is copied over the group, and so are the logits. ``pp``: 4 processes, 2 pipeline stages x 2 data-parallel ranks;
the class token and position embedding, which no stage module owns, are copied over the data-parallel ranks.
Usage: meta_copies.py OUT tp|pp"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from common import meta_vit_classifier, whole, write_result  # noqa: E402

from disttrain.fabric import MegatronStrategy  # noqa: E402

MODEL = dict(img_size=16, patch_size=4, num_classes=10, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)
LAYOUTS = {"tp": (2, dict(tensor_parallel_size=2)), "pp": (4, dict(pipeline_parallel_size=2, microbatches=2))}


def main() -> None:
    processes, options = LAYOUTS[sys.argv[2]]
    fabric = L.Fabric(accelerator="cpu", devices=processes, strategy=MegatronStrategy(**options))
    vit = meta_vit_classifier(fabric, MODEL)
    sums, plain = {}, []
    for name, tensor in vit.model.named_parameters():
        sums[name] = whole(tensor).double().sum().item()
        if not isinstance(tensor, DTensor):
            plain.append(name)
    logits = None
    if sys.argv[2] == "tp":
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        vit.model.eval()
        with torch.no_grad():
            logits = vit.model(x).tolist()
    write_result({"sums": sums, "plain": plain, "logits": logits, "rank": dist.get_rank()})


if __name__ == "__main__":
    main()
