"""Model families (``disttrain.parallel.families``): each recognises its own models and configs (not their
submodules), counts them for the planner as they are built, and the planner reads a recipe config with the recipes'
own did-you-mean line."""

from __future__ import annotations

import pytest
import torch
import yaml
from torch import nn

from conftest import ROOT

from disttrain.config import ConfigError, keys_of
from disttrain.parallel.families import (
    FAMILIES,
    export_formats,
    family_for_config,
    family_named,
    family_of,
    find_model,
)

TINY_LLAMA = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TINY_VIT = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4, "num_classes": 10}
TINY_DEEPFM = {"embedding_dim": 8, "num_embeddings_per_feature": [50, 30, 20], "dense_in_features": 13,
               "bottom_mlp": [16, 8], "deep_mlp": [32, 16]}


def tiny_models() -> dict[str, nn.Module]:
    import timm
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, LlamaConfig, \
        LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    from disttrain.recsys.model import DeepFMNet

    return {
        "llama": LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)),
        "gpt2": GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                                           bos_token_id=0, eos_token_id=0)),
        "bert": BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                         intermediate_size=64, vocab_size=64)),
        "vit": timm.create_model("vit_base_patch16_224", pretrained=False, **TINY_VIT),
        "deepfm": DeepFMNet(**TINY_DEEPFM),
        # any other HF model whose config declares its parallel plans
        "hf_plans": Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, pad_token_id=0, eos_token_id=0, bos_token_id=0)),
    }


def test_each_family_recognises_its_models_and_not_their_submodules():
    models = tiny_models()
    assert sorted(models) == sorted(f.name for f in FAMILIES)
    for name, model in models.items():
        assert family_of(model) is family_named(name), name
        # Its layers do not count (HF attention modules keep the config too); an HF base model inside a model with
        # a head is a whole model of the family.
        parts = [m for m in list(model.modules())[1:] if not hasattr(m, "base_model_prefix")]
        assert parts and all(family_of(m) is None for m in parts), name

        class Wrapper(nn.Module):  # a LightningModule-like holder: found inside, with its path
            def __init__(self) -> None:
                super().__init__()
                self.config = getattr(model, "config", None)  # a holder that keeps the config is not the model
                self.inner = model

        path, found, family = find_model(Wrapper())
        assert (path, found, family.name) == ("inner", model, name)


def test_recipe_model_sections_are_read_by_their_family():
    """Each recipe config's model: is read by its family; an MoE dialogue config names its HF model_type, whose
    config class takes its keys (the planner builds it through transformers, the family file being hf_plans')."""
    from transformers import CONFIG_MAPPING

    from disttrain.parallel.families import LLAMA

    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        model = yaml.safe_load(path.read_text())["model"]
        family = family_for_config(model)
        if "moe" in path.name:
            assert family is None and model["model_type"] in CONFIG_MAPPING, path
            assert set(model) <= set(LLAMA.config_schema(model)), path
            continue
        assert family is not None and family.name == {"nlp": "llama", "vision": "vit", "recsys": "deepfm"}[
            path.parent.name], path
        assert set(model) <= set(family.config_schema(model)), path


def test_deepfm_family_keys_and_counts_are_deepfmnet_s():
    from disttrain.parallel.families.deepfm import MODEL_SCHEMA, DeepFMNet
    from disttrain.planner import model_spec

    deepfm = family_named("deepfm")
    assert deepfm.config_schema({}) == MODEL_SCHEMA  # the planner checks a recsys recipe's model: as its trainer does
    assert set(MODEL_SCHEMA) - {"sparse_optimizer"} == set(keys_of(DeepFMNet, exclude=["device", "sparse_optimizer"]))
    net = tiny_models()["deepfm"]
    count = sum(p.numel() for p in net.parameters())
    assert model_spec(TINY_DEEPFM).params == count
    assert model_spec(net) == model_spec(TINY_DEEPFM)  # a DeepFMNet is planned as its config is
    defaults = {k: v for k, v in TINY_DEEPFM.items() if k not in ("bottom_mlp", "deep_mlp", "dense_in_features")}
    with torch.device("meta"):
        built = DeepFMNet(**{**defaults, "embedding_dim": 64})  # DeepFMNet's defaults: bottom_mlp ends at 64
    assert model_spec({**defaults, "embedding_dim": 64}).params == sum(p.numel() for p in built.parameters())


