"""Recipe YAML files for the ViT trainer and the timm models they describe.

A config has three sections: ``model:`` (timm ``VisionTransformer`` keyword arguments, the schema the planner
reads), ``data:`` (:class:`disttrain.vision.data.DataConfig`) and ``train:`` (:class:`TrainConfig`).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from disttrain.config import Recipe, Schema, keys_of
from disttrain.parallel.families.vit import VIT, vit_arguments
from disttrain.parallel.options import build_options

# timm registers no generic "vit" name: building through a registered architecture keeps create_model's
# bookkeeping (pretrained_cfg, which the export's config.json needs); our keyword arguments replace its sizes.
TIMM_ARCHITECTURE = "vit_base_patch16_224"
CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs" / "vision"


@dataclass
class TrainConfig:
    """The ``train:`` section.

    epochs / max_steps: how long (max_steps, when set, stops earlier; optimizer steps). global_batch_size: images
    per optimizer step over all data-parallel ranks; gradient accumulation makes up what ``data.batch_size`` x
    data-parallel ranks leaves (None: no accumulation). lr, weight_decay, warmup_steps,
    min_lr_ratio: AdamW with linear warm-up then cosine decay to ``lr * min_lr_ratio``. label_smoothing: for the
    hard-label loss (mixup has its own). activation_checkpointing: recompute each block in backward (timm's
    ``set_grad_checkpointing``). sdpa: attention through ``scaled_dot_product_attention`` (FlashAttention-2 on
    GPU). precision: the Fabric/Trainer precision unless the launcher sets one. seed, val_every_epochs,
    checkpoint_every_epochs: as named. async_checkpoint: the checkpoints are written in the background while training
    goes on (disttrain_fsdp, disttrain_ddp, disttrain_megatron).
    """

    epochs: int = 10
    max_steps: Optional[int] = None
    global_batch_size: Optional[int] = None
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    label_smoothing: float = 0.0
    activation_checkpointing: bool = False
    sdpa: bool = True
    precision: str = "32-true"
    seed: int = 0
    val_every_epochs: int = 1
    checkpoint_every_epochs: int = 1
    async_checkpoint: bool = False


def recipe_schema() -> Schema:
    """What a ViT recipe YAML may hold (see :mod:`disttrain.config`)."""
    from disttrain.vision.data import DataConfig

    return {"model": VIT.config_schema({}), "data": keys_of(DataConfig), "train": keys_of(TrainConfig)}


VIT_RECIPE = Recipe("vit", "configs/vision/vit_tiny.yaml", recipe_schema)


def read_yaml(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """A ViT recipe YAML as a dict; one clear error (with the closest valid key) for a missing file, a missing
    ``model:`` section or an unknown section or key."""
    return VIT_RECIPE.read(Path(path))


def train_config(section: Optional[dict[str, Any]]) -> TrainConfig:
    return build_options(TrainConfig, "train:", dict(section or {}))


def build_vit(model_args: dict[str, Any], device: Union[str, torch.device, None] = None) -> nn.Module:
    """The timm VisionTransformer of a ``model:`` section; on ``device="meta"`` nothing is allocated."""
    import timm

    unknown = sorted(set(model_args) - vit_arguments())
    if unknown:
        raise ValueError(f"model: {unknown} are not VisionTransformer arguments; valid ones include"
                         f" {', '.join(sorted(vit_arguments()))}")
    heads, width = model_args.get("num_heads", 12), model_args.get("embed_dim", 768)
    if width % heads:
        raise ValueError(f"model: embed_dim={width} is not divisible by num_heads={heads}; choose a width that"
                         f" is a multiple of the number of heads")
    with torch.device(device) if device is not None else nullcontext():
        return timm.create_model(TIMM_ARCHITECTURE, pretrained=False, **model_args)


def count_parameters(model_args: dict[str, Any]) -> int:
    """Parameters of the model a ``model:`` section describes, counted on the meta device (no memory used)."""
    return sum(p.numel() for p in build_vit(model_args, device="meta").parameters())


def as_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
