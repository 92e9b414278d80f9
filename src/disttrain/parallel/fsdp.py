"""FSDP2 (``fully_shard``): one unit per block, then the root."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from disttrain.parallel.ac import apply_ac
from disttrain.parallel.blocks import BlockSpec, find_blocks
from disttrain.parallel.precision import mixed_precision_policy


@dataclass
class FSDPOptions:
    """What a user can set on ``disttrain_fsdp`` (the same names on the Trainer and Fabric strategies).

    wrap_classes: block class(es) or class name(s) to shard one unit each; default: found automatically.
    activation_checkpointing: recompute each block's activations in backward.
    cpu_offload: keep parameters, gradients and optimizer state on the CPU between uses.
    reshard_after_forward: free gathered parameters after forward (True, ZeRO-3) or keep them until backward
        (False, ZeRO-2 style: more memory, one all-gather less), or an int: reshard to that smaller group size.
    empty_init: build the model on the meta device when the Trainer/Fabric does not say (``configure_model`` /
        ``init_module()``), so no rank ever holds the whole model; shards are initialised after sharding.
    save_distributed_checkpoint: sharded (torch.distributed.checkpoint) checkpoints; False writes one full file.
    hybrid_shard: HSDP on a 2D mesh: shard within a group of ``shard_size`` ranks (default: the processes of one
        node), replicate across groups (nodes): all-gathers stay on the fast intra-node links, only the gradient
        all-reduce crosses nodes.
    shard_size: ranks per shard group under ``hybrid_shard``; must divide the world size.
    broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the data-parallel ranks: the first
        rank's after every training forward, as DDP's ``broadcast_buffers=True`` does; False lets each rank keep
        its own.
    sync_batchnorm: BatchNorm layers as SyncBatchNorm over the data-parallel ranks (GPU only, as under DDP); the
        Trainer's ``sync_batchnorm=True`` does the same.
    """

    wrap_classes: BlockSpec = None
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    reshard_after_forward: Union[bool, int] = True
    empty_init: bool = False
    save_distributed_checkpoint: bool = True
    hybrid_shard: bool = False
    shard_size: Optional[int] = None
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    if not cpu_offload:
        return OffloadPolicy()
    # Pinned host memory needs the CUDA driver; on CPU-only machines pinning would fail (and gains nothing).
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    options: FSDPOptions,
    precision: str = "32-true",
    device: torch.device | None = None,
) -> list[nn.Module]:
    """Shard ``model`` in place: activation checkpointing and ``fully_shard`` per block, then the root.

    Returns the FSDP units (blocks, or their checkpoint wrappers). ``mesh`` is the data-parallel mesh.
    """
    device = device or torch.device(mesh.device_type)
    blocks = find_blocks(model, options.wrap_classes)
    if options.activation_checkpointing:
        blocks = apply_ac(model, blocks)
    common = dict(mesh=mesh, offload_policy=offload_policy(options.cpu_offload, device))
    block_policy = mixed_precision_policy(precision)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: resharding them is wasted work.
        reshard = options.reshard_after_forward if i < len(blocks) - 1 else False
        fully_shard(block, reshard_after_forward=reshard, **common,
                    **({"mp_policy": block_policy} if block_policy else {}))
    root_policy = mixed_precision_policy(precision, root=True)
    fully_shard(model, reshard_after_forward=options.reshard_after_forward, **common,
                **({"mp_policy": root_policy} if root_policy else {}))
    return blocks


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP2's reduce-scatter off for the non-final micro-steps of gradient accumulation."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled, recurse=False)
