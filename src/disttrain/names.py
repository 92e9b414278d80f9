"""The one name table: every registered ``disttrain_*`` strategy, for the Trainer and for Fabric alike.

A row is (name, its Trainer and Fabric classes, default options, description); the classes are the class objects,
so a renamed class is an import error here, never a silently missing name. Names whose strategy is not
implemented are not listed, so they are not registered.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from disttrain import fabric, strategies


class Adapters(NamedTuple):
    trainer: type  # a lightning.pytorch Strategy
    fabric: type  # a lightning.fabric Strategy


class StrategyName(NamedTuple):
    name: str
    adapters: Adapters
    defaults: dict[str, Any]
    description: str


DDP = Adapters(strategies.DDPStrategy, fabric.DDPStrategy)
FSDP = Adapters(strategies.FSDPStrategy, fabric.FSDPStrategy)
ZERO3 = Adapters(strategies.ZeroStrategy, fabric.ZeroStrategy)

STRATEGIES: list[StrategyName] = [
    StrategyName("disttrain_ddp", DDP, {},
                 "DDP with optional gradient compression (fp16, bf16, PowerSGD); CPU (gloo) and GPU (nccl)"),
    StrategyName("disttrain_fsdp", FSDP, {},
                 "FSDP2 fully_shard, one unit per block found automatically, full shard; CPU (gloo) and GPU (nccl)"),
    StrategyName("disttrain_fsdp_offload", FSDP, {"cpu_offload": True},
                 "FSDP2 with parameters, gradients and optimizer state offloaded to CPU"),
    StrategyName("disttrain_zero3", ZERO3, {},
                 "DeepSpeed ZeRO stage 3; batch settings from the Trainer/Fabric; CPU (gloo) and GPU (nccl)"),
    StrategyName("disttrain_zero3_offload", ZERO3, {"offload_optimizer": "cpu", "offload_parameters": "cpu"},
                 "DeepSpeed ZeRO-3 with optimizer state and parameters offloaded to CPU (nvme_path= for NVMe)"),
    StrategyName("disttrain_megatron", Adapters(strategies.MegatronStrategy, fabric.MegatronStrategy), {},
                 "Megatron-style 3D: tensor parallel (heads/MLP) x pipeline parallel (torch pipelining) x FSDP2 data"
                 " parallel"),
    StrategyName("disttrain_recsys", Adapters(strategies.RecsysStrategy, fabric.RecsysStrategy), {},
                 "torchrec DistributedModelParallel: tables sharded by the planner, dense part data-parallel; CPU and"
                 " GPU"),
    StrategyName("disttrain_auto", Adapters(strategies.AutoStrategy, fabric.AutoStrategy), {},
                 "the planner's choice among the registered strategies, from model size, device memory and world"
                 " size"),
]


def register(trainer_registry: Any, fabric_registry: Any) -> list[str]:
    """Register every row in the Trainer's and Fabric's strategy registries (idempotent); returns the names."""
    for row in STRATEGIES:
        for registry, cls in ((trainer_registry, row.adapters.trainer), (fabric_registry, row.adapters.fabric)):
            if row.name not in registry:
                registry.register(row.name, cls, description=row.description, **row.defaults)
    return [row.name for row in STRATEGIES]
