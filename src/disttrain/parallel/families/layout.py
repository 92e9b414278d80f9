"""Fused weights under tensor parallelism: a fused ``[q | k | v]`` projection is split by heads only after its
slices are reordered rank-major (:func:`qkv_rank_major`); exports and checkpoints give the library's own order back
(:func:`restore_rows`, :class:`QKVRowsLayout`). A family's ``prepare_block`` does the reordering and returns a
:class:`Reorder` per weight; everything here is the same for every family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from disttrain.parallel.checkpoint import io as ckpt


@dataclass(frozen=True)
class Reorder:
    """A fused weight whose slices were permuted for tensor parallelism: ``order`` applies along ``weight_dim`` of
    the weight (and along dim 0 of the bias); ``argsort(order)`` gives the library's own layout back."""

    order: torch.Tensor
    weight_dim: int = 0


def qkv_rank_major(dim: int, tp: int) -> torch.Tensor:
    """Row order for a fused [q | k | v] weight of ``3 * dim`` rows such that chunk r of ``tp`` equal chunks holds
    [q_r | k_r | v_r], rank r's heads of each. Its inverse restores the library's layout (``argsort``)."""
    part = dim // tp
    return torch.cat([torch.arange(p * dim + r * part, p * dim + (r + 1) * part)
                      for r in range(tp) for p in range(3)])


def restore_rows(state: dict[str, torch.Tensor], reordered: dict[str, torch.Tensor],
                 prefix: str = "", weight_dims: Optional[dict[str, int]] = None) -> dict[str, torch.Tensor]:
    """Undo :func:`qkv_rank_major` in a full state dict, so exports have the model's own layout. ``weight_dims``
    names weights reordered along another dimension than 0 (HF Conv1D stores its output features on dim 1)."""
    for path, order in reordered.items():
        inverse = torch.argsort(order)
        for suffix in ("weight", "bias"):
            key = f"{prefix}{path}.{suffix}"
            if key in state:
                dim = (weight_dims or {}).get(path, 0) if suffix == "weight" else 0
                state[key] = state[key].index_select(dim, inverse)
    return state


class QKVRowsLayout(ckpt.StorageLayout):
    """Checkpoints keep the library's [q | k | v] order of a fused qkv weight (timm's ``attn.qkv`` rows, GPT-2's
    ``attn.c_attn`` columns) whatever the tensor-parallel size, so a model saved at tp=2 loads under FSDP, DDP or
    another tp. Under TP the slices live rank-major (``qkv_rank_major``); these few tensors (weights, biases and
    their optimizer moments) are gathered, put back in the library's order and saved whole, and on load read
    whole, reordered and sharded again. Every other tensor stays sharded.

    ``whole`` names parameters (full names, with their rows) saved whole in their own order: strided shards (a fused
    ``gate_up_proj`` of MoE experts split by transformers' ``packed_colwise``), which DCP cannot describe as chunks."""

    def __init__(self, reordered: dict[str, torch.Tensor], prefixes: Iterable[str] = ("",),
                 weight_dims: Optional[dict[str, int]] = None, whole: Optional[dict[str, int]] = None) -> None:
        dims = weight_dims or {}
        self.orders = {f"{prefix}{path}.{suffix}": (order, dims.get(path, 0) if suffix == "weight" else 0)
                       for path, order in reordered.items() for prefix in set(prefixes)
                       for suffix in ("weight", "bias")}
        self.orders.update({f"{prefix}{name}": (torch.arange(rows), 0) for name, rows in (whole or {}).items()
                            for prefix in set(prefixes)})
        self.placements: dict[tuple[str, str, str], Any] = {}

    def _entries(self, tensors: dict[str, Any]):
        """(where, key, holder) for every reordered tensor: model entries and optimizer moments alike."""
        for top, value in tensors.items():
            if not isinstance(value, dict):
                continue
            if "state" in value and isinstance(value["state"], dict):  # an optimizer state dict by FQN
                for fqn, moments in value["state"].items():
                    if fqn in self.orders:
                        for name, tensor in moments.items():
                            if torch.is_tensor(tensor) and tensor.dim() > 0:
                                yield (top, fqn, name), moments, name, self.orders[fqn]
            else:
                for key in value:
                    if key in self.orders:  # a model entry
                        yield (top, key, ""), value, key, self.orders[key]
                    elif key.startswith("state.") and key[6:].rsplit(".", 1)[0] in self.orders:  # a flat moment
                        tensor = value[key]
                        if torch.is_tensor(tensor) and tensor.dim() > 0:
                            yield (top, key, ""), value, key, self.orders[key[6:].rsplit(".", 1)[0]]

    def before_save(self, tensors: dict[str, Any]) -> None:
        for _, holder, name, (order, dim) in list(self._entries(tensors)):
            full = holder[name].full_tensor() if hasattr(holder[name], "full_tensor") else holder[name]
            holder[name] = full.detach().index_select(dim, torch.argsort(order)).cpu()  # replicated: written once

    def before_load(self, tensors: dict[str, Any]) -> None:
        for where, holder, name, _ in list(self._entries(tensors)):
            tensor = holder[name]
            if hasattr(tensor, "device_mesh"):
                self.placements[where] = (tensor.device_mesh, tensor.placements, tensor.device)
            holder[name] = torch.empty(tensor.shape, dtype=tensor.dtype)  # read whole (DCP reshards into it)

    def after_load(self, tensors: dict[str, Any]) -> None:
        from torch.distributed.tensor import distribute_tensor

        for where, holder, name, (order, dim) in list(self._entries(tensors)):
            rows = holder[name].index_select(dim, order)
            if where in self.placements:
                mesh, placements, device = self.placements[where]
                rows = distribute_tensor(rows.to(device), mesh, placements)
            holder[name] = rows
