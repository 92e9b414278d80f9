"""Tensor parallelism (Megatron-style head/MLP split) written as plans: dicts from a block's module path to a
``torch.distributed.tensor.parallel`` style, applied to every block of the model.

The plans, head-count checks and fused-weight reorderings are the model families' (:mod:`disttrain.parallel.families`:
the HF Llama family, GPT-2, BERT-style encoders, timm's VisionTransformer and DeiT); any other HF model whose config
declares its own plan (``base_model_tp_plan``) is sharded by transformers' own styles
(:mod:`~disttrain.parallel.families.hf_plans`); a user can pass their own plan (paths
relative to one repeated block: it applies to the blocks that contain them). Embeddings, norms and the output head
stay replicated over the tensor-parallel group (FSDP shards them over the data-parallel one). Encoder-decoder models
(T5, BART) are refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from disttrain.parallel.families import Family, Plan, Reorder, find_model, unsupported_reason
from disttrain.parallel.families.layout import QKVRowsLayout, restore_rows
from disttrain.parallel.split.blocks import BlockSpec, find_blocks


@dataclass
class TPResult:
    """What :func:`apply_tp` changed beyond sharding: fused weights whose slices were reordered (path -> order),
    needed to give checkpoints and exports the model's own layout back. ``weight_dims``: the weight dimension an
    order applies to where it is not 0 (HF Conv1D stores its output features on dim 1); biases are always
    reordered on dim 0."""

    reordered: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_dims: dict[str, int] = field(default_factory=dict)
    # Parameters (full name -> rows) checkpointed whole: strided shards, which DCP cannot write as chunks.
    whole: dict[str, int] = field(default_factory=dict)

    def record_strided(self, model: nn.Module) -> None:
        """Note the parameters of ``model`` whose DTensor placements are strided shards (``_StridedShard``)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import _StridedShard

        for name, param in model.named_parameters():
            if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) for p in param.placements):
                self.whole[name] = param.shape[0]

    def record(self, block_path: str, reorders: dict[str, Reorder]) -> None:
        for path, reorder in reorders.items():
            self.reordered[f"{block_path}.{path}"] = reorder.order
            if reorder.weight_dim:
                self.weight_dims[f"{block_path}.{path}"] = reorder.weight_dim

    def restore(self, state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
        """``state`` (a full state dict whose keys carry ``prefix``) in the model's own layout."""
        return restore_rows(state, self.reordered, prefix=prefix, weight_dims=self.weight_dims)

    def storage_layout(self, prefixes: Iterable[str] = ("",)) -> QKVRowsLayout:
        """The checkpoint layout that saves the reordered weights in the model's own order (keys under any of
        ``prefixes``)."""
        return QKVRowsLayout(self.reordered, prefixes=tuple(prefixes), weight_dims=self.weight_dims, whole=self.whole)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan | None = None,
             wrap_classes: BlockSpec = None, ep: int = 1) -> TPResult:
    """Shard every block of ``model`` over ``tp_mesh`` with ``plan`` (paths relative to one repeated block; it is
    applied to the blocks that contain them). Without a plan, the plan of the model's family is used; anything
    else needs a plan. Encoder-decoder models are refused. ``ep``: the expert-parallel size (experts split over it
    are left out of the tensor-parallel plan)."""
    tp = tp_mesh.size()
    result = TPResult()
    found = find_model(model)
    if found is None and (reason := unsupported_reason(model)):
        raise ValueError(f"tensor parallelism: {reason}")
    family: Family | None = found[2] if found else None
    if plan is None and family is not None and hasattr(family, "apply_tp"):  # the model's own declared plan
        if any(_lora_layer(m) for m in model.modules()):
            raise ValueError(f"LoRA under tensor parallelism needs one of disttrain's own plans (Llama-family"
                             f" models, GPT-2, BERT-style encoders, timm ViT); {type(found[1]).__name__} is split by"
                             " its config's declared plan, which has no adapter split: train it with disttrain_fsdp"
                             " or disttrain_zero3")
        family.check_tp(found[1], tp, None)
        family.apply_tp(found[1], tp_mesh, ep=ep)
        result.record_strided(model)
        return result
    if plan is None:
        if family is None:
            raise ValueError(f"no tensor-parallel plan for {type(model).__name__}: disttrain applies the plan an HF"
                             " model's config declares (base_model_tp_plan) and its own for GPT-2, BERT-style encoders"
                             " and timm's VisionTransformer; pass tp_plan={'block.path': ColwiseParallel(), ...} with"
                             " paths relative to one repeated block")
        plan = family.tp_plan(found[1])
    if family is not None:
        family.check_tp(found[1], tp, plan)
    prefix = {id(m): n for n, m in model.named_modules()}
    for block in plan_blocks(model, plan, wrap_classes):
        block_plan = plan
        if family is not None:
            block_plan = family.adapt_plan(block, plan)
            reorders = family.prepare_block(block, tp, block_plan)
            result.record(prefix[id(block)], reorders)
            refuse_reordered_adapters(block, reorders)
        parallelize_module(block, tp_mesh, with_adapters(block, block_plan))
    return result


