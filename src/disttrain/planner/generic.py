"""Specs of models outside the analytically counted families: HF models of any family (a module, a config object,
a config.json or a folder holding one), timm models (an instance or a model name) and any ``nn.Module``.

Parameters are counted on the module itself (built on the meta device from a config or a name: nothing is
allocated), blocks are its repeated layers, and activations and FLOPs are measured by running its forward on the
meta device (:mod:`disttrain.planner.measured`). Widths (hidden size, heads, layers, vocabulary, positions) come
from the HF config's own fields through the family module where there is one (GPT-2, BERT), else through
transformers' attribute names, which every HF config maps to its own keys (``n_embd``, ``d_model``, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from disttrain.parallel.families import family_for_model_type, family_of, unsupported_reason
from disttrain.parallel.families.hf_plans import expert_counts
from disttrain.parallel.families.spec import ModelSpec, count_params
from disttrain.parallel.split.blocks import find_blocks
from disttrain.parallel.split.fsdp import unit_count
from disttrain.parallel.split.pipeline import tied_head
from disttrain.planner.measured import Inputs, MeasuredModel


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: ``find_blocks`` without the one-of-a-kind units HF lists next to its layers
    (``BertEmbeddings``)."""
    try:
        blocks = find_blocks(model)
    except (ValueError, RuntimeError):
        return []
    counts: dict[type, int] = {}
    for block in blocks:
        counts[type(block)] = counts.get(type(block), 0) + 1
    repeated = [b for b in blocks if counts[type(b)] > 1]
    return repeated or blocks


def _structure(model: nn.Module, blocks: list[nn.Module]) -> dict[str, int]:
    return {"params": count_params(model), "layers": len(blocks),
            "layer_params": max((count_params(b) for b in blocks), default=0)}


# -- HF ---------------------------------------------------------------------------------------------------------
def read_hf_config(path: str | os.PathLike) -> Any:
    """A transformers config from a config.json or a folder holding one (local files only)."""
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r} holds no config.json; pass an HF model folder or its config.json")
    data = json.loads(file.read_text())
    if "model_type" not in data:
        raise ValueError(f"{str(file)!r} has no 'model_type'; pass the config.json an HF model was saved with")
    return AutoConfig.for_model(data.pop("model_type"), **data)


def build_hf(config: Any) -> nn.Module:
    """The model a config describes, on the meta device: its ``architectures`` class when it names one, else the
    usual head for the kind of model (seq2seq LM, masked LM for encoders, causal LM, or the base model)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    cls = next((getattr(transformers, a) for a in getattr(config, "architectures", None) or []
                if hasattr(transformers, a)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        kind = config.model_type
        if getattr(config, "is_encoder_decoder", False) and kind in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            return transformers.AutoModelForSeq2SeqLM.from_config(config)
        if kind in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
            return transformers.AutoModelForMaskedLM.from_config(config)
        if kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return transformers.AutoModelForCausalLM.from_config(config)
        return transformers.AutoModel.from_config(config)


def _hf_widths(config: Any) -> dict[str, int]:
    def first(*names: str, default: int = 0) -> int:
        return next((int(v) for n in names if isinstance(v := getattr(config, n, None), int)), default)

    hidden = first("hidden_size")
    return {"hidden": hidden, "heads": first("num_attention_heads"),
            "kv_heads": first("num_key_value_heads", "num_attention_heads"),
            "ffn": first("intermediate_size", "n_inner", "d_ff", "ffn_dim", default=4 * hidden),
            "layers": first("num_hidden_layers"), "vocab": first("vocab_size"),
            "tokens": first("max_position_embeddings", "n_positions", default=512)}


def _hf_inputs(model: nn.Module, config: Any) -> tuple[Inputs, str, bool]:
    """How to call an HF model at (batch, seq) on meta tensors, what that is in words, and whether it computes
    an LM loss over the vocabulary (whose logits' gradient the planner adds as a buffer)."""
    name = type(model).__name__
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = getattr(config, "image_size", 224)
        chans = getattr(config, "num_channels", 3)
        return (lambda b, s: ((), {"pixel_values": torch.zeros(b, chans, size, size, device="meta")}),
                f"{chans}x{size}x{size} images", False)
    lm = name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration"))
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))

    def make(b: int, s: int) -> tuple[tuple, dict]:
        ids = torch.zeros(b, s, dtype=torch.long, device="meta")
        kwargs: dict[str, Any] = {"input_ids": ids}
        if encoder_decoder:  # the decoder as long as the encoder; its inputs given (no decoder_start_token_id)
            kwargs["decoder_input_ids"] = ids
        if lm:
            kwargs["labels"] = ids
        elif name.endswith("ForSequenceClassification"):
            kwargs["labels"] = torch.zeros(b, dtype=torch.long, device="meta")
        return (), kwargs

    return make, "token ids" + (" with labels (the loss included)" if lm else ""), lm


