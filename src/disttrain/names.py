"""The one name table: every registered ``disttrain_*`` strategy, for the Trainer and for Fabric alike.

A row is (name, adapter class name, default options, description). Names whose strategy is not implemented yet
are not listed, so they are not registered.
"""

STRATEGIES: list[tuple[str, str, dict, str]] = [
    ("disttrain_ddp", "DDPStrategy", {},
     "DDP with optional gradient compression (fp16, bf16, PowerSGD); CPU (gloo) and GPU (nccl)"),
    ("disttrain_fsdp", "FSDPStrategy", {},
     "FSDP2 fully_shard, one unit per block found automatically, full shard; CPU (gloo) and GPU (nccl)"),
    ("disttrain_fsdp_offload", "FSDPStrategy", {"cpu_offload": True},
     "FSDP2 with parameters, gradients and optimizer state offloaded to CPU"),
    ("disttrain_zero3", "ZeroStrategy", {},
     "DeepSpeed ZeRO stage 3; batch settings from the Trainer/Fabric; CPU (gloo) and GPU (nccl)"),
    ("disttrain_zero3_offload", "ZeroStrategy", {"offload_optimizer": "cpu", "offload_parameters": "cpu"},
     "DeepSpeed ZeRO-3 with optimizer state and parameters offloaded to CPU (nvme_path= for NVMe)"),
    ("disttrain_megatron", "MegatronStrategy", {},
     "Megatron-style 3D: tensor parallel (heads/MLP) x pipeline parallel (torch pipelining) x FSDP2 data parallel"),
    ("disttrain_recsys", "RecsysStrategy", {},
     "torchrec DistributedModelParallel: tables sharded by the planner, dense part data-parallel; CPU and GPU"),
    ("disttrain_auto", "AutoStrategy", {},
     "the planner's choice among the registered strategies, from model size, device memory and world size"),
]


def names_for(class_name: str) -> list[tuple[str, dict, str]]:
    return [(name, defaults, doc) for name, cls, defaults, doc in STRATEGIES if cls == class_name]
