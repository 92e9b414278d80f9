"""Exact per-rank shard sizes from the model's parameter shapes, by the engines' own rules: FSDP2's dim-0 chunks
(:func:`disttrain.parallel.split.fsdp.shard_elements`), DeepSpeed's padded ZeRO-3 partition
(:func:`disttrain.parallel.engines.deepspeed.partition_elements`), and tensor parallelism splitting the plan's column-wise layers
on dim 0 and row-wise layers on dim 1. Dividing the parameter count by the world size misses the padding, which grows
with the world size (a ViT-2B qkv weight of 2688 rows holds 6, not 5.25, rows per rank at dp=512)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from disttrain.parallel.engines.deepspeed import partition_elements
from disttrain.parallel.families import family_named
from disttrain.parallel.split.fsdp import shard_elements
from disttrain.planner.spec import ModelSpec


def parameter_shapes(spec: ModelSpec) -> Optional[list[tuple[str, torch.Size]]]:
    """(name, shape) of every parameter of a model built from a config (on the meta device, once per spec)."""
    if "shapes" not in spec.extra:
        family, config = family_named(spec.family), spec.extra.get("config")
        shapes = None
        if family is not None and config is not None:
            try:
                model = family.meta_model(config)
            except (ValueError, ImportError):
                model = None
            if model is not None:
                shapes = [(name, p.shape) for name, p in model.named_parameters()]
        spec.extra["shapes"] = shapes
    return spec.extra["shapes"]


def low_rank_elements(spec: ModelSpec, rank: int) -> Optional[int]:
    """Elements a PowerSGD all-reduce of the whole model's gradients sends at ``rank`` (torch's hook): each matrix
    (dim 0 by the rest) as its two factors, (m + n) x rank, where that is fewer than m x n; vectors and matrices
    the factors would not shrink whole. None without the model's shapes."""
    shapes = parameter_shapes(spec)
    if shapes is None:
        return None
    total = 0
    for _, shape in shapes:
        numel = math.prod(shape)
        m = shape[0] if len(shape) > 1 else 0
        n = numel // m if m else 0
        total += (m + n) * rank if m and (m + n) * rank < numel else numel
    return total


def tp_local_shape(name: str, shape: torch.Size, plan: dict, tp: int) -> torch.Size:
    """The shape of ``name`` on one tensor-parallel rank under ``plan`` (module paths relative to a block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    module, _, leaf = name.rpartition(".")
    for path, style in plan.items():
        if module == path or module.endswith("." + path):
            if isinstance(style, ColwiseParallel):
                return torch.Size((shape[0] // tp, *shape[1:]))
            if isinstance(style, RowwiseParallel) and leaf == "weight" and len(shape) > 1:
                return torch.Size((shape[0], shape[1] // tp, *shape[2:]))
    return shape


def fsdp_rank_elements(spec: ModelSpec, n: int, tp: int = 1, rank: int = 0) -> Optional[int]:
    """Elements FSDP2 leaves on ``rank`` of ``n`` shard ranks (rank 0: the busiest) of a tensor-parallel rank, or
    None when the shapes are unknown."""
    shapes = parameter_shapes(spec)
    if shapes is None:
        return None
    plan = family_named(spec.family).tp_plan() if tp > 1 else {}
    local = [tp_local_shape(name, shape, plan, tp) if tp > 1 else shape for name, shape in shapes]
    return shard_elements(local, rank, n)


def zero3_partition(spec: ModelSpec, world_size: int) -> Optional[int]:
    """Elements of DeepSpeed ZeRO-3's partition on every rank, or None when the shapes are unknown."""
    shapes = parameter_shapes(spec)
    if shapes is None:
        return None
    return partition_elements((math.prod(shape) for _, shape in shapes), world_size)