def hf_spec(config: Any, model: Optional[nn.Module] = None) -> ModelSpec:
    """Any HF model: ``model`` (a module, on any device) or the model ``config`` describes, built on meta."""
    model = model if model is not None else build_hf(config)
    own = family_for_model_type(getattr(config, "model_type", None))
    family = own or family_of(model)  # a family file, else the plans the HF config declares (hf_plans)
    widths = {**_hf_widths(config), **(family.widths(config) if family is not None else {})}
    blocks = repeated_blocks(model)
    inputs, what, lm = _hf_inputs(model, config)
    plan = family.tp_plan(model) if family is not None else None
    measured = MeasuredModel(model, inputs, blocks, plan, what=what)
    experts, per_layer, top_k = expert_counts(model)
    extra = {"activations": measured, "lm_logits": lm, "model_type": config.model_type,
             "tensor_parallel": family is not None and _splits(family, model),
             "pipeline": family is not None and can_pipeline(family, model),
             "tied": tied_head(model) is not None,  # under a pipeline both ends hold the tied weight
             "experts": {"params": experts, "count": per_layer, "top_k": top_k} if experts else {},
             "fsdp_units": unit_count(model), "tensors": sum(1 for _ in model.parameters())}
    attention = "eager" if getattr(config, "_attn_implementation", None) == "eager" else "sdpa"
    return ModelSpec(own.name if own is not None else config.model_type, **_structure(model, blocks),
                     hidden=widths["hidden"], ffn=widths["ffn"], heads=widths["heads"], kv_heads=widths["kv_heads"],
                     vocab=widths["vocab"], tokens=widths["tokens"], attention=attention, extra=extra)


def _splits(family: Any, model: nn.Module) -> bool:
    if unsupported_reason(model) is not None:
        return False
    try:
        family.check_tp(model, 1, family.tp_plan(model))  # options the plan refuses at any size (cross-attention)
    except ValueError:
        return False
    return True


def can_pipeline(family: Any, model: nn.Module) -> bool:
    """Whether ``family`` splits ``model`` into pipeline stages (its own check, the one the engine runs)."""
    try:
        family.pipeline_sizes(model)  # the family refuses what its stages cannot split (an encoder-decoder)
    except ValueError:
        return False
    return True


# -- timm and any module ----------------------------------------------------------------------------------------
def timm_model(name: str) -> nn.Module:
    import timm

    with torch.device("meta"):
        return timm.create_model(name, pretrained=False)


def image_spec(model: nn.Module, family: str) -> ModelSpec:
    """An image model taking ``(B, C, H, W)`` at the size it was built for: its patch embedding's ``img_size`` (a
    timm ViT, DeiT or EVA built with ``img_size=32``), else timm's ``pretrained_cfg``."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    chans, height, width = cfg.get("input_size", (3, 224, 224))
    built = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if isinstance(built, (tuple, list)) and len(built) == 2:
        height, width = (int(v) for v in built)
        chans = int(getattr(model.patch_embed.proj, "in_channels", chans)) if hasattr(model.patch_embed, "proj") \
            else chans
    blocks = repeated_blocks(model)

    def inputs(b: int, s: int) -> tuple[tuple, dict]:
        return (torch.zeros(b, chans, height, width, device="meta"),), {}

    measured = MeasuredModel(model, inputs, blocks, what=f"{chans}x{height}x{width} images")
    return ModelSpec(family, **_structure(model, blocks), tokens=1, image_size=height, in_chans=chans,
                     num_classes=int(getattr(model, "num_classes", 0) or 0), extra={"activations": measured})


def module_spec(module: nn.Module, example: Any = None) -> ModelSpec:
    """Any module. ``example``: an input it takes (a LightningModule's ``example_input_array``): its activations
    are measured with the example's batch dimension resized to the micro-batch; without one they are unknown."""
    blocks = repeated_blocks(module)
    extra: dict[str, Any] = {}
    if example is not None:
        extra["activations"] = MeasuredModel(module, _resized(example), blocks, what="its example_input_array")
    return ModelSpec("module", **_structure(module, blocks), tokens=1, extra=extra)


def _resized(example: Any) -> Inputs:
    def meta(value: Any, b: int) -> Any:
        if isinstance(value, torch.Tensor):
            shape = (b, *value.shape[1:]) if value.dim() else ()
            return torch.zeros(shape, dtype=value.dtype, device="meta")
        if isinstance(value, (tuple, list)):
            return type(value)(meta(v, b) for v in value)
        if isinstance(value, dict):
            return {k: meta(v, b) for k, v in value.items()}
        return value

    def inputs(b: int, s: int) -> tuple[tuple, dict]:
        if isinstance(example, dict):
            return (), meta(example, b)
        return (tuple(meta(example, b)) if isinstance(example, tuple) else (meta(example, b),)), {}

    return inputs
