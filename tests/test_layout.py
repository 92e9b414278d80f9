"""Each engine declares how it holds a model's states (``Engine.layout(options)``); the planner, the step-time
model, the simulator and the callbacks read the declaration. Here: the declarations agree with the engines' options
and with what they hold, and a new way of holding states (DeepSpeed ZeRO-1/2, declared in this test only) is planned,
timed, simulated and handled by the callbacks with a layout and a registry row alone."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from types import SimpleNamespace

import pytest

from disttrain.parallel import registry
from disttrain.parallel.engines.deepspeed import REDUCE_BUCKET
from disttrain.parallel.engines.layout import (
    Accumulation,
    Dtype,
    Gather,
    Layout,
    Params,
    Precision,
    Reduce,
    Where,
)
from disttrain.parallel.engines.zero import ZeroEngine
from disttrain.planner import choose, estimate, hardware, model_spec
from disttrain.planner.steptime import breakdown, crosses_nodes

DIALOGUE_10B = "configs/nlp/dialogue_10b.yaml"
ROWS = [row for row in registry.STRATEGIES if row.engine is not None]


def accepts(row: registry.Registered, **options) -> bool:
    try:
        row.options(**options)
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_every_registered_strategy_declares_a_layout_its_options_agree_with(row):
    layout = row.layout()
    assert isinstance(layout, Layout)
    fields = {f.name for f in dataclasses.fields(row.options_cls)}
    refused = getattr(row.options_cls, "refused", {})
    assert layout.can.compile == ("compile" in fields and "compile" not in refused)
    assert layout.can.async_checkpoint == ("async_checkpoint" in fields and accepts(row, async_checkpoint=True))
    moved = {name for name, state in zip(("params", "grads", "optimizer"), layout.states)
             if state.where is not Where.DEVICE}
    assert moved <= set(layout.can.offload), f"{row.name} offloads {moved}, declares {layout.can.offload}"
    assert row.name.endswith("_offload") == layout.offloaded
    for dims in layout.searched:  # the planner can turn each degree it searches into the strategy's options
        degrees = {dims: 2, "dp_shard": 4} if dims == "dp_replicate" else {dims: 2}
        options = row.engine.degree_options(degrees)
        assert row.dims(8 if dims == "dp_replicate" else 4, options).degrees()[dims] == 2


def test_the_declarations_say_what_each_engine_does():
    ddp, fsdp, zero, megatron, recsys = (registry.lookup(f"disttrain_{n}").layout()
                                         for n in ("ddp", "fsdp", "zero3", "megatron", "recsys"))
    assert ddp.replica and ddp.grads.reduce is Reduce.ALL_REDUCE and ddp.buffers.gradient_copy
    assert fsdp.params.sharded_over == ("dp_shard", "cp") and fsdp.params.gather is Gather.PER_UNIT
    assert fsdp.can.precision is Precision.CASTS_ITSELF and fsdp.can.float8_all_gather
    assert zero.params.dtype is Dtype.COMPUTE and zero.optimizer.master and zero.can.owns_gradients
    assert zero.can.precision is Precision.DEEPSPEED and zero.can.accumulation is Accumulation.ENGINE
    assert megatron.split_by == ("tp", "pp", "ep") and set(megatron.searched) == {"tp", "pp", "cp", "ep"}
    piped = registry.MEGATRON.layout({"pipeline_parallel_size": 2})
    assert piped.can.accumulation is Accumulation.MICROBATCHES
    assert recsys.tables and recsys.params.sharded_over == ()
    nvme = registry.ZERO3.layout({"offload_optimizer": "cpu"})
    assert (nvme.params.where, nvme.grads.where, nvme.optimizer.where) == (Where.DEVICE, Where.HOST, Where.HOST)


def test_bytes_per_element_follow_the_precision():
    assert [Dtype.PARAM.bytes(p) for p in ("bf16-mixed", "32-true", "bf16-true")] == [4, 4, 2]
    assert [Dtype.COMPUTE.bytes(p) for p in ("bf16-mixed", "32-true", "16-true")] == [2, 4, 2]
    assert Dtype.FP32.bytes("bf16-true") == 4


def test_a_layout_names_only_parallel_dims_dimensions():
    with pytest.raises(ValueError, match="'tp'.* not data-parallel dimensions"):
        Layout(params=Params(("tp",)), grads=registry.DDP.layout().grads, optimizer=registry.DDP.layout().optimizer)
    with pytest.raises(ValueError, match="'nodes' is not a ParallelDims dimension"):
        replace(registry.DDP.layout(), searched=("nodes",))


def test_zero3_under_true_half_precision_keeps_an_fp32_master_copy():
    """DeepSpeed keeps its fp32 master partition and fp32 moments under bf16-true too, as the simulator counts."""
    from disttrain.simulate import simulate

    e = estimate(DIALOGUE_10B, "disttrain_zero3", 32, precision="bf16-true")
    assert e.optimizer == 12 * e.params // 2  # 2 bytes of bf16 partition, 12 of master + two moments
    sim = simulate(DIALOGUE_10B, "disttrain_zero3", 32, precision="bf16-true")
    assert e.states == pytest.approx(sim.busiest.states, rel=0.02)


# -- DeepSpeed ZeRO-1/2: a stage option with its layout (engines/zero.py) and registry rows, nothing else -----------
@pytest.fixture
def zero12():
    return registry.ZERO1, registry.ZERO2, registry.ZERO2_OFFLOAD


def test_zero1_and_zero2_are_planned_from_their_layout_alone(zero12):
    spec = model_spec(DIALOGUE_10B)
    P, n = spec.params, 8
    one, two, off = (estimate(spec, row.name, n) for row in zero12)
    zero3 = estimate(spec, "disttrain_zero3", n)
    part = zero3.params // 2  # DeepSpeed's padded partition, in elements
    assert (one.params, one.grads, one.optimizer) == (2 * P, 2 * P, 12 * part)
    assert (two.params, two.grads, two.optimizer) == (2 * P, 2 * part, 12 * part)
    # in host memory: the fp32 gradient partition, master copy and moments; a 16-bit copy of the partition and of
    # its gradients (summed over micro-steps)
    assert (off.params, off.grads, off.optimizer, off.host) == (2 * P, 0, 0, (4 + 12 + 2 + 2) * part)
    assert off.buffers == one.buffers  # the reduce bucket in 16 bits, the gradients' reduce dtype
    # gradients reduce-scattered in 16 bits, the updated partitions gathered once after the step
    assert one.comm["dp"] == pytest.approx(7 / 8 * P * 2) and one.comm["after_step"] == pytest.approx(7 / 8 * P * 2)
    assert one.buffers >= REDUCE_BUCKET * 2  # DeepSpeed's reduce bucket, allocated whole
    hw = hardware("A100-40GB")
    parts = breakdown(spec, two, hw)
    assert parts.critical > 0 and parts.dp > 0  # the gather after the step is on the critical path
    assert not crosses_nodes(two, hw)["after_step"]  # 8 ranks: one node
    plan = choose(spec, 32, hw, micro_batch=1, available=[row.name for row in zero12])
    assert {c.estimate.strategy for c in plan.candidates} == {row.name for row in zero12}
    assert not next(c for c in plan.candidates if c.estimate.strategy == "disttrain_zero1").fits  # 19 GiB of 16-bit


def test_zero2_is_simulated_from_its_layout_alone(zero12):
    from disttrain.simulate import simulate

    sim = simulate(DIALOGUE_10B, "disttrain_zero2", 32)
    e = estimate(DIALOGUE_10B, "disttrain_zero2", 32)
    assert e.states == pytest.approx(sim.busiest.states, rel=0.02)
    assert sim.busiest.comm["after_step"] > 0


def test_the_callbacks_read_zero12s_capabilities(zero12):
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    from disttrain.callbacks import MixedPrecision
    from disttrain.callbacks.accumulation import accumulates_itself

    strategy = SimpleNamespace(engine=ZeroEngine(registry.lookup("disttrain_zero2").options()))
    assert accumulates_itself(strategy)  # GradientAccumulation leaves the loss and the boundary to the engine
    assert isinstance(MixedPrecision("fp16").trainer_plugin(strategy), DeepSpeedPrecision)
    assert not strategy.engine.takes_module_transforms and not strategy.engine.casts_itself
