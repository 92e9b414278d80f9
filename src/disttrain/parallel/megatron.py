"""The shared core of ``disttrain_megatron``: tensor x pipeline x data parallelism on one 3D DeviceMesh.

Order of application (torchtitan's): pipeline split -> tensor parallel -> activation checkpointing -> FSDP2 over
the data-parallel dimension. The Trainer and Fabric ``MegatronStrategy`` adapters only call this engine.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from disttrain.parallel import checkpoint as ckpt
from disttrain.parallel.ac import apply_ac
from disttrain.parallel.blocks import find_blocks
from disttrain.parallel.engine import FSDPEngine
from disttrain.parallel.fsdp import FSDPOptions, apply_fsdp, claim_root, offload_policy
from disttrain.parallel.init import materialize
from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.pipeline import Pipeline, pipeline_model
from disttrain.parallel.precision import mixed_precision_policy
from disttrain.parallel.tp import Plan, TPResult, apply_tp, find_model, model_family, restore_rows


@dataclass
class MegatronOptions(FSDPOptions):
    """What a user can set on ``disttrain_megatron`` (besides the FSDP options, which apply to the data dimension).

    tensor_parallel_size: ranks that split each block's heads and MLP (Megatron TP); must divide the head counts.
    pipeline_parallel_size: pipeline stages over ranks; each rank keeps only its stages' parameters.
    tp_plan: your own plan, ``{"path.in.block": ColwiseParallel(), ...}`` relative to one block; default: the plan
        of the model's family (HF Llama family, GPT-2, BERT-style encoders, timm ViT).
    pipeline_schedule: "gpipe", "1f1b" or "interleaved_1f1b" (virtual stages: ``virtual_stages`` per rank, >= 2).
    virtual_stages: stages per rank under "interleaved_1f1b" (1 means 2, the least it needs); other schedules: 1.
    microbatches: microbatches per batch under PP (default ``2 * pipeline_parallel_size``); divides the batch.
    split_points: block indices where stages 1, 2, ... start; default: balanced by parameter count.
    pipeline_module: attribute of the LightningModule holding the model to split/shard (default ``"model"``;
        found automatically when the attribute does not exist).
    Data parallel is what is left: ``world_size / (tensor_parallel_size * pipeline_parallel_size)``.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tp_plan: Optional[Plan] = None
    pipeline_schedule: str = "1f1b"
    microbatches: Optional[int] = None
    virtual_stages: int = 1
    split_points: Optional[Sequence[int]] = None
    pipeline_module: str = "model"