@pytest.mark.parametrize("config, section, wrong, right", [
    ("nlp/dialogue_tiny.yaml", "model", "hiden_size", "hidden_size"),
    ("vision/vit_tiny.yaml", "model", "embed_dims", "embed_dim"),
    ("recsys/deepfm_tiny.yaml", "model", "embeding_dim", "embedding_dim"),
    ("recsys/deepfm_tiny.yaml", "model.sparse_optimizer", "nme", "name"),
])
def test_the_planner_reads_a_recipe_with_the_recipes_own_line(config, section, wrong, right, tmp_path):
    from test_config import reader

    from disttrain.planner import model_spec

    recipe = yaml.safe_load((ROOT / "configs" / config).read_text())
    target = recipe
    for part in section.split("."):
        target = target[part]
    target[wrong] = target.pop(right)
    bad = tmp_path / "recipe.yaml"
    bad.write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(ConfigError) as planner:
        model_spec(bad)
    with pytest.raises(ConfigError) as trainer:
        reader(ROOT / "configs" / config)(bad)
    assert str(planner.value) == str(trainer.value)
    assert str(planner.value).startswith(f"{bad}: unknown key {wrong!r} in {section}:; did you mean {right!r}?")


def test_the_planner_refuses_a_misspelt_section(tmp_path):
    from disttrain.planner import model_spec

    bad = tmp_path / "recipe.yaml"
    bad.write_text(yaml.safe_dump({"model": TINY_LLAMA, "trian": {"lr": 1.0}}))
    with pytest.raises(ConfigError, match=rf"^{bad}: unknown section 'trian'; did you mean 'train'\? valid sections"):
        model_spec(bad)


def test_export_formats_are_the_families_and_the_neutral_ones():
    assert tuple(export_formats()) == ("safetensors", "hf", "timm", "torch")
    assert {f.name: f.export_format.name for f in FAMILIES} == {"llama": "hf", "gpt2": "hf", "bert": "hf",
                                                                "vit": "timm", "deepfm": "torch", "hf_plans": "hf"}


def test_megatron_splits_the_model_inside_a_lightning_module_that_keeps_its_config():
    """DialogueLM keeps the LlamaConfig as ``self.config``: the model to split is still its ``model``."""
    from disttrain.nlp import DialogueLM
    from disttrain.parallel.engines.megatron import MegatronEngine, MegatronOptions

    module = DialogueLM(config=dict(TINY_LLAMA))
    with torch.device("meta"):
        module.configure_model()
    assert MegatronEngine(MegatronOptions())._target(module) == ("model.", module.model)


def test_a_vit_stage_sends_contiguous_activations_without_a_class_token():
    """timm keeps the patch embedding's transposed layout through the blocks when no class token is concatenated;
    point-to-point sends refuse such tensors, so a non-last stage hands on a contiguous one."""
    import torch
    from timm.models.vision_transformer import VisionTransformer

    from disttrain.parallel.families.vit import ViTStage

    vit = VisionTransformer(img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=2, num_heads=2,
                            class_token=False, global_pool="avg")
    images = torch.randn(2, 3, 32, 32)
    assert not vit.blocks(vit._pos_embed(vit.patch_embed(images))).is_contiguous()  # what timm hands on
    vit.blocks = torch.nn.ModuleDict({str(i): block for i, block in enumerate(vit.blocks)})
    first = ViTStage(vit, range(0, 1), first=True, last=False)
    assert first(images).is_contiguous()
    last = ViTStage(vit, range(1, 2), first=False, last=True)
    assert last(first(images)).shape == (2, 10)
