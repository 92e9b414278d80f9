"""Module buffers under data parallelism (BatchNorm running statistics): kept equal across the data-parallel
ranks as DDP keeps them, and SyncBatchNorm where a user asks for it. Used by the FSDP, Megatron and ZeRO-3
adapters (torch only)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm

# torch's DistributedDataParallel refuses SyncBatchNorm on CPU with this line; Lightning's `ddp` passes it on.
SYNC_BATCHNORM_CPU_ERROR = "SyncBatchNorm layers only work with GPU modules"


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def broadcast_buffers(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Give every rank of ``group`` (default: all ranks) the buffers of the group's first rank, in place.

    This is what DDP does with ``broadcast_buffers=True`` (rank 0's BatchNorm statistics are the model's), so a
    sharded run keeps the statistics ``ddp`` keeps and every rank validates and checkpoints the same model.
    One broadcast per dtype and device. The copy goes through ``.data``: a buffer saved for backward (a mask, a
    rotary table) gets the values it already had on the other ranks and must not look modified to autograd.
    """
    if _group_size(group) < 2:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in module.buffers():
        local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
        if local.numel() and not local.is_meta:
            kinds.setdefault((local.dtype, local.device), []).append(local)
    for buffers in kinds.values():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            for buffer, part in zip(buffers, flat.split([b.numel() for b in buffers])):
                buffer.data.copy_(part.view_as(buffer))


def sync_buffers_after_forward(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> Any:
    """Broadcast ``module``'s buffers from the group's first rank after every forward that can change them
    (training mode or gradients enabled: a validation forward leaves them alone). Returns the hook handle."""

    def hook(mod: nn.Module, args: Any, output: Any) -> None:
        if mod.training or torch.is_grad_enabled():
            broadcast_buffers(module, group)

    return module.register_forward_hook(hook)


def has_sync_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())


def convert_sync_batchnorm(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """Every BatchNorm layer of ``module`` as SyncBatchNorm over ``group`` (default: all ranks): torch's own
    conversion, the one Lightning's ``sync_batchnorm=True`` applies; under tensor or pipeline parallelism pass the
    data-parallel group, whose ranks see different samples. A module converted before is returned as it is (its
    layers may already be hooked by an engine)."""
    if not has_plain_batchnorm(module):
        return module
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, group)


def has_plain_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm) for m in module.modules())


def refuse_sync_batchnorm_on_cpu(module: nn.Module, device: torch.device, strategy: str) -> None:
    """Fail at setup, as ``ddp`` does (torch's DistributedDataParallel), when SyncBatchNorm meets a CPU device:
    its forward needs a GPU (CUDA/XPU/HPU) and would fail at the first training step anyway."""
    if device.type == "cpu" and has_sync_batchnorm(module):
        raise ValueError(f"{SYNC_BATCHNORM_CPU_ERROR}: {strategy} on CPU cannot run SyncBatchNorm (nor can"
                         " Lightning's ddp); drop sync_batchnorm=True (or the SyncBatchNorm layers) for CPU runs:"
                         " the ranks keep rank 0's BatchNorm statistics, as under ddp")
