"""GPU checks (one CUDA device, nccl, world size 1): skipped on machines without CUDA.

``DISTTRAIN_TEST_DEVICE=cpu pytest -m gpu tests/test_gpu.py`` dry-runs the same checks on CPU (gloo)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from conftest import relative_diff

import disttrain
from common import LlamaModule, fabric_train, loader, reference_losses, tiny_llama
from disttrain.parallel import rank_state_bytes

DEVICE = os.environ.get("DISTTRAIN_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]
ACCELERATOR = "gpu" if DEVICE == "cuda" else "cpu"


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses(5, 1)  # CPU fp32, one process: what every run below is compared with


def fit(strategy, precision="32-true") -> tuple[LlamaModule, L.Trainer]:
    module = LlamaModule()
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=1, strategy=strategy, precision=precision, max_steps=5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader())
    return module, trainer


def test_trainer_fsdp_fp32(reference):
    module, _ = fit("disttrain_fsdp")
    assert relative_diff(module.losses, reference) <= 1e-4


def test_trainer_fsdp_bf16_mixed(reference):
    module, trainer = fit("disttrain_fsdp", "bf16-mixed")
    assert type(trainer.strategy.precision_plugin).__name__ == "FSDP2MixedPrecision"
    assert relative_diff(module.losses, reference) <= 2e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="Lightning turns 16-mixed into bf16 on CPU")
def test_trainer_fsdp_fp16_mixed_with_sharded_scaler(reference):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    module, trainer = fit("disttrain_fsdp", "16-mixed")
    scaler = trainer.strategy.precision_plugin.scaler
    assert isinstance(scaler, ShardedGradScaler) and scaler.get_scale() > 1
    assert relative_diff(module.losses, reference) <= 2e-2


def test_fabric_fsdp_offload_bf16(reference):
    fabric = L.Fabric(accelerator=ACCELERATOR, devices=1, strategy="disttrain_fsdp_offload", precision="bf16-mixed")
    fabric.launch()
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    losses = fabric_train(fabric, model, optimizer, 5)
    assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}  # offloaded between uses
    assert relative_diff(losses, reference) <= 2e-2


def test_fabric_offload_meta_init_keeps_parameters_on_host():
    fabric = L.Fabric(accelerator=ACCELERATOR, devices=1, strategy="disttrain_fsdp_offload", precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module(empty_init=True):  # allocated at setup: on the host, root's embeddings and norm too
        model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {DEVICE}  # rotary frequencies, where the forward runs
    losses = fabric_train(fabric, model, optimizer, 5)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_fabric_meta_init_on_device():
    fabric = L.Fabric(accelerator=ACCELERATOR, devices=1, strategy="disttrain_fsdp")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = tiny_llama()
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    q = model.module.model.layers[0].self_attn.q_proj.weight
    assert q.to_local().device.type == DEVICE
    assert 0.015 < q.full_tensor().std().item() < 0.025
    assert rank_state_bytes(model)["params"] == sum(p.numel() * 4 for p in model.parameters())


def test_trainer_ddp_fp16_compression(reference):
    module, _ = fit(disttrain.strategies.DDPStrategy(gradient_compression="fp16"))
    assert relative_diff(module.losses, reference) <= 1e-2


@pytest.fixture
def zero3():
    pytest.importorskip("deepspeed")


def test_trainer_zero3_bf16(zero3, reference):
    module, trainer = fit(disttrain.strategies.ZeroStrategy(), "bf16-mixed")
    assert trainer.strategy.config["bf16"]["enabled"]
    assert relative_diff(module.losses, reference) <= 2e-2


def test_trainer_zero3_offload_uses_cpu_adam_on_gpu(zero3, reference, tmp_path):
    if DEVICE != "cuda":
        pytest.skip("DeepSpeedCPUAdam is the default only on GPU")
    module, trainer = fit(disttrain.strategies.ZeroStrategy(offload_optimizer="cpu", offload_parameters="cpu",
                                                            extensions_dir=str(tmp_path / "ext")))
    assert type(trainer.strategy.deepspeed_engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    assert relative_diff(module.losses, reference) <= 1e-3
