"""disttrain_zero3 / disttrain_zero3_offload: ZeRO-3 specifics on 2 CPU processes, the config builder, export.

Loss parity, resume and the gathered export of ZeRO-3 runs are tested with the other strategies in
test_distributed.py (runs trainer_zero3 / fabric_zero3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import exported_probe_logits, relative_diff, run_dist

from common import reference_losses
from disttrain.parallel.engines.deepspeed import ZeroOptions, zero3_config

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return run_dist("zero3_checks.py", tmp_path_factory.mktemp("zero3"))[0]


@pytest.mark.slow
def test_zero_init_partitions_the_model_at_build(checks):
    local, total = checks["at_build"]
    assert local * 2 == total  # each of 2 ranks holds half, from construction on
    assert checks["after_fit"] == checks["at_build"]


@pytest.mark.slow
def test_fabric_init_module_runs_under_zero_init(fabric_zero3):
    local, total = fabric_zero3[0]["zero_partition"]
    assert local * 2 == total


@pytest.mark.slow
def test_fp16_overflow_step_is_skipped_and_training_continues(checks):
    assert checks["fp16_enabled"]
    assert checks["skipped_steps"] == 1
    assert checks["unchanged_by_overflow"]  # the inf step left the weights alone
    assert checks["global_step"] == 5 and all(torch.isfinite(torch.tensor(checks["fp16_losses"])))


@pytest.mark.slow
def test_cpu_offload_matches_single_process(checks):
    assert checks["offload"] == ["cpu", "cpu"] and checks["offload_param_device"] == "cpu"
    assert relative_diff(checks["offload_losses"], reference_losses(5, 2)) <= 1e-4


@pytest.mark.slow
def test_consolidated_zero_checkpoint_loads_into_plain_model(tmp_path, trainer_zero3):
    result = trainer_zero3[0]
    ckpt = Path(result["ckpt_dir"]) / "epoch=1-step=5.ckpt"  # the state after the last step
    logits = exported_probe_logits(ckpt, tmp_path / "fp32.safetensors", "--prefix", "model.")
    assert torch.allclose(logits, torch.tensor(result["logits"]), atol=1e-5, rtol=1e-5)


def config(**kw):
    options = ZeroOptions(**kw.pop("options", {}))
    args = dict(precision="32-true", micro_batch_size=2, accumulation=4, world_size=8, gradient_clipping=None,
                device_type="cpu")
    return zero3_config(options, **{**args, **kw})


def test_batch_settings_always_agree():
    cfg = config()
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == \
        (2, 4, 64)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed would clip at 1.0 if the key were absent


def test_user_config_is_merged():
    cfg = config(options={"config": {"zero_optimization": {"stage3_prefetch_bucket_size": 1000},
                                     "steps_per_print": 7, "train_batch_size": 64}})
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000 and cfg["steps_per_print"] == 7
    assert cfg["zero_optimization"]["contiguous_gradients"]


@pytest.mark.parametrize("user,message", [
    ({"train_micro_batch_size_per_gpu": 8}, r"ds_config sets train_micro_batch_size_per_gpu=8 but the DataLoader's"
                                            r" batch_size .* gives 2; remove"),
    ({"train_batch_size": 32}, r"train_batch_size=32 but micro batch x accumulation x world size gives 64"),
    ({"gradient_accumulation_steps": 1}, r"gradient_accumulation_steps=1 but accumulate_grad_batches"),
    ({"zero_optimization": {"stage": 2}}, r"zero_optimization.stage=2 but disttrain_zero3 is ZeRO stage 3"),
    ({"fp16": {"enabled": True}}, r"ds_config enables fp16 but the precision is '32-true'; set precision='16-mixed'"),
])
def test_conflicting_ds_config_is_a_clear_error(user, message):
    with pytest.raises(ValueError, match=message):
        config(options={"config": user})


@pytest.mark.slow
def test_deepspeed_starts_without_building_its_inference_comm_op(checks):
    """DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce (used only for inference) first."""
    assert checks["shm_comm_op"] is False


def test_clipping_and_precision_come_from_the_trainer():
    cfg = config(precision="bf16-mixed", gradient_clipping=0.5)
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 0.5
    fp16 = config(precision="16-mixed")["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0  # dynamic loss scaling
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0 but gradient_clip_val gives 0.5"):
        config(gradient_clipping=0.5, options={"config": {"gradient_clipping": 1.0}})


def test_offload_and_cpu_adam_choice(tmp_path):
    cfg = config(options={"offload_optimizer": "cpu", "offload_parameters": "cpu"})
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cfg["zero_force_ds_cpu_optimizer"] is False  # the user's torch optimizer is allowed on CPU
    gpu = config(device_type="cuda", options={"offload_optimizer": "cpu"})
    assert "zero_force_ds_cpu_optimizer" not in gpu  # on GPU DeepSpeedCPUAdam stays the default
    assert gpu["zero_optimization"]["offload_optimizer"]["pin_memory"]
    assert ZeroOptions(offload_optimizer="cpu").use_cpu_adam("cuda")
    assert not ZeroOptions(offload_optimizer="cpu").use_cpu_adam("cpu")
    nvme = config(options={"offload_parameters": "nvme", "nvme_path": str(tmp_path)})
    assert nvme["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)


def test_bad_options():
    with pytest.raises(ValueError, match=r"offload_optimizer='gpu' is not a place to offload to"):
        ZeroOptions(offload_optimizer="gpu")
    with pytest.raises(ValueError, match=r"nvme_path='/nonexistent' is not a folder"):
        ZeroOptions(offload_parameters="nvme", nvme_path="/nonexistent")
    with pytest.raises(FileNotFoundError, match=r"DeepSpeed config 'missing.json' does not exist"):
        config(options={"config": "missing.json"})
    import disttrain

    with pytest.raises(TypeError, match=r"unknown option 'offload' for strategy 'disttrain_zero3'"):
        disttrain.strategies.ZeroStrategy(offload="cpu")
