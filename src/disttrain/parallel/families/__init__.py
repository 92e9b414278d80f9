"""Model families: one module each holds everything disttrain knows about a family of models. ``tp.py``,
``pipeline.py``, ``megatron.py``, ``export.py`` and the planner find the family with one lookup here and ask it.

What a family module provides (a :class:`~disttrain.parallel.families.base.Family` subclass and its one instance,
listed in :data:`FAMILIES`; HF families derive from :class:`~disttrain.parallel.families.hf.HFFamily`):

- **recognising**: ``matches(model)`` for its models (not their submodules), ``reads_config(mapping)`` for a recipe's
  ``model:`` mapping, ``reads_model_type(t)`` for an HF ``config.model_type``;
- **tensor parallel**: ``tp_plan(model)`` (module path in one block -> torch parallel style), ``check_tp`` (head
  counts, options it cannot split), ``adapt_plan`` (a user's plan made to fit the block) and ``prepare_block``,
  which reorders fused weights (``[q | k | v]``) rank-major and returns a ``Reorder`` per weight, from which
  :mod:`~disttrain.parallel.families.layout` restores the library's layout in checkpoints and exports;
- **pipeline parallel**: ``pipeline_sizes`` (balancing weights), ``split`` (prune the model to one rank's stages and
  return stage modules whose blocks are in ``layers``), and for models that compute their own loss from labels
  (``hf_loss``) ``loss`` and ``wrap_output``;
- **planner**: ``config_schema`` (the keys of its ``model:`` mapping, from the class that takes them),
  ``spec_from_config`` / ``spec_from_hf_config`` / ``spec_from_module`` (a ``ModelSpec``), ``meta_model``,
  ``activation_bytes`` and ``flops_per_sample`` (its analytic formulas; None lets the planner measure the model
  on the meta device), ``widths`` (an HF config's widths for measured families);
- **export**: ``export_format``, the ``disttrain export --to`` format its library loads (hf, timm, torch).

Every method has a default that refuses (or returns None), so a family implements what it supports. A new family
needs a module here only where transformers declares no plans for it, or where disttrain does more for it than the
plans (context parallelism, the planner's formulas): :mod:`~disttrain.parallel.families.hf_plans` trains every HF
model whose config declares its tensor-, expert- and pipeline-parallel plans.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from disttrain.parallel.families.base import ExportFormat, Family, Plan
from disttrain.parallel.families.bert import BERT
from disttrain.parallel.families.deepfm import DEEPFM
from disttrain.parallel.families.gpt2 import GPT2
from disttrain.parallel.families.hf_plans import HF_PLANS
from disttrain.parallel.families.layout import Reorder
from disttrain.parallel.families.llama import LLAMA
from disttrain.parallel.families.spec import ModelSpec
from disttrain.parallel.families.vit import VIT

# Looked up in this order: the first family that recognises a model or a config is its family. HF_PLANS (any HF
# model whose config declares its own parallel plans) comes last: the family files before it are written for theirs.
FAMILIES: tuple[Family, ...] = (LLAMA, GPT2, BERT, VIT, DEEPFM, HF_PLANS)


def registered() -> tuple[Family, ...]:
    """Every family, in lookup order (:data:`FAMILIES`)."""
    return FAMILIES


def family_of(model: nn.Module) -> Optional[Family]:
    """The family of ``model`` itself (not of a submodule), or None."""
    return next((f for f in FAMILIES if f.matches(model)), None)


def family_named(name: Optional[str]) -> Optional[Family]:
    """The family called ``name`` (``ModelSpec.family``), or None."""
    return next((f for f in FAMILIES if f.name == name), None)


def family_for_model_type(model_type: Optional[str]) -> Optional[Family]:
    """The family an HF config of ``model_type`` builds, or None."""
    return next((f for f in FAMILIES if f.reads_model_type(model_type)), None)


def family_for_config(mapping: Mapping[str, Any]) -> Optional[Family]:
    """The family a recipe's ``model:`` mapping describes, or None."""
    return next((f for f in FAMILIES if f.reads_config(mapping)), None)


def closest_family(mapping: Mapping[str, Any]) -> Optional[Family]:
    """The family whose ``model:`` keys a mapping no family reads shares most keys with (a misspelt key that tells
    the family, e.g. ``hiden_size``), so its schema can say which key was meant; None on a tie or no overlap."""
    if "model_type" in mapping:
        return None
    scores = []
    for family in FAMILIES:
        schema = family.config_schema(mapping)
        if schema is not None:
            scores.append((len(set(mapping) & set(schema)), family))
    scores.sort(key=lambda pair: -pair[0])
    if not scores or scores[0][0] == 0 or (len(scores) > 1 and scores[1][0] == scores[0][0]):
        return None
    return scores[0][1]


def find_model(root: nn.Module) -> Optional[tuple[str, nn.Module, Family]]:
    """The outermost submodule of ``root`` (itself included) of a known family: ``(path, module, family)``."""
    for name, module in root.named_modules():
        family = family_of(module)
        if family is not None:
            return name, module, family
    return None


def export_formats() -> dict[str, ExportFormat]:
    """The formats ``disttrain export --to`` writes, by name: each family's, and the library-neutral ones."""
    from disttrain.parallel.families.base import SAFETENSORS_EXPORT, TORCH_EXPORT

    formats = [SAFETENSORS_EXPORT, *(f.export_format for f in FAMILIES), TORCH_EXPORT]
    return {fmt.name: fmt for fmt in formats}


# timm models whose blocks the ViT family's plan cannot split, and why.
TIMM_REFUSED = {"Eva": "EVA-02's blocks apply rotary embeddings with their head count and normalise the SwiGLU MLP's"
                       " hidden features with a LayerNorm over all of them, which a split across ranks would change"}


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why tensor/pipeline parallelism refuses a model found inside ``model`` (encoder-decoders, EVA-02), or None."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("timm.") and type(module).__name__ in TIMM_REFUSED:
            return (f"timm {type(module).__name__} is not split: {TIMM_REFUSED[type(module).__name__]}; train it with"
                    " disttrain_fsdp or disttrain_zero3")
        config = getattr(module, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            where = f" (at {name!r})" if name else ""
            return (f"{type(module).__name__}{where} is an encoder-decoder model ({config.model_type}): tensor and"
                    " pipeline parallelism split decoder-only and encoder-only stacks, not an encoder and a decoder"
                    " with cross-attention; train it with disttrain_fsdp or disttrain_zero3")
    return None


__all__ = ["FAMILIES", "ExportFormat", "Family", "ModelSpec", "Plan", "Reorder", "closest_family", "export_formats",
           "family_for_config",
           "family_for_model_type", "family_named", "family_of", "find_model", "unsupported_reason"]