def _lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def with_adapters(block: nn.Module, plan: Plan) -> Plan:
    """The plan for a block whose layers carry LoRA adapters (peft, :mod:`disttrain.parallel.split.lora`): the layer's
    style goes to its own weight (``base_layer``) and to the adapter on the same side of the split, as Megatron
    splits LoRA: a column-parallel layer's B is split by output columns like the layer (A, on the replicated input,
    stays whole), a row-parallel layer's A by input rows like the layer, its all-reduce giving B (whole) the full
    input. Every adapter ends in the layout the layer's output has, so the two add up."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    adapted: dict = {}
    for path, style in plan.items():
        layer = block.get_submodule(path)
        if not _lora_layer(layer):
            adapted[path] = style
            continue
        adapted[f"{path}.base_layer"] = style
        for adapter in layer.lora_A:
            if isinstance(style, ColwiseParallel):
                adapted[f"{path}.lora_B.{adapter}"] = copy.deepcopy(style)
            elif isinstance(style, RowwiseParallel):
                adapted[f"{path}.lora_A.{adapter}"] = copy.deepcopy(style)
            else:
                raise ValueError(f"LoRA on {path} under tensor parallelism: its style {type(style).__name__} has no"
                                 " adapter split; leave the layer out of lora target_modules")
    return adapted


def refuse_reordered_adapters(block: nn.Module, reorders: dict[str, Reorder]) -> None:
    """A fused weight whose rows tensor parallelism reorders (GPT-2's c_attn, Phi-3's qkv_proj) would need its
    adapter's rows reordered alike: refused with the fix."""
    fused = sorted(path for path in reorders if _lora_layer(block.get_submodule(path)))
    if fused:
        raise ValueError(f"LoRA on the fused layer(s) {fused} under tensor parallelism is not supported (their rows"
                         " are reordered for the split); leave them out of lora target_modules, or train with"
                         " disttrain_fsdp / disttrain_zero3")


def plan_blocks(model: nn.Module, plan: Plan, wrap_classes: BlockSpec = None) -> list[nn.Module]:
    """The blocks a plan applies to: of the blocks found (``find_blocks``), those in which every path of the plan
    exists (an HF encoder's blocks include its embeddings, where a layer's paths do not exist)."""
    blocks = find_blocks(model, wrap_classes)
    chosen = [b for b in blocks if all(_has(b, path) for path in plan)]
    if not chosen:
        by_class: dict[str, nn.Module] = {}
        for block in blocks:
            by_class.setdefault(type(block).__name__, block)
        examples = "; ".join(f"{name}: {[n for n, _ in block.named_modules() if n][:6]}"
                             for name, block in by_class.items())
        raise ValueError(f"tp_plan paths {sorted(plan)} do not all exist in any block of {type(model).__name__};"
                         f" paths are relative to one repeated block ({examples or 'no blocks found'})")
    return chosen


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False
