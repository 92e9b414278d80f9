"""The registry and ParallelDims, without processes: every strategy registered once, options turned into degrees by
the strategy's own rule, and every option a user sets is read or refused in one line."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain.parallel import registry
from disttrain.parallel.mesh import DIMENSIONS, ParallelDims


def test_every_row_builds_its_options_and_degrees():
    for row in registry.STRATEGIES:
        options = row.options()
        assert dataclasses.is_dataclass(options) and isinstance(options, row.options_cls)
        for key, value in row.defaults.items():
            assert getattr(options, key) == value, row
        if row.engine is not None:
            dims = row.dims(8, options)
            assert dims.world_size == 8 and dims.dp * dims.cp * dims.tp * dims.pp == 8


@pytest.mark.parametrize("name,options,degrees", [
    ("disttrain_ddp", {}, {"dp_replicate": 8}),
    ("disttrain_fsdp", {}, {"dp_shard": 8}),
    ("disttrain_fsdp", {"hybrid_shard": True, "shard_size": 4}, {"dp_replicate": 2, "dp_shard": 4}),
    ("disttrain_zero3_offload", {}, {"dp_shard": 8}),
    ("disttrain_zero1", {}, {"dp_shard": 8}),  # the ranks the optimizer state is partitioned over (the layout
    ("disttrain_zero2_offload", {}, {"dp_shard": 8}),  # keeps the parameters whole on each)
    ("disttrain_megatron", {"tensor_parallel_size": 2}, {"dp_shard": 4, "tp": 2}),
    ("disttrain_megatron", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 4},
     {"dp_shard": 2, "tp": 2, "pp": 2}),
    ("disttrain_megatron", {"tensor_parallel_size": 2, "context_parallel_size": 2}, {"dp_shard": 2, "cp": 2, "tp": 2}),
    ("disttrain_recsys", {}, {"dp_replicate": 8}),
])
def test_options_give_the_degrees(name, options, degrees):
    assert registry.lookup(name).dims(8, options).degrees() == degrees


def test_a_misplaced_option_names_the_strategies_that_take_it():
    with pytest.raises(TypeError, match=r"unknown option 'tensor_parallel_size' for strategy 'disttrain_fsdp'.*"
                                        r"\(tensor_parallel_size is an option of disttrain_megatron\)"):
        registry.FSDP.options(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"strategy='disttrain_fdsp' is not a registered disttrain strategy; did you"
                                         r" mean 'disttrain_fsdp'\?"):
        registry.lookup("disttrain_fdsp")


@pytest.mark.parametrize("name,options,message", [
    ("disttrain_megatron", {"microbatches": 4}, "microbatches=4 applies with pipeline_parallel_size > 1"),
    ("disttrain_megatron", {"pipeline_schedule": "gpipe"}, "pipeline_schedule='gpipe' applies with pipeline_parallel"),
    ("disttrain_megatron", {"tp_plan": {}}, r"tp_plan=\{\} applies with tensor_parallel_size > 1"),
    ("disttrain_megatron", {"hybrid_shard": True}, "hybrid_shard/shard_size are disttrain_fsdp options"),
    ("disttrain_megatron", {"context_parallel_attention": "ring"},
     "context_parallel_attention='ring' applies with context_parallel_size > 1"),
    ("disttrain_megatron", {"context_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 4},
     "context_parallel_size=2 with pipeline_parallel_size=2: context parallelism composes with tensor and data"),
    ("disttrain_fsdp", {"shard_size": 4}, "shard_size=4 applies to hybrid sharding only"),
    ("disttrain_fsdp", {"hybrid_shard": True, "shard_size": 3}, "shard_size=3 does not divide world_size=8"),
    ("disttrain_ddp", {"powersgd_rank": 4}, "powersgd_rank=4 applies with gradient_compression='powersgd'"),
    ("disttrain_fsdp", {"gradient_compression": "powersgd"},
     "gradient_compression='powersgd' is not offered by FSDP; choose None or one of bf16, int8"),
    ("disttrain_fsdp", {"gradient_compression": "int8", "hybrid_shard": True},
     "gradient_compression='int8' compresses the reduce-scatter within a shard group only"),
    ("disttrain_megatron", {"gradient_compression": "bf16"},
     "gradient_compression='bf16' is not offered by disttrain_megatron"),
    ("disttrain_zero3", {"gradient_compression": "int8"},
     "gradient_compression='int8' is not supported by disttrain_zero3: DeepSpeed compresses its own"),
    ("disttrain_zero3_offload", {"gradient_compression": "bf16"}, "is not supported by disttrain_zero3_offload"),
    ("disttrain_zero3", {"nvme_path": "/tmp"}, "nvme_path='/tmp' applies to NVMe offload"),
    ("disttrain_zero3", {"cpu_adam": True}, "cpu_adam=True applies to an offloaded optimizer"),
])
def test_an_option_its_run_would_not_read_is_refused(name, options, message):
    row = registry.lookup(name)
    with pytest.raises(ValueError, match=message) as info:
        row.dims(8, row.options(**options))
    assert "\n" not in str(info.value)


def test_the_trainer_refuses_zero3_options_it_takes_from_elsewhere():
    import disttrain

    with pytest.raises(TypeError, match=r"micro_batch_size=4 is a Fabric option of disttrain_zero3: under the Trainer"
                                        r" it comes from the training DataLoader's batch_size"):
        disttrain.strategies.ZeroStrategy(micro_batch_size=4)
    assert disttrain.fabric.ZeroStrategy(micro_batch_size=4).engine.options.micro_batch_size == 4


def test_parallel_dims_arithmetic_and_coordinates():
    dims = ParallelDims(16, dp_replicate=2, cp=2, tp=2)
    assert (dims.dp_shard, dims.dp, dims.shard) == (2, 4, 4)
    assert dims.label() == "dp_replicate=2 dp_shard=2 cp=2 tp=2"
    seen = set()
    for rank in range(16):
        at = dims.coordinates(rank)
        assert dims.rank_of(**at) == rank and set(at) == set(DIMENSIONS)
        seen.add(tuple(at.values()))
    assert len(seen) == 16
    assert dims.coordinates(1)["tp"] == 1 and dims.coordinates(2)["cp"] == 1  # tp fastest, then cp
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by tp\*pp=4 \(tp=2, pp=2\)"):
        ParallelDims(6, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp_shard=8.*choose one of 1, 2, 4, 8"):
        ParallelDims(8, ep=3)


def test_meshes_follow_the_degrees_on_a_fake_world():
    """The meshes ParallelDims builds, on torch's fake process group: the data-parallel mesh for samplers, and FSDP's
    over data shards x context-parallel ranks."""
    from disttrain.simulate.fake import fake_world

    dims = ParallelDims(8, cp=2, tp=2)
    with fake_world(5, 8):
        meshes = dims.build("cpu")
        at = dims.coordinates(5)
        assert meshes.world.mesh_dim_names == ("dp_shard", "cp", "tp")
        assert (meshes.dp.size(), meshes.fsdp.size(), meshes.cp.size(), meshes.tp.size()) == (2, 4, 2, 2)
        assert meshes.dp.get_local_rank() == at["dp_shard"] and meshes.tp.get_local_rank() == at["tp"]
        assert meshes.fsdp.get_local_rank() == at["dp_shard"] * 2 + at["cp"] and meshes.pp is None
