"""Measuring what the estimate predicts, on any device (CPU included): model-state bytes of this rank and the
bytes the forward pass saves for backward.

Why saved tensors: on CPU torch keeps no peak-memory statistic and the resident set size mixes in allocator caches
and libraries. What a forward adds to the peak is what autograd keeps for backward, so a ``saved_tensors_hooks``
pair sees exactly those tensors; counting unique storages once, at the end of the forward, gives the activation
memory without double-counting views, and skips storages FSDP/ZeRO-3 have already freed (resharded parameters
have zero bytes by then) and the parameters themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disttrain.parallel.engines.memory import rank_state_bytes, tensor_bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    t = getattr(t, "ds_tensor", t)
    return t.to_local() if hasattr(t, "to_local") else t


class SavedActivations:
    """``with SavedActivations(model) as saved: loss = model(x)`` then ``saved.bytes()``: bytes of the unique
    storages autograd saved for backward during the block, parameters excluded."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self._saved: list[torch.Tensor] = []
        self._hooks: Any = None

    def __enter__(self) -> SavedActivations:
        self._saved = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._final = self._count()
        self._saved = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._saved.append(t)
        return t

    def _count(self) -> int:
        exclude = set()
        if self.model is not None:
            for p in self.model.parameters():
                exclude.add(_local(p).untyped_storage().data_ptr())
                exclude.add(p.untyped_storage().data_ptr() if not hasattr(p, "to_local") else 0)
        sizes: dict[int, int] = {}
        for t in self._saved:
            t = t.to_local() if hasattr(t, "to_local") else t
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in exclude:
                continue
            sizes[ptr] = storage.nbytes()
        return sum(sizes.values())

    def bytes(self) -> int:
        return self._final


def state_bytes(model: nn.Module, optimizer: Any = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "total"}`` bytes this rank holds, for DDP, FSDP2 and ZeRO-3 alike. Call it
    after ``optimizer.step()`` and before ``zero_grad()`` (gradients and optimizer state both alive).

    ZeRO-3 keeps its gradients and fp32 master partitions inside its optimizer, not on ``p.grad``: they are read
    from the DeepSpeed optimizer's flat partition lists."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric/Lightning wrappers
    zero = _zero_optimizer(inner)
    if zero is None:
        return rank_state_bytes(model, inner)
    out = rank_state_bytes(model, None)
    master = list(getattr(zero, "fp32_partitioned_groups_flat", []))
    # One flat buffer holds this rank's gradient partitions (the fp32 master's .grad is only set during step()).
    out["grads"] += tensor_bytes([getattr(zero, "grad_partitions_flat_buffer", None)])
    base = getattr(zero, "optimizer", None)
    states = tensor_bytes(v for s in getattr(base, "state", {}).values() for v in s.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
    out["optimizer"] = states + tensor_bytes(master)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _zero_optimizer(opt: Any) -> Any:
    for _ in range(4):
        if opt is None:
            return None
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None

