"""Bytes a rank holds for parameters, gradients and optimizer state (local shards only)."""

from __future__ import annotations

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part: a DTensor's local shard (FSDP2), a ZeRO-3 parameter's partition, or the tensor itself."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = _local(t)
            total += local.numel() * local.element_size()
    return total


def rank_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "total"}`` in bytes held by this rank."""
    params = list(model.parameters())
    out = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        out["optimizer"] = tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                                        if isinstance(v, torch.Tensor) and v.dim() > 0)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def unsharded_param_bytes(model: nn.Module) -> int:
    """Bytes of the whole model's parameters (DTensor global shapes, ZeRO-3 ``ds_numel``), gathering nothing."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
