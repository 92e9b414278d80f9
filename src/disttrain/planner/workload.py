"""The model a planner config describes, built for real with random weights, and its loss on random data of the
plan's shapes: what a trial trains (``disttrain plan --trial``) and what ``disttrain calibrate --model`` times.

A step's time depends on the shapes, not on the values, so neither needs the user's weights or data.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


def build(mapping: dict, layers: Optional[int] = None) -> tuple[nn.Module, str]:
    """``(model, kind)`` of a ``model:`` mapping with random weights, in the current default device and dtype: an HF
    causal LM (Llama keys or ``model_type``; kind ``"lm"``) or a timm VisionTransformer (``"vit"``). ``layers``: that
    many blocks instead of the config's (the calibration times a model at two depths)."""
    from disttrain.parallel.families import family_for_config

    family = family_for_config(mapping)
    name = family.name if family is not None else None
    if name == "vit":
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(**{**mapping, **({"depth": layers} if layers else {})}), "vit"
    if name == "deepfm":
        raise ValueError("trials and calibration of embedding-table models (disttrain_recsys) are not supported")
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in mapping.items() if k != "model_type"}
    config = AutoConfig.for_model(mapping.get("model_type", "llama"), **settings)
    config.use_cache = False
    if layers:
        config.num_hidden_layers = layers  # every family's attribute_map leads it to its own key (n_layer, ...)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), "lm"


def random_batch(spec: Any, kind: str, batch: int, seq: int, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` on the CPU: images and labels for a ViT, token ids (their own labels) for an LM."""
    if kind == "vit":
        return (torch.randn(batch, spec.in_chans or 3, spec.image_size, spec.image_size, generator=generator),
                torch.randint(0, max(1, spec.num_classes), (batch,), generator=generator))
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=generator)
    return ids, ids


def loss_of(model: nn.Module, kind: str, inputs: torch.Tensor, targets: torch.Tensor, pipelined: bool = False
            ) -> torch.Tensor:
    """The training loss of one batch (``pipelined``: a ViT pipeline's last stage computes the loss itself)."""
    if kind == "vit":
        return model(inputs, target=targets) if pipelined else F.cross_entropy(model(inputs), targets)
    return model(input_ids=inputs, labels=targets).loss


__all__ = ["build", "loss_of", "random_batch"]
