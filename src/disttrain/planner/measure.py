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
    from the DeepSpeed optimizer's flat partition lists. ZeRO-1/2: :func:`zero12_state_bytes` (with ``host`` and
    ``buffers``)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric/Lightning wrappers
    if hasattr(inner, "single_partition_of_fp32_groups"):
        return zero12_state_bytes(inner)
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


def zero12_state_bytes(zero: Any) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "host", "buffers", "total"}`` bytes DeepSpeed's ZeRO stage 1/2 optimizer
    (``zero``) holds on this rank now, each storage counted once, whole (a view of a flat buffer counts the buffer).

    params: the flat buffer the model's parameters are views of. grads: the gradients on the compute device: the
    parameters' ``.grad`` (whole, between micro-steps under stage 1), the reduced partition DeepSpeed keeps for the
    step (``averaged_gradients``, ``all_grad_tensors``, ``grads_in_partition``) and the fp32 partitions' ``.grad``.
    optimizer: the fp32 master partitions and the optimizer state. host: under ``offload_optimizer``, what
    DeepSpeed allocates on its offload device: the master partitions, their ``.grad``, the optimizer state, the
    gradients accumulated between micro-steps (``accumulated_grads_in_cpu``), the 16-bit copy of the updated
    partition and a one-parameter gradient staging buffer. They are told apart by that role, not by their device, so
    that the split holds on a machine whose compute device is the CPU too. buffers: on the compute device, the
    reduce bucket and (offload) a one-parameter gradient staging buffer. Gradients and their buckets come and go
    within a step: measure after each backward and after the step and take each key's largest value for the
    peak."""
    seen: set[int] = set()

    def held(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    def flat(value: Any) -> list:
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in flat(v)]
        return []

    master = list(zero.single_partition_of_fp32_groups)
    states = [v for state in zero.optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    optimizer = held(master) + held(states)
    offloaded = [m.grad for m in master] + flat(getattr(zero, "accumulated_grads_in_cpu", {}))
    staging = flat([getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", None),
                    getattr(zero, "temp_grad_buffer_for_cpu_offload", None)])
    host = optimizer + held(offloaded) + held(staging) if zero.cpu_offload else 0
    params = held(zero.bit16_groups_flat)
    buckets = [t for bucket in getattr(zero, "ipg_buckets", {}).values() for t in flat(getattr(bucket, "buffer", []))]
    buffers = held(buckets + flat([getattr(zero, "temp_grad_buffer_for_gpu_offload", None)]))
    grads = held([p.grad for group in zero.bit16_groups for p in group] + offloaded
                 + flat([getattr(zero, name, None) for name in ("all_grad_tensors", "averaged_gradients",
                                                                "grads_in_partition")]))
    device = {"params": params, "grads": grads, "optimizer": 0 if zero.cpu_offload else optimizer}
    return {**device, "host": host, "buffers": buffers, "total": sum(device.values()) + host}


def _zero_optimizer(opt: Any) -> Any:
    for _ in range(4):
        if opt is None:
            return None
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None