class MegatronEngine(FSDPEngine):
    """Holds the 3D mesh; splits, tensor-parallelises and shards a model; checkpoints and exports it."""

    options: MegatronOptions

    def __init__(self, options: MegatronOptions) -> None:
        super().__init__(options)
        self.pipeline: Optional[Pipeline] = None
        self.tp_result = TPResult()
        self._target_prefix = ""

    def setup_mesh(self, world_size: int, device: torch.device, local_size: int | None = None) -> DeviceMesh:
        if self.options.hybrid_shard:
            raise ValueError("hybrid_shard=True is a disttrain_fsdp option; under disttrain_megatron the data-parallel"
                             " dimension is fully sharded: remove hybrid_shard or use strategy='disttrain_fsdp'")
        self.dims = ParallelDims(world_size=world_size, tp=self.options.tensor_parallel_size,
                                 pp=self.options.pipeline_parallel_size)
        self.mesh = self.dims.build_mesh(device.type)
        return self.mesh

    def pipeline_group(self) -> torch.distributed.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.pipeline is not None and self.mesh is not None else None

    def is_parallelized(self, module: nn.Module) -> bool:
        return bool(getattr(module, "_disttrain_megatron", False))

    def _target(self, module: nn.Module) -> tuple[str, nn.Module]:
        """The model to split and shard: the module itself when it is a known model (HF Llama family / timm ViT),
        else the LightningModule's ``pipeline_module`` attribute, else the outermost known model inside."""
        if model_family(module) is not None:  # Fabric: the model itself
            return "", module
        attr = self.options.pipeline_module
        inner = getattr(module, attr, None)
        if isinstance(inner, nn.Module) and inner is not module:
            return f"{attr}.", inner
        found = find_model(module)
        if found is not None and found[0]:
            return f"{found[0]}.", found[1]
        return "", module

    def parallelize(self, module: nn.Module, device: torch.device, precision: str,
                    forward_methods: tuple[str, ...] = ()) -> nn.Module:
        assert self.mesh is not None and self.dims is not None, "setup_mesh() first"
        if self.is_parallelized(module):  # set up before (a Trainer re-setup): only materialise
            materialize(module, device)
            return module
        module._disttrain_megatron = True
        for transform in self.module_transforms:
            transform(module)
        prefix, target = self._target(module)
        self._target_prefix = prefix
        opts, dims = self.options, self.dims
        if dims.pp > 1:
            self.pipeline = pipeline_model(
                target, self.mesh["pp"], device, schedule=opts.pipeline_schedule, microbatches=opts.microbatches,
                virtual_stages=opts.virtual_stages, split_points=opts.split_points)
            self.pipeline.dp_group = self.mesh["dp"].get_group()
            hook = getattr(module, "loss_fn", None)
            if module is not target and callable(hook) and not self.pipeline.owns_loss:
                module.loss_fn = self.pipeline.defer_loss(hook)  # the documented PP hook of a LightningModule
        if dims.tp > 1:
            self.tp_result = apply_tp(target, self.mesh["tp"], opts.tp_plan, opts.wrap_classes)
        if dims.pp > 1:
            self._shard_stages(device, precision)
        else:
            apply_fsdp(module, self.mesh["dp"], opts, precision, device)
            for name in forward_methods:
                if callable(getattr(module, name, None)):
                    register_fsdp_forward_method(module, name)
        materialize(module, device)
        if dims.pp == 1:  # under PP each stage module is a root of its own, called by the schedule
            claim_root(module)
        return module

    def full_model(self, model: nn.Module) -> AbstractContextManager[nn.Module]:
        """As :meth:`FSDPEngine.full_model` when only the data dimension is sharded. Tensor-parallel layers compute
        collectively whatever their parameters hold, and other pipeline stages' layers are not on this rank, so
        there is no whole model to gather in place: export it instead."""
        assert self.dims is not None
        if self.dims.tp > 1 or self.dims.pp > 1:
            raise RuntimeError(
                f"full_model() needs tensor_parallel_size=1 and pipeline_parallel_size=1 (got {self.dims.tp} and"
                f" {self.dims.pp}): write the full model with strategy.export_full(path) and load that file into the"
                " plain model")
        return super().full_model(model)

    def _shard_stages(self, device: torch.device, precision: str) -> None:
        """FSDP2 per block, then each stage module as its root (torchtitan's layout for PP x FSDP): the schedule
        calls the stage modules, so FSDP's root hooks run around every microbatch."""
        assert self.pipeline is not None and self.mesh is not None
        opts = self.options
        common = dict(mesh=self.mesh["dp"], offload_policy=offload_policy(opts.cpu_offload, device))
        block_policy = mixed_precision_policy(precision)
        root_policy = mixed_precision_policy(precision, root=True)
        for stage in self.pipeline.stage_modules:
            blocks = list((stage.layers if hasattr(stage, "layers") else stage.blocks).values())
            if opts.activation_checkpointing:
                blocks = apply_ac(stage, blocks)
            for block in blocks:
                fully_shard(block, reshard_after_forward=opts.reshard_after_forward, **common,
                            **({"mp_policy": block_policy} if block_policy else {}))
            fully_shard(stage, reshard_after_forward=opts.reshard_after_forward, **common,
                        **({"mp_policy": root_policy} if root_policy else {}))

    # -- checkpoints and export -----------------------------------------------------------------------------
    def storage_layout(self) -> ckpt.StorageLayout:
        return QKVRowsLayout(self.tp_result.reordered, prefixes=("", self._target_prefix),
                             weight_dims=self.tp_result.weight_dims)

    def export(self, model: nn.Module, path: str | os.PathLike, prefix: str = "") -> Path:
        """The full model in its own layout (qkv rows restored) as one safetensors file on rank 0, gathered from
        every pipeline stage. Collective: call on every rank."""
        state = ckpt.model_state(model, full=True) if self.pipeline is None else self._gather_stages(model)
        if _rank() == 0:
            restore_rows(state, self.tp_result.reordered, prefix=self._target_prefix_for(model),
                         weight_dims=self.tp_result.weight_dims)
        return ckpt.write_from_rank0(state, path, prefix)

    def _target_prefix_for(self, model: nn.Module) -> str:
        # Fabric exports the plain model (the target itself); the Trainer exports the LightningModule.
        _, target = self._target(model)
        return "" if target is model else self._target_prefix

    def _gather_stages(self, model: nn.Module) -> dict[str, Any]:
        """Each pipeline stage's full tensors (gathered over dp/tp in its own groups), then collected on rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.mesh is not None
        local = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        local = {k: v.detach().cpu() for k, v in local.items()}
        pp_group = self.mesh["pp"].get_group()
        first_of_rest = all(self.mesh[d].get_local_rank() == 0 for d in self.mesh.mesh_dim_names if d != "pp")
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        if first_of_rest:  # one copy per stage: the ranks at dp = tp = 0 take part
            dist.gather_object(local, parts if _rank() == 0 else None, dst=dist.get_global_rank(pp_group, 0),
                               group=pp_group)
        dist.barrier()
        merged: dict[str, Any] = {}
        for part in parts if _rank() == 0 else []:
            merged.update(part or {})
        return merged


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


__all__ = ["MegatronEngine", "MegatronOptions"]


class QKVRowsLayout(ckpt.StorageLayout):
    """Checkpoints keep the library's [q | k | v] order of a fused qkv weight (timm's ``attn.qkv`` rows, GPT-2's
    ``attn.c_attn`` columns) whatever the tensor-parallel size, so a model saved at tp=2 loads under FSDP, DDP or
    another tp. Under TP the slices live rank-major (``qkv_rank_major``); these few tensors (weights, biases and
    their optimizer moments) are gathered, put back in the library's order and saved whole, and on load read
    whole, reordered and sharded again. Every other tensor stays sharded."""

    def __init__(self, reordered: dict[str, torch.Tensor], prefixes: tuple[str, ...] = ("",),
                 weight_dims: dict[str, int] | None = None) -> None:
        dims = weight_dims or {}
        self.orders = {f"{prefix}{path}.{suffix}": (order, dims.get(path, 0) if suffix == "weight" else 0)
                       for path, order in reordered.items() for prefix in set(prefixes)
                       for suffix in ("weight", "bias")}
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
