"""What the planner needs to know of a model, read from a config (dict, recipe YAML, HF config.json or folder), a
timm model name, or an ``nn.Module``.

Nothing here allocates a model: Llama, ViT and DeepFM configs are counted analytically (the tests check the counts
against models built on the meta device); every other model is built on the meta device (HF configs of other
families, timm names) or inspected as it is, and measured there (:mod:`disttrain.planner.generic`).
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from disttrain.parallel.families.llama import LLAMA
from disttrain.parallel.families.spec import ModelSpec, count_params  # noqa: F401  (public here too)

LLAMA_FAMILY = LLAMA.model_types  # HF model types counted with the Llama formulas


ModelLike = Union[ModelSpec, dict, str, os.PathLike, nn.Module, Any]


def model_spec(model_or_config: ModelLike) -> ModelSpec:
    """A :class:`ModelSpec` from a spec; a recipe YAML path or its dict (with a top-level ``model:`` mapping or the
    mapping itself; an HF ``model_type`` key makes it an HF config of that family); an HF config folder, its
    config.json, or a ``transformers`` config object; a timm model name ("resnet18"); or an ``nn.Module`` (HF
    model of any family, timm model, anything else)."""
    if isinstance(model_or_config, ModelSpec):
        return model_or_config
    if isinstance(model_or_config, (str, os.PathLike)):
        return _from_name_or_path(model_or_config)
    if isinstance(model_or_config, dict):
        return _from_mapping(model_or_config)
    if isinstance(model_or_config, nn.Module):
        return _from_module(model_or_config)
    if hasattr(model_or_config, "to_dict") and hasattr(model_or_config, "model_type"):  # a transformers config
        return _from_hf_config(model_or_config)
    raise TypeError(f"cannot plan for {type(model_or_config).__name__}; pass an nn.Module, a recipe YAML path, a "
                    f"dict of its `model:` mapping, an HF config (folder or config.json), a timm model name, or a"
                    f" disttrain.planner.ModelSpec")


def _from_name_or_path(source: str | os.PathLike) -> ModelSpec:
    from disttrain.planner import generic

    path = Path(source)
    if path.is_dir() or path.suffix == ".json":
        return _from_hf_config(generic.read_hf_config(path))
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return _from_yaml(path)
    name = str(source)
    import timm

    if timm.is_model(name):
        return _from_module(generic.timm_model(name))
    close = difflib.get_close_matches(name, timm.list_models(), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ValueError(f"model {name!r} is neither a recipe YAML, an HF config folder or config.json, nor a timm model"
                     f" name{hint}; pass e.g. configs/nlp/dialogue_10b.yaml, a folder holding config.json, or"
                     f" resnet18")


def _from_hf_config(config: Any, module: nn.Module | None = None) -> ModelSpec:
    """Llama-family configs by the Llama formulas, every other HF family built (on meta) and measured."""
    from disttrain.planner import generic

    if config.model_type in LLAMA_FAMILY:
        cfg = config.to_dict()
        cfg.setdefault("attn_implementation", getattr(config, "_attn_implementation", None))
        spec = llama_spec(cfg)
        # exact, whatever the model adds to the Llama layout (Qwen3's q/k norms)
        return replace(spec, params=count_params(module if module is not None else meta_llama(config)))
    return generic.hf_spec(config, module)


def meta_llama(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _from_yaml(path: Path) -> ModelSpec:
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"model config {str(path)!r} does not exist; pass a recipe YAML such as "
                                f"configs/nlp/dialogue_10b.yaml")
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{str(path)!r} has no top-level `model:` mapping; a recipe YAML describes its model under"
                         f" `model:` (LlamaConfig, timm VisionTransformer or DeepFM arguments)")
    return _from_mapping(data["model"], source=str(path))


def _from_mapping(mapping: dict, source: str = "the model mapping") -> ModelSpec:
    if isinstance(mapping.get("model"), dict):
        mapping = mapping["model"]
    if "model_type" in mapping and mapping["model_type"] not in LLAMA_FAMILY:  # an HF config of another family
        from transformers import AutoConfig

        settings = {k: v for k, v in mapping.items() if k != "model_type"}
        return _from_hf_config(AutoConfig.for_model(mapping["model_type"], **settings))
    if "num_embeddings_per_feature" in mapping:
        return deepfm_spec(mapping)
    if "patch_size" in mapping or "embed_dim" in mapping:
        return vit_spec(mapping)
    if "hidden_size" in mapping:
        return llama_spec({k: v for k, v in mapping.items() if k != "model_type"})
    raise ValueError(f"cannot tell the model family of {source} (keys: {', '.join(sorted(mapping))}); expected "
                     f"LlamaConfig keys (hidden_size, ...), an HF config with model_type, timm VisionTransformer keys"
                     f" (embed_dim, patch_size, ...) or DeepFM keys (embedding_dim, num_embeddings_per_feature, ...)")


def _need(mapping: dict, key: str, family: str) -> Any:
    if key not in mapping:
        raise ValueError(f"the {family} config lacks {key!r}; add it to the `model:` mapping")
    return mapping[key]


def llama_spec(cfg: dict) -> ModelSpec:
    """A Llama-family decoder (transformers ``LlamaConfig`` keywords; its defaults where a key is absent)."""
    h = int(_need(cfg, "hidden_size", "Llama"))
    layers = int(_need(cfg, "num_hidden_layers", "Llama"))
    heads = int(_need(cfg, "num_attention_heads", "Llama"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    f = int(cfg.get("intermediate_size", 11008))
    vocab = int(cfg.get("vocab_size", 32000))
    if h % heads:
        raise ValueError(f"hidden_size={h} is not a multiple of num_attention_heads={heads}")
    d = int(cfg.get("head_dim") or h // heads)
    bias = 1 if cfg.get("attention_bias", False) else 0
    mlp_bias = 1 if cfg.get("mlp_bias", False) else 0
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + bias * (heads * d + 2 * kv * d + h)
    mlp = 3 * h * f + mlp_bias * (2 * f + h)
    layer = attn + mlp + 2 * h  # two RMSNorm weights
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = vocab * h * (1 if tied else 2) + layers * layer + h
    tokens = int(cfg.get("max_position_embeddings", 2048))
    return ModelSpec("llama", params, layers=layers, layer_params=layer, hidden=h, ffn=f, heads=heads, kv_heads=kv,
                     vocab=vocab, tokens=tokens, attention=_attention(cfg.get("attn_implementation")),
                     extra={"tied": tied, "head_dim": d})


def vit_spec(cfg: dict) -> ModelSpec:
    """A timm ``VisionTransformer`` (its keyword defaults where a key is absent: class token, qkv bias, mlp 4.0)."""
    img = cfg.get("img_size", 224)
    img = int(img[0] if isinstance(img, (list, tuple)) else img)
    patch = int(cfg.get("patch_size", 16))
    chans = int(cfg.get("in_chans", 3))
    h = int(cfg.get("embed_dim", 768))
    depth = int(cfg.get("depth", 12))
    heads = int(cfg.get("num_heads", 12))
    classes = int(cfg.get("num_classes", 1000))
    if h % heads:
        raise ValueError(f"embed_dim={h} is not a multiple of num_heads={heads}")
    if img % patch:
        raise ValueError(f"img_size={img} is not a multiple of patch_size={patch}")
    f = int(h * float(cfg.get("mlp_ratio", 4.0)))
    qkv_bias = 1 if cfg.get("qkv_bias", True) else 0
    cls = 1 if cfg.get("class_token", True) else 0
    tokens = (img // patch) ** 2 + cls
    layer = 2 * h + 3 * h * h + qkv_bias * 3 * h + h * h + h + 2 * h + h * f + f + f * h + h
    head = h * classes + classes if classes else 0
    params = chans * patch * patch * h + h + cls * h + tokens * h + depth * layer + 2 * h + head
    return ModelSpec("vit", params, layers=depth, layer_params=layer, hidden=h, ffn=f, heads=heads, kv_heads=heads,
                     tokens=tokens, image_size=img, in_chans=chans, num_classes=classes,
                     attention="eager" if cfg.get("fused_attn") is False else "sdpa", extra={"patch_size": patch})


def deepfm_spec(cfg: dict) -> ModelSpec:
    """DeepFM as the recsys recipes define it: one embedding table per sparse feature (``embedding_dim`` wide), a
    bottom MLP on the dense features ending at ``embedding_dim``, an FM term over all embeddings (no parameters)
    and a deep MLP over the concatenated embeddings ending in one logit."""
    dim = int(_need(cfg, "embedding_dim", "DeepFM"))
    rows = tuple(int(n) for n in _need(cfg, "num_embeddings_per_feature", "DeepFM"))
    if not rows or min(rows) < 1:
        raise ValueError(f"num_embeddings_per_feature={list(rows)} must list one positive size per sparse feature")
    dense_in = int(cfg.get("dense_in_features", 13))
    bottom = [int(w) for w in cfg.get("bottom_mlp", [512, 256, dim])]
    deep = [int(w) for w in cfg.get("deep_mlp", [512, 256])]
    dense = _mlp_params([dense_in, *bottom])
    dense += _mlp_params([(len(rows) + 1) * dim, *deep, 1])
    params = sum(rows) * dim + dense
    return ModelSpec("deepfm", params, embedding_dim=dim, table_rows=rows, dense_params=dense,
                     dense_in_features=dense_in, mlp_widths=tuple(bottom + deep + [1]), tokens=1)


def _mlp_params(widths: list[int]) -> int:
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def _attention(impl: Any) -> str:
    return "eager" if impl == "eager" else "sdpa"


def _from_module(module: nn.Module) -> ModelSpec:
    """An HF model from its config, a timm ViT from its attributes, other timm models and anything else from the
    module itself (parameters, repeated blocks, activations measured on the meta device). A LightningModule's
    ``model`` attribute is planned for when it is a model disttrain knows; else the LightningModule itself, with
    its ``example_input_array`` as the input to measure."""
    from disttrain.planner import generic

    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "model_type") and hasattr(module, "base_model_prefix"):
        return _from_hf_config(config, module)
    if hasattr(module, "patch_embed") and hasattr(module, "blocks"):
        return _vit_from_module(module)
    if type(module).__module__.startswith("timm.") and hasattr(module, "pretrained_cfg"):
        return generic.image_spec(module, f"timm {type(module).__name__}")
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module):
        spec = _from_module(inner)
        if spec.family != "module":
            return spec
    return generic.module_spec(module, getattr(module, "example_input_array", None))


def _vit_from_module(vit: nn.Module) -> ModelSpec:
    block = vit.blocks[0]
    h = vit.embed_dim if hasattr(vit, "embed_dim") else block.norm1.normalized_shape[0]
    img = vit.patch_embed.img_size
    patch = vit.patch_embed.patch_size
    cfg = {"img_size": img[0] if isinstance(img, (tuple, list)) else img,
           "patch_size": patch[0] if isinstance(patch, (tuple, list)) else patch,
           "in_chans": vit.patch_embed.proj.in_channels, "embed_dim": h, "depth": len(vit.blocks),
           "num_heads": block.attn.num_heads, "num_classes": getattr(vit, "num_classes", 0),
           "mlp_ratio": block.mlp.fc1.out_features / h, "fused_attn": getattr(block.attn, "fused_attn", True),
           "class_token": getattr(vit, "cls_token", None) is not None}
    spec = vit_spec(cfg)
    return replace(spec, params=count_params(vit), layer_params=count_params(block))


def parse_bytes(text: str | float) -> int:
    """``"40GiB"``, ``"16GB"``, ``"512MiB"``, ``40e9`` -> bytes. GB is 10^9, GiB 2^30 (a "40GB" A100 has 40 GiB)."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or math.isnan(value) or value <= 0:
        raise ValueError(f"memory size {text!r} is not understood; write e.g. 40GiB, 16GB or 80e9")
    return int(value * units[unit])


def meta_model(spec_source: dict) -> nn.Module:
    """The model a config describes, built on the meta device (for checking counts; allocates nothing)."""
    cfg = spec_source.get("model", spec_source)
    with torch.device("meta"):
        if "hidden_size" in cfg:
            from transformers import LlamaConfig, LlamaForCausalLM

            return LlamaForCausalLM(LlamaConfig(**cfg))
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(**cfg)
