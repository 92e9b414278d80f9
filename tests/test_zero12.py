"""disttrain_zero1 / disttrain_zero2 / disttrain_zero2_offload: DeepSpeed's own stage 1/2 engine on 2 CPU processes
(Trainer and Fabric), the options and the config builder.

One launch of tests/dist/zero12_checks.py serves the multi-process tests here; the stage 2 runs through
trainer_fsdp.py / fabric_fsdp.py (losses, resume, export, validate) are tested with the other strategies in
test_distributed.py, checkpoints in test_zero12_checkpoints.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import exported_probe_logits, relative_diff, run_dist

from common import clipped_reference, reference_losses, tiny_llama
from disttrain.parallel import registry
from disttrain.parallel.engines.deepspeed import STAGE12_KEYS, ZeroOptions, zero_config

pytestmark = pytest.mark.timeout(900)
WORLD = 2
NAMES = ("disttrain_zero1", "disttrain_zero2", "disttrain_zero2_offload")
ACCUMULATING = (*NAMES, "disttrain_zero3", "disttrain_zero3_offload")
MAX_NORM = 0.5  # zero12_checks.py's clipping


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return run_dist("zero12_checks.py", tmp_path_factory.mktemp("zero12"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_trainer_matches_one_process(checks, name):
    run = checks[0]["trainer"][name]
    assert relative_diff(run["losses"], reference_losses(5, WORLD)) <= 1e-5, run["losses"]
    assert run["engine"] == name and run["config"]["stage"] == int(name[len("disttrain_zero")])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fabric_setup_module_then_optimizers_clips_like_one_process(checks, name):
    """fabric.setup_module, then the optimizer from the set-up model's parameters and fabric.setup_optimizers;
    fabric.clip_gradients returns the whole model's norm and DeepSpeed clips by it."""
    losses, norms = clipped_reference(3, WORLD, MAX_NORM)
    run = checks[0]["fabric"][name]
    assert relative_diff(run["norms"], norms) <= 1e-5, (run["norms"], norms)
    assert relative_diff(run["losses"], losses) <= 1e-5, (run["losses"], losses)
    assert run["engine"] == name


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["trainer", "fabric"])
@pytest.mark.parametrize("name", NAMES)
def test_each_rank_holds_its_share_of_the_master_weights_and_optimizer_state(checks, entry, name):
    params = checks[0]["trainer"][name]["params"]
    held = [rank[entry][name]["held"] for rank in checks]
    for rank in held:
        assert rank["stage"] == (1 if name == "disttrain_zero1" else 2)
        # DeepSpeed pads each group's flat tensor to a multiple of 2 x world size elements, then splits it evenly.
        assert params / WORLD <= rank["master"] < params / WORLD + 2 * WORLD
        assert rank["optimizer"] == 2 * rank["master"]  # AdamW's exp_avg and exp_avg_sq of the partition
        assert rank["master_device"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_gradients_kept_between_micro_steps(checks, name):
    """After the first of two accumulated micro-batches: ZeRO-1 keeps every gradient whole; ZeRO-2 only those of the
    parameters its partition covers (half, plus the parameter that straddles the boundary); ZeRO-2 with offload
    keeps none on the compute device and its partition's in host memory."""
    params, largest = (checks[0]["trainer"][name][k] for k in ("params", "largest"))
    between = [rank["trainer"][name]["between"] for rank in checks]
    for rank in between:
        assert rank["accumulation"] == 2 and not rank["boundary"]
        if name == "disttrain_zero1":
            assert rank["grads"] == params
        elif name == "disttrain_zero2":
            assert params / WORLD - largest <= rank["grads"] <= params / WORLD + largest
        else:
            assert rank["grads"] == 0 and rank["host_grads"] == rank["master"]
            assert params / WORLD - largest <= rank["host_accumulated"] <= params / WORLD + largest
    if name != "disttrain_zero1":  # every gradient element is kept by one rank; a straddling parameter by two
        kept = sum(rank["grads"] + rank["host_accumulated"] for rank in between)
        assert params <= kept <= params + largest


@pytest.mark.slow
def test_full_model_is_the_whole_model_without_gradients(checks):
    for rank in checks:
        for name in NAMES:
            run = rank["fabric"][name]
            assert run["same_as_engine"] and not run["grad_inside_full_model"]
    assert checks[0]["fabric"]["disttrain_zero2"]["logits"] == checks[1]["fabric"]["disttrain_zero2"]["logits"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ACCUMULATING)
def test_fabric_accumulates_like_one_process(checks, name):
    """GradientAccumulation.attach sets the strategy's gradient_accumulation_steps (2 micro-batches of 2 per rank);
    two fabric.backward(loss), then optimizer.step(): the losses of one process training on each window's whole
    batch. Without DeepSpeed told which backward ends the window, stages 1 and 2 would find no gradient to step."""
    run = checks[0]["fabric_accumulation"][name]
    assert (run["micro_steps"], run["accumulation"]) == (2, 2)
    reference = reference_losses(3, WORLD, accumulation=2)
    assert relative_diff(run["losses"], reference) <= 1e-5, (run["losses"], reference)


@pytest.mark.slow
def test_fabric_wrong_count_of_backward_passes_is_one_error(checks):
    errors = checks[0]["fabric_wrong_counts"]
    fix = "call optimizer.step() after every 2 backward passes, or pass ZeroStrategy(gradient_accumulation_steps=N)"
    assert errors["early_step"].startswith("disttrain_zero2: optimizer.step() after 1 backward passes, but"
                                           " gradient_accumulation_steps=2: " + fix)
    assert errors["extra_backward"].startswith("disttrain_zero2: backward pass 3 since the last optimizer step, but"
                                               " gradient_accumulation_steps=2: " + fix)
    assert all("\n" not in message for message in errors.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_planner_estimate_matches_what_deepspeed_holds(checks, name):
    """The planner's per-rank bytes (fp32) of parameters, gradients and optimizer state on the device, and of host
    memory under offload, against the storages DeepSpeed's optimizer holds while accumulating (the largest after any
    backward or step; zero12_state_bytes tells host from device by what DeepSpeed offloads, since on CPU both are the
    CPU). Within 15%; a state the estimate puts elsewhere must be absent."""
    from disttrain.planner import estimate

    e = estimate(tiny_llama(), name, WORLD, micro_batch=2, seq_len=16, precision="32-true")
    predicted = {"params": e.params, "grads": e.grads, "optimizer": e.optimizer, "host": e.host}
    for rank in checks:
        measured = rank["fabric_accumulation"][name]["bytes"]
        for key, value in predicted.items():
            if value == 0:
                assert measured[key] == 0, (key, measured)
            else:
                assert abs(value - measured[key]) / measured[key] <= 0.15, (key, value, measured[key])


@pytest.mark.slow
def test_fp16_overflow_step_is_skipped_and_training_continues(checks):
    fp16 = checks[0]["fp16"]
    assert fp16["fp16_enabled"] and fp16["param_dtype"] == "torch.float16"
    assert fp16["skipped_steps"] == 1
    assert fp16["unchanged_by_overflow"]  # the inf step left the fp32 master partitions alone
    assert fp16["global_step"] == 5 and all(torch.isfinite(torch.tensor(fp16["losses"])))
    assert relative_diff(fp16["losses"][:2], reference_losses(2, WORLD)) <= 1e-2


@pytest.mark.slow
def test_bf16_computes_in_bf16_and_checkpoints_the_fp32_master(checks):
    bf16 = checks[0]["bf16"]
    assert (bf16["param_dtype"], bf16["master_dtype"]) == ("torch.bfloat16", "torch.float32")
    assert bf16["stored_model_dtypes"] == ["torch.float32"]
    assert relative_diff(bf16["losses"], reference_losses(3, WORLD)) <= 1e-2


@pytest.mark.slow
def test_trainer_checkpoint_exports_to_a_plain_model(tmp_path, trainer_zero2):
    result = trainer_zero2[0]
    ckpt = Path(result["ckpt_dir"]) / "epoch=1-step=5.ckpt"  # the state after the last step
    logits = exported_probe_logits(ckpt, tmp_path / "fp32.safetensors", "--prefix", "model.")
    assert torch.allclose(logits, torch.tensor(result["logits"]), atol=1e-5, rtol=1e-5)


# -- options and config (no processes) --------------------------------------------------------------------------
def config(stage: int, **kw):
    options = ZeroOptions(stage=stage, **kw.pop("options", {}))
    args = dict(precision="32-true", micro_batch_size=2, accumulation=4, world_size=8, gradient_clipping=None,
                device_type="cpu")
    return zero_config(options, **{**args, **kw})


def test_rows_set_the_stage_and_offload():
    stages = {row.name: (row.options().stage, row.options().offload_optimizer) for row in registry.STRATEGIES
              if row.name.startswith("disttrain_zero")}
    assert stages == {"disttrain_zero1": (1, None), "disttrain_zero2": (2, None), "disttrain_zero2_offload": (2, "cpu"),
                      "disttrain_zero3": (3, None), "disttrain_zero3_offload": (3, "cpu")}


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_and_2_config_carries_the_stage_and_deepspeeds_bucket_defaults(stage):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = config(stage)["zero_optimization"]
    defaults = DeepSpeedZeroConfig(stage=stage)  # what DeepSpeed runs when the keys are absent
    assert zero["stage"] == stage
    assert {key: zero[key] for key in STAGE12_KEYS} == {key: getattr(defaults, key) for key in STAGE12_KEYS}
    offload = config(stage, options={"offload_optimizer": "cpu"})
    assert offload["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert offload["zero_force_ds_cpu_optimizer"] is False


def test_user_bucket_sizes_refine_ours():
    zero = config(2, options={"config": {"zero_optimization": {"reduce_bucket_size": 1000, "overlap_comm": True}}})
    assert (zero["zero_optimization"]["reduce_bucket_size"], zero["zero_optimization"]["overlap_comm"]) == (1000, True)


@pytest.mark.parametrize("stage,user,message", [
    (2, 3, r"ds_config sets zero_optimization.stage=3 but disttrain_zero2 is ZeRO stage 2; use disttrain_zero3"
           r" \(strategy='disttrain_zero3'\) for stage 3, or remove the stage from the ds_config"),
    (1, 2, r"stage=2 but disttrain_zero1 is ZeRO stage 1; use disttrain_zero2"),
    (3, 1, r"stage=1 but disttrain_zero3 is ZeRO stage 3; use disttrain_zero1"),
    (2, 0, r"stage=0 but disttrain_zero2 is ZeRO stage 2; use disttrain_ddp"),
])
def test_a_contradicting_ds_config_stage_names_the_strategy_to_use(stage, user, message):
    with pytest.raises(ValueError, match=message):
        config(stage, options={"config": {"zero_optimization": {"stage": user}}})


@pytest.mark.parametrize("options,message", [
    ({"stage": 2, "offload_parameters": "cpu"}, r"offload_parameters='cpu' is ZeRO stage 3 only \(disttrain_zero2"
                                                r" keeps the parameters whole on every rank\); use"
                                                r" disttrain_zero3_offload, or remove offload_parameters"),
    ({"stage": 1, "offload_optimizer": "nvme"}, r"offload_optimizer='nvme' is ZeRO stage 3 only; disttrain_zero1"
                                                r" offloads the optimizer to 'cpu'"),
    ({"stage": 0}, r"stage=0 is not a ZeRO stage disttrain runs; choose 1, 2 or 3 \(disttrain_zero1,"
                   r" disttrain_zero2, disttrain_zero3; stage 0 is disttrain_ddp\)"),
    ({"stage": True}, r"stage=True is not a ZeRO stage"),
    ({"stage": 2, "async_checkpoint": True}, r"async_checkpoint=True is not offered on disttrain_zero2"),
])
def test_stage_3_only_options_are_refused_when_the_strategy_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroOptions(**options)


@pytest.mark.parametrize("entry", ["strategies", "fabric"])
def test_the_adapters_take_the_stage_and_refuse_in_one_line(entry):
    import disttrain

    cls = getattr(disttrain, entry).ZeroStrategy
    assert cls(stage=1).engine.name == "disttrain_zero1"
    assert cls(stage=2, offload_optimizer="cpu").engine.name == "disttrain_zero2_offload"
    with pytest.raises(ValueError, match=r"offload_parameters='cpu' is ZeRO stage 3 only"):
        cls(stage=2, offload_parameters="cpu")


def test_the_layout_says_the_parameters_are_whole_on_every_rank():
    """Every stage partitions over the same data-parallel ranks; the layout says what each keeps whole."""
    dims = registry.ZERO2.dims(4)
    assert dims.degrees() == registry.ZERO3.dims(4).degrees() == {"dp_shard": 4}
    one, two, three = (registry.lookup(f"disttrain_zero{s}").layout(registry.lookup(f"disttrain_zero{s}").options())
                       for s in (1, 2, 3))
    assert [layout.params.shards(dims) for layout in (one, two, three)] == [1, 1, 4]
    assert [layout.grads.shards(dims) for layout in (one, two, three)] == [1, 4, 4]
    assert [layout.optimizer.shards(dims) for layout in (one, two, three)] == [4, 4, 4]


def test_full_model_below_stage_3_and_the_refusal_at_stage_3():
    from disttrain.parallel.engines.zero import ZeroEngine

    module = torch.nn.Linear(2, 2)
    with ZeroEngine(ZeroOptions(stage=2)).full_model(module) as full:
        assert full is module and not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    with pytest.raises(NotImplementedError, match=r"disttrain_zero3 has no full_model\(\): write the full model with"
                                                  r" strategy.export_full\(path\)"):
        ZeroEngine(ZeroOptions()).full_model(module)
