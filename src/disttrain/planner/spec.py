"""What the planner needs to know of a model, read from a config (dict, recipe YAML, HF config.json or folder), a
timm model name, or an ``nn.Module``.

Nothing here allocates a model. The families with formulas (:mod:`disttrain.parallel.families`: Llama, ViT, DeepFM)
count their configs analytically (the tests check the counts against models built on the meta device); every other
model is built on the meta device (HF configs of other families, timm names) or inspected as it is, and measured
there (:mod:`disttrain.planner.generic`).
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Union

from torch import nn

from disttrain.config import read_recipe
from disttrain.parallel.families import closest_family, family_for_config, family_for_model_type, family_of
from disttrain.parallel.families.spec import ModelSpec, count_params

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
    """By the family's formulas where it has them (Llama), else built (on meta) and measured."""
    from disttrain.planner import generic

    family = family_for_model_type(config.model_type)
    spec = family.spec_from_hf_config(config, module) if family is not None else None
    return spec if spec is not None else generic.hf_spec(config, module)


def _model_schema(mapping: Any) -> Any:
    """The keys the ``model:`` mapping's family takes (the closest family's when a misspelt key hides it)."""
    family = (family_for_config(mapping) or closest_family(mapping)) if isinstance(mapping, dict) else None
    return family.config_schema(mapping) if family is not None else None


def recipe_model(path: str | os.PathLike) -> dict:
    """The ``model:`` mapping of a recipe YAML of any kind, its keys checked as the recipes check them."""
    return read_recipe(path, model_schema=_model_schema)["model"]


def _from_yaml(path: Path) -> ModelSpec:
    """A recipe YAML of any kind, read (and its ``model:`` keys checked) as the recipes read it. A recsys recipe's
    table optimizer and ``strategy:`` sharding constraints go into ``extra["recsys"]``: they decide where the
    tables land."""
    recipe = read_recipe(path, model_schema=_model_schema)
    spec = _from_mapping(recipe["model"], source=str(path))
    spec.extra["recipe"] = recipe_settings(recipe)
    if spec.table_rows:
        strategy = recipe.get("strategy") or {}
        spec.extra["recsys"] = {
            "sparse_optimizer": (recipe["model"].get("sparse_optimizer") or {}).get("name"),
            "sharding_types": strategy.get("sharding_types"), "constraints": strategy.get("constraints") or {}}
    return spec


def recipe_settings(recipe: dict) -> dict:
    """What a recipe fixes that the planner would otherwise choose: ``micro_batch`` (``train.micro_batch_size``,
    else ``data.batch_size`` or ``train.batch_size``: samples per process per step), ``precision``
    (``train.precision``), ``activation_checkpointing`` (``train.activation_checkpointing``), ``seq_len``
    (``data.seq_len``) and ``lora_rank`` (``lora.rank``, when LoRA is on); only the keys the recipe sets."""
    train, data = recipe.get("train") or {}, recipe.get("data") or {}
    out: dict = {}
    batch = train.get("micro_batch_size") or data.get("batch_size") or train.get("batch_size")
    if batch:
        out["micro_batch"] = int(batch)
    for key, section in (("precision", train), ("activation_checkpointing", train), ("seq_len", data)):
        if section.get(key) is not None:
            out[key] = section[key]
    if (recipe.get("lora") or {}).get("rank"):
        out["lora_rank"] = int(recipe["lora"]["rank"])
    return out


def _from_mapping(mapping: dict, source: str = "the model mapping") -> ModelSpec:
    if isinstance(mapping.get("model"), dict):
        mapping = mapping["model"]
    family = family_for_config(mapping)
    if family is not None:
        spec = family.spec_from_config(mapping)
        spec.extra["config"] = dict(mapping)  # for the exact per-parameter shards (planner.shards)
        return spec
    if "model_type" in mapping:  # an HF config of a family without formulas
        from transformers import AutoConfig

        settings = {k: v for k, v in mapping.items() if k != "model_type"}
        return _from_hf_config(AutoConfig.for_model(mapping["model_type"], **settings))
    raise ValueError(f"cannot tell the model family of {source} (keys: {', '.join(sorted(mapping))}); expected "
                     f"LlamaConfig keys (hidden_size, ...), an HF config with model_type, timm VisionTransformer keys"
                     f" (embed_dim, patch_size, ...) or DeepFM keys (embedding_dim, num_embeddings_per_feature, ...)")


def _from_module(module: nn.Module) -> ModelSpec:
    """:func:`_module_spec`, with the module's parameter tensors counted (the optimizer's work per tensor)."""
    from disttrain.parallel.split.fsdp import unit_count

    spec = _module_spec(module)
    spec.extra.setdefault("tensors", sum(1 for _ in module.parameters()))
    spec.extra.setdefault("fsdp_units", unit_count(module))
    return spec


def _module_spec(module: nn.Module) -> ModelSpec:
    """A model of a family with formulas from the module itself, any other HF model from its config, timm models
    and anything else from the module (parameters, repeated blocks, activations measured on the meta device). A
    LightningModule's ``model`` attribute is planned for when it is a model disttrain knows; else the
    LightningModule itself, with its ``example_input_array`` as the input to measure."""
    from disttrain.planner import generic

    family = family_of(module)
    spec = family.spec_from_module(module) if family is not None else None
    if spec is not None:
        # What this very module allows, as the engine will check it (DeiT's distillation token: no pipeline stages).
        if spec.extra.get("pipeline"):
            spec.extra["pipeline"] = generic.can_pipeline(family, module)
        return spec
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "model_type") and hasattr(module, "base_model_prefix"):
        return _from_hf_config(config, module)
    if type(module).__module__.startswith("timm.") and hasattr(module, "pretrained_cfg"):
        return generic.image_spec(module, f"timm {type(module).__name__}")
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module):
        spec = _from_module(inner)
        if spec.family != "module":
            return spec
    return generic.module_spec(module, getattr(module, "example_input_array", None))


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
    family = family_for_config(cfg)
    if family is not None:
        return family.meta_model(cfg)
    if "model_type" in cfg:  # an HF config of a family without a file here (an MoE model, Phi-3, ...)
        import torch
        from transformers import AutoConfig

        from disttrain.planner.generic import build_hf

        with torch.device("meta"):
            return build_hf(AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                                       if k != "model_type"}))
    raise ValueError(f"cannot tell the model family of {sorted(cfg)}; see model_spec")


__all__ = ["ModelLike", "ModelSpec", "count_params", "meta_model", "model_spec", "parse_bytes", "recipe_model"]
