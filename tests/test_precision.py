"""Precision callbacks: real fp16 on CPU with dynamic loss scaling (overflow skips a step), bf16, FP8 (torchao)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from conftest import relative_diff, run_dist
from torch import nn

from common import reference_losses, tiny_llama
from disttrain.callbacks import FP8, MixedPrecision, convert_to_fp8

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_dist("precision_run.py", tmp_path_factory.mktemp("precision"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,plugin,scaler", [("disttrain_fsdp", "FSDP2MixedPrecision", "ShardedGradScaler"),
                                                    ("disttrain_ddp", "MixedPrecision", "GradScaler")])
def test_fp16_on_cpu_skips_the_overflow_step(runs, strategy, plugin, scaler):
    result = runs[strategy]
    assert (result["plugin"], result["scaler"]) == (plugin, scaler)  # real fp16, not Lightning's CPU bf16
    assert result["skipped_steps"] == 1 and result["unchanged_by_overflow"]
    assert result["loss_scale"] == 2.0 ** 15  # halved once from 2**16
    assert result["param_dtype"] == "torch.float32"  # fp32 master weights
    assert all(math.isfinite(x) for x in result["losses"])
    # steps before the overflow match fp32 closely (fp16 rounding only)
    assert relative_diff(result["losses"][:2], reference_losses(2, 2)) <= 1e-3


@pytest.mark.slow
def test_fp16_callback_under_zero3_uses_deepspeed_loss_scaling(runs):
    result = runs["disttrain_zero3"]
    assert result["fp16"] and result["plugin"] == "DeepSpeedPrecision"
    assert result["skipped_steps"] == 1 and all(math.isfinite(x) for x in result["losses"])


@pytest.mark.slow
def test_bf16_callback_matches_fp32_closely(runs):
    assert relative_diff(runs["bf16_losses"], reference_losses(5, 2)) <= 2e-2


@pytest.mark.slow
def test_fp8_under_fsdp_trains_close_to_bf16(runs):
    assert runs["fp8_layers"] == ["Float8Linear", "Linear"]
    assert len(runs["fp8_converted"]) == 14  # q, k, v, o, gate, up, down in 2 layers
    assert runs["fp8_skipped"] == {"model.lm_head": "skipped by name"}
    assert relative_diff(runs["fp8_losses"], runs["bf16_losses"]) <= 3e-2


def test_fp8_skips_layers_it_cannot_take():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    report = convert_to_fp8(model)
    assert report.converted == ["0"]
    assert report.skipped == {"2": "shape 64x10 is not a multiple of 16"}
    assert type(model[0]).__name__ == "Float8Linear" and type(model[2]) is nn.Linear
    out = model(torch.randn(32, 64))
    out.sum().backward()  # trains on CPU
    assert model[0].weight.grad is not None


def test_fabric_fp16_plugin_counts_skipped_steps():
    mp = MixedPrecision("fp16")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mp.fabric_plugin("cpu")])
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    ids = torch.randint(0, 96, (2, 16))
    for step in range(3):
        with fabric.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss * (math.inf if step == 1 else 1.0))
        optimizer.step()
        optimizer.zero_grad()
        mp.update(fabric)
    assert mp.skipped_steps == 1 and mp.loss_scale == 2.0 ** 15


def test_bad_options():
    with pytest.raises(ValueError, match=r"MixedPrecision\(dtype='fp32'\) is not supported; choose 'fp16' or 'bf16'"):
        MixedPrecision("fp32")
    with pytest.raises(ValueError, match=r"FP8\(recipe='delayed'\) is not known"):
        FP8("delayed")

    class Trainer:
        strategy = object()

    with pytest.raises(ValueError, match=r"FP8 needs disttrain_fsdp or disttrain_ddp \(got object\)"):
        FP8().setup(Trainer(), None, "fit")
