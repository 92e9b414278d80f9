"""Fine-tuning the ViT from a timm checkpoint (``--pretrained``): read sharded into each strategy's shards, checked
against the config's architecture, a new class count leaving only the head at its initialisation."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, run_dist, run_python

from disttrain.parallel.checkpoint.io import load_pretrained
from disttrain.vision import build_vit, timm_checkpoint
from disttrain.vision.pretrained import HEAD, load_timm_checkpoint

SPECS = ["disttrain_fsdp", "disttrain_zero3", "disttrain_megatron:tensor_parallel_size=2"]
MODEL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch: each strategy loads the bfloat16 checkpoints sharded and trains 4 steps."""
    return run_dist("vit_pretrained_run.py", tmp_path_factory.mktemp("vit_pretrained"), *SPECS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_fine_tuning_from_a_timm_checkpoint_matches_one_process(runs, spec):
    result = runs[0]
    assert result[spec]["folder"] == pytest.approx(result["ref_losses"], rel=1e-5)
    if spec == SPECS[0]:  # a .pth is read whole once, as a temporary safetensors file, removed after the load
        assert result[spec]["torch_file"] == pytest.approx(result["ref_losses"], rel=1e-5)
        assert result[spec]["temporary_left"] == []


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_a_new_class_count_reinitialises_only_the_head(runs, spec):
    result = runs[0][spec]["new_head"]
    assert result["note"] == "pretrained: head.weight/head.bias re-initialised for 10 classes (checkpoint has 1000)"
    assert result["exclude"] == list(HEAD)
    assert result["equal"] == [name for name in result["names"] if name not in HEAD]
    assert result["head_shape"] == [10, 32] and result["head_finite"]


def save(model: torch.nn.Module, path, dtype=torch.bfloat16):
    from safetensors.torch import save_file

    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    save_file(state, str(path))
    return state


def vit(seed: int = 0, **changes) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_vit({**MODEL, **changes})


def test_one_process_loads_a_safetensors_file_and_a_hub_folder(tmp_path):
    from timm.models import save_for_hf

    saved = save(vit(0), tmp_path / "vit.safetensors")
    model = vit(1)
    assert load_pretrained(tmp_path / "vit.safetensors", model) == []
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor.float()), name
    save_for_hf(vit(2), str(tmp_path / "hub"), model_args=MODEL, safe_serialization=True)
    checkpoint = timm_checkpoint(tmp_path / "hub", MODEL)
    assert checkpoint.path == tmp_path / "hub" and checkpoint.exclude == () and checkpoint.note is None
    load_pretrained(checkpoint.path, model)
    assert torch.equal(model.pos_embed, vit(2).pos_embed)


def test_a_new_class_count_is_left_out_of_the_load(tmp_path):
    saved = save(vit(0, num_classes=1000), tmp_path / "vit.safetensors")
    checkpoint = timm_checkpoint(tmp_path / "vit.safetensors", MODEL)
    assert checkpoint.exclude == HEAD
    assert checkpoint.note == "pretrained: head.weight/head.bias re-initialised for 10 classes (checkpoint has 1000)"
    model = vit(1)
    head = model.head.weight.detach().clone()
    load_pretrained(checkpoint.path, model, exclude=checkpoint.exclude)
    assert torch.equal(model.head.weight, head)
    assert torch.equal(model.blocks[0].attn.qkv.weight, saved["blocks.0.attn.qkv.weight"].float())
    save(vit(0, num_classes=0), tmp_path / "headless.safetensors")
    assert timm_checkpoint(tmp_path / "headless.safetensors", MODEL).note == (
        "pretrained: head.weight/head.bias initialised for 10 classes (checkpoint has no head)")


def test_another_architecture_or_a_missing_file_is_one_line(tmp_path):
    save(vit(0, depth=3), tmp_path / "deeper.safetensors")
    with pytest.raises(ValueError, match=r"^pretrained checkpoint .*deeper.safetensors' does not match the model:"
                                         r" section of vit.yaml: it has extra blocks.2.attn.proj.bias, .* and 8 more;"
                                         r" set model: in vit.yaml to the checkpoint's architecture") as error:
        timm_checkpoint(tmp_path / "deeper.safetensors", MODEL, "vit.yaml")
    assert "\n" not in str(error.value)
    save(vit(0, img_size=64), tmp_path / "bigger.safetensors")
    with pytest.raises(ValueError, match=r"pos_embed is \[1, 65, 32\] there, \[1, 17, 32\] here; its position"
                                         r" embedding is for another image size: set model.img_size"):
        timm_checkpoint(tmp_path / "bigger.safetensors", MODEL)
    save(vit(0, embed_dim=64), tmp_path / "wider.safetensors")
    with pytest.raises(ValueError, match=r"blocks.0.attn.proj.bias is \[64\] there, \[32\] here"):
        timm_checkpoint(tmp_path / "wider.safetensors", MODEL)
    with pytest.raises(FileNotFoundError, match=r"pretrained checkpoint .*nothing' does not exist; pass a local timm"
                                                r" checkpoint: a folder with model.safetensors"):
        timm_checkpoint(tmp_path / "nothing", MODEL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"pretrained folder .*empty' holds no weights \(nothing\)"):
        timm_checkpoint(tmp_path / "empty", MODEL)


def test_a_torch_file_under_lightnings_own_strategy_loads_on_every_rank(tmp_path):
    """A .pth (or a hub folder holding only pytorch_model.bin) loads whole under Lightning's single-device strategy."""
    import lightning as L

    from disttrain.vision import ViTClassifier

    torch.save({"state_dict": {f"module.{k}": v for k, v in vit(0).state_dict().items()}}, tmp_path / "ckpt.pth")
    checkpoint = timm_checkpoint(tmp_path / "ckpt.pth", MODEL)
    assert checkpoint.is_torch_file
    fabric = L.Fabric(accelerator="cpu", devices=1)
    module = ViTClassifier(MODEL)
    module.configure_model()
    model = fabric.setup_module(module)
    load_timm_checkpoint(fabric, model, checkpoint)
    for name, tensor in vit(0).state_dict().items():
        assert torch.equal(module.model.state_dict()[name], tensor), name
    (tmp_path / "hub").mkdir()
    torch.save(vit(0).state_dict(), tmp_path / "hub" / "pytorch_model.bin")
    assert timm_checkpoint(tmp_path / "hub", MODEL).path == tmp_path / "hub" / "pytorch_model.bin"


@pytest.mark.slow
def test_recipe_fine_tunes_a_checkpoint_with_another_class_count(tmp_path):
    """The documented command, on 2 CPU processes (disttrain_fsdp): a 1000-class timm ViT of the tiny config's
    architecture is fine-tuned on the 10 digits; the head line is printed once."""
    import yaml
    from timm.models import save_for_hf

    model_args = {**yaml.safe_load((ROOT / "configs/vision/vit_tiny.yaml").read_text())["model"], "num_classes": 1000}
    save_for_hf(build_vit(model_args), str(tmp_path / "hub"), model_args=model_args, safe_serialization=True)
    proc = run_python("recipes/vision/vit2b.py", "--config", "configs/vision/vit_tiny.yaml", "--pretrained",
                      str(tmp_path / "hub"), "--steps", "3", "--out", str(tmp_path / "run"), "--data-root",
                      str(tmp_path / "digits"), "--logger", "none", "--no-report", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("pretrained: head.weight/head.bias re-initialised for 10 classes (checkpoint has 1000)"
                             ) == 1, proc.stdout
    assert "FSDPStrategy on 2 x cpu" in proc.stdout and f"fine-tuning {tmp_path / 'hub'}" in proc.stdout
