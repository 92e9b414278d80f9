"""The shared core of ``disttrain_megatron``: tensor x pipeline x context x data parallelism on one DeviceMesh.

Order of application (torchtitan's): pipeline split or context parallelism -> tensor parallel -> activation
checkpointing -> FSDP2 over the data-parallel (and context-parallel) ranks. The Trainer and Fabric
``MegatronStrategy`` adapters only call this engine.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.engines.base import refuse_user_sharding
from disttrain.parallel.engines.clip import clip_grad_norm_
from disttrain.parallel.engines.fsdp import FSDPEngine, register_forward_methods
from disttrain.parallel.engines.init import from_first_rank
from disttrain.parallel.engines.layout import Accumulation, Layout, Units
from disttrain.parallel.families import family_of, find_model
from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.split.fsdp import FSDPOptions, apply_fsdp, claim_root, shard_blocks, shard_root
from disttrain.parallel.split.pipeline import SPLIT_BACKWARD, Pipeline, check_schedule, pipeline_model
from disttrain.parallel.split.tp import Plan, TPResult, apply_tp


@dataclass
class MegatronOptions(FSDPOptions):
    """What a user can set on ``disttrain_megatron`` (besides the FSDP options, which apply to the data dimension).

    tensor_parallel_size: ranks that split each block's heads and MLP (Megatron TP); must divide the head counts.
    pipeline_parallel_size: pipeline stages over ranks; each rank keeps only its stages' parameters.
    tp_plan: your own plan, ``{"path.in.block": ColwiseParallel(), ...}`` relative to one block; default: the plan of
        the model's family (HF Llama family, GPT-2, BERT-style encoders, timm ViT and DeiT) or the one an HF model's
        config declares (``base_model_tp_plan``: Phi-3, Gemma-2, GPT-NeoX, the MoE families and most HF decoders).
    pipeline_schedule: "gpipe", "1f1b", "interleaved_1f1b" or "interleaved_zero_bubble" (``virtual_stages`` stages per
        rank, >= 2), "zbv" or "dualpipev" (two stages per rank in a V: rank 0 runs the first and the last stage).
        The zero-bubble schedules ("interleaved_zero_bubble", "zbv", "dualpipev") fill the bubble with the weight
        gradients' half of the backward.
    virtual_stages: stages per rank under "interleaved_1f1b"/"interleaved_zero_bubble" (1 means 2, the least they
        need); 2 under "zbv"/"dualpipev"; other schedules: 1.
    microbatches: microbatches per batch under PP (default ``2 * pipeline_parallel_size``); divides the batch.
    split_points: block indices where stages 1, 2, ... start; default: balanced by cost (forward FLOPs measured on
        the meta device, the embeddings, LM head and loss counted with the first and last stage).
    pipeline_module: attribute of the LightningModule holding the model to split/shard (default ``"model"``;
        found automatically when the attribute does not exist).
    context_parallel_size: ranks that split each sequence (context parallelism, long dialogues) of an HF Llama-family
        causal LM (Llama, Qwen2/3, Mistral), attention exact; they read the same samples and share FSDP's shards.
        The sequence length must divide by it. Not with pipeline parallelism.
    context_parallel_attention: "all_to_all" (Ulysses: heads exchanged for sequence around the model's own kernel;
        any device, packed rows, sliding windows) or "ring" (torch's ring attention: CUDA SDPA, causal, unpacked).
    expert_parallel_size: ranks that split the experts of an MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, any HF model
        whose config declares ``base_model_ep_plan``): each keeps ``experts / expert_parallel_size`` whole experts,
        and every token is sent to its experts' ranks and back with all-to-all (dropless). Taken from the
        data-parallel ranks (it must divide them), so it adds no ranks; FSDP shards the other weights over all
        data-parallel ranks and each expert over the ranks that hold it. With tensor parallelism the experts are
        whole on every tensor-parallel rank (attention is split). Not with pipeline or context parallelism.
    Data parallel is what is left: ``world_size / (tensor_parallel_size * pipeline_parallel_size *
    context_parallel_size)``.
    """

    # The options that set a degree of ParallelDims, by dimension: what parallel_dims reads, what the CLI's degree
    # flags (--tp, --pp) set.
    degrees: ClassVar[dict[str, str]] = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size",
                                         "cp": "context_parallel_size", "ep": "expert_parallel_size"}

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tp_plan: Optional[Plan] = None
    pipeline_schedule: str = "1f1b"
    microbatches: Optional[int] = None
    virtual_stages: int = 1
    split_points: Optional[Sequence[int]] = None
    pipeline_module: str = "model"
    context_parallel_size: int = 1
    context_parallel_attention: str = "all_to_all"
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.gradient_compression is not None:
            raise ValueError(f"gradient_compression={self.gradient_compression!r} is not offered by"
                             " disttrain_megatron (its tensor- and pipeline-parallel traffic is activations); use"
                             " disttrain_fsdp or disttrain_ddp, or remove gradient_compression")
        super().__post_init__()
        # Every option a user sets is read or refused: these are read only by the dimension they belong to.
        unused = []
        if self.pipeline_parallel_size == 1:
            unused += [(name, "pipeline_parallel_size > 1") for name, default in (
                ("pipeline_schedule", "1f1b"), ("microbatches", None), ("virtual_stages", 1), ("split_points", None))
                if getattr(self, name) != default]
        if self.expert_parallel_size > 1 and self.tp_plan is not None:
            unused.append(("tp_plan", "expert_parallel_size=1 (experts follow the model's own plans)"))
        if self.tensor_parallel_size == 1 and self.tp_plan is not None:
            unused.append(("tp_plan", "tensor_parallel_size > 1"))
        if self.context_parallel_size == 1 and self.context_parallel_attention != "all_to_all":
            unused.append(("context_parallel_attention", "context_parallel_size > 1"))
        if self.compile and (self.context_parallel_size > 1 or self.expert_parallel_size > 1):
            raise ValueError(f"compile=True with context_parallel_size={self.context_parallel_size} and"
                             f" expert_parallel_size={self.expert_parallel_size} is not supported: their all-to-all"
                             " exchanges run in hooks inside the blocks (the experts' with data-dependent sizes),"
                             " which compiled blocks would have to trace; compile with tensor, pipeline and data"
                             " parallelism only, or set compile=False")
        for name, needs in unused:
            raise ValueError(f"{name}={getattr(self, name)!r} applies with {needs}; set it, or remove {name}")
        if self.pipeline_parallel_size > 1:  # refused when the strategy is made, not at set-up
            check_schedule(self.pipeline_schedule, self.pipeline_parallel_size, self.virtual_stages, self.microbatches)


class MegatronEngine(FSDPEngine):
    """Holds the 3D mesh; splits, tensor-parallelises and shards a model; checkpoints and exports it."""

    options_cls = MegatronOptions
    options: MegatronOptions

    def __init__(self, options: MegatronOptions, name: str = "disttrain_megatron") -> None:
        super().__init__(options, name)
        self.pipeline: Optional[Pipeline] = None
        self.tp_result = TPResult()
        self._target_prefix = ""

    @classmethod
    def layout(cls, options: MegatronOptions) -> Layout:
        """FSDP's layout on the data dimension (``dp_shard`` x ``cp``) of a model split by tensor parallelism (each
        block's heads and MLP), pipeline stages (each rank keeps its stages' layers) and expert parallelism (each
        rank keeps some experts whole): the degrees come from the options (``MegatronOptions.degrees``), which the
        planner searches. FSDP2 gathers a unit per block and one for the ends (the embeddings, head and root count
        as one), on every microbatch under a pipeline, whose schedule replaces gradient accumulation."""
        fsdp = super().layout(options)
        pipeline = options.pipeline_parallel_size > 1
        return replace(fsdp, split_by=("tp", "pp", "ep"), searched=tuple(options.degrees),
                       params=replace(fsdp.params, units=Units.BLOCKS),
                       can=replace(fsdp.can, accumulation=Accumulation.MICROBATCHES if pipeline
                                   else fsdp.can.accumulation))

    @classmethod
    def degree_options(cls, degrees: dict[str, int]) -> dict[str, Any]:
        """``{"tp": 2, "pp": 4}`` as ``{"tensor_parallel_size": 2, "pipeline_parallel_size": 4}``."""
        names = MegatronOptions.degrees
        unknown = set(degrees) - set(names)
        if unknown:
            raise ValueError(f"{cls.__name__} takes the degrees {', '.join(names)} as options, not {sorted(unknown)}"
                             " (data parallelism takes the ranks they leave)")
        return {names[dim]: size for dim, size in degrees.items()}

    @classmethod
    def parallel_dims(cls, options: MegatronOptions, world_size: int,
                      local_size: int | None = None) -> ParallelDims:
        """Tensor x pipeline parallel as the options ask; the data dimension (FSDP) takes the remaining ranks."""
        if options.hybrid_shard or options.shard_size is not None:
            raise ValueError("hybrid_shard/shard_size are disttrain_fsdp options; under disttrain_megatron the"
                             " data-parallel dimension is fully sharded: remove them or use strategy='disttrain_fsdp'")
        dims = ParallelDims(world_size, **{dim: getattr(options, name) for dim, name in options.degrees.items()})
        if dims.ep > 1 and (dims.cp > 1 or dims.pp > 1):
            raise ValueError(f"expert_parallel_size={dims.ep} with context_parallel_size={dims.cp} and"
                             f" pipeline_parallel_size={dims.pp}: expert parallelism composes with data sharding and"
                             " tensor parallelism; use context_parallel_size=1 and pipeline_parallel_size=1")
        if dims.cp > 1 and dims.pp > 1:
            raise ValueError(f"context_parallel_size={dims.cp} with pipeline_parallel_size={dims.pp}: context"
                             " parallelism composes with tensor and data parallelism, not with pipeline stages; use"
                             " pipeline_parallel_size=1")
        return dims

    def reduce(self, tensor: Any, op: Any = "mean", group: torch.distributed.ProcessGroup | None = None) -> Any:
        """Logged values (``self.log(..., sync_dist=True)``, Fabric's ``all_reduce``) combine over the data-parallel
        ranks: the tensor-, pipeline- and context-parallel ranks of one replica see the same batch, so a sum over
        every process counted each sample tp x pp x cp times (a mean, max or min is the same either way). An
        explicit ``group`` is used as given (``torch.distributed.group.WORLD`` for every process)."""
        dims, meshes = self.dims, self.meshes
        if group is None and meshes is not None and dims is not None and dims.dp < dims.world_size:
            group = meshes.dp.get_group()
        return super().reduce(tensor, op, group)

    def pipeline_group(self) -> torch.distributed.ProcessGroup | None:
        return self.meshes.pp.get_group() if self.pipeline is not None and self.meshes is not None else None

    def check_accumulation(self, steps: int) -> None:
        if self.options.pipeline_parallel_size > 1 and steps > 1:
            raise ValueError(f"accumulate_grad_batches={steps} with pipeline parallelism: the schedule already"
                             " accumulates over microbatches; set accumulate_grad_batches=1 and raise microbatches"
                             " (and the batch size) instead")

    def prepare_step(self, module: nn.Module) -> None:
        # Lightning clears gradients after training_step, right before backward; the pipeline schedule runs its
        # backward inside training_step, so clear them before it instead (the loss's backward puts them back).
        if self.pipeline is not None:
            for param in module.parameters():
                param.grad = None

    def is_parallelized(self, module: nn.Module) -> bool:
        return bool(getattr(module, "_disttrain_megatron", False))

    def _target(self, module: nn.Module) -> tuple[str, nn.Module]:
        """The model to split and shard: the module itself when it is of a known family (Fabric: the model itself),
        else the LightningModule's ``pipeline_module`` attribute, else the outermost known model inside."""
        if family_of(module) is not None:
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
        assert self.meshes is not None and self.dims is not None, "setup_mesh() first"
        if self.is_parallelized(module):  # set up before (a Trainer re-setup): only materialise
            self.materialize(module, device)
            return module
        refuse_user_sharding(module, self.name)
        module._disttrain_megatron = True
        for transform in self.module_transforms:
            transform(module)
        prefix, target = self._target(module)
        self._target_prefix = prefix
        opts, dims, meshes = self.sharding_options, self.dims, self.meshes
        if dims.pp > 1:
            self.pipeline = pipeline_model(
                target, meshes.pp, device, schedule=opts.pipeline_schedule, microbatches=opts.microbatches,
                virtual_stages=opts.virtual_stages, split_points=opts.split_points)
            self.pipeline.dp_group = meshes.dp.get_group()
            hook = getattr(module, "loss_fn", None)
            if module is not target and callable(hook) and not self.pipeline.owns_loss:
                module.loss_fn = self.pipeline.defer_loss(hook)  # the documented PP hook of a LightningModule
        if dims.cp > 1:  # first: its hooks sit on the decoder layers, which TP, AC and FSDP keep
            from disttrain.parallel.split.cp import apply_context_parallel

            apply_context_parallel(target, meshes.cp, attention=opts.context_parallel_attention)
        if dims.tp > 1:
            self.tp_result = apply_tp(target, meshes.tp, opts.tp_plan, opts.wrap_classes, ep=dims.ep)
        if dims.ep > 1:
            self._expert_parallel(target, device, precision)
        # Tensor-parallel blocks compile with static shapes: torch 2.14 fails in the backward of DTensor layers
        # traced with symbolic shapes ("unhashable type: non-nested SymInt"); a new shape is a new static graph.
        dynamic = False if dims.tp > 1 else None
        if dims.pp > 1:
            self._shard_stages(device, precision, dynamic)
        else:
            apply_fsdp(module, meshes.fsdp, opts, precision, device, dynamic=dynamic)
            register_forward_methods(module, forward_methods)
        if self.allocates:
            self.materialize(module, device)
            if dims.pp == 1:  # under PP each stage module is a root of its own, called by the schedule
                claim_root(module)
            else:
                # each rank initialised its own: a tied head's copy starts as the embedding, and the parameters no
                # stage owns (a ViT's class token and position embedding) as the first data-parallel rank's
                self.pipeline.sync_tied()
                if meshes.dp.size() > 1:
                    from_first_rank(self.pipeline.stray_parameters(), meshes.dp.get_group())
        return module

    def copies(self) -> list[DeviceMesh]:
        """Also the tensor-parallel group: its ranks hold copies of what tensor parallelism leaves whole."""
        assert self.meshes is not None, "setup_mesh() first"
        return super().copies() + ([self.meshes.tp] if self.meshes.tp is not None else [])

    def clip_grad_norm_(self, module: nn.Module, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """As every engine clips, with a tied weight split over the first and last stage counted once."""
        copies = self.pipeline.tied_copies() if self.pipeline is not None else []
        return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, pp_group=self.pipeline_group(),
                               uncounted=copies)

    def full_model(self, model: nn.Module) -> AbstractContextManager[nn.Module]:
        """As :meth:`FSDPEngine.full_model` when only the data dimension is sharded. Tensor-parallel layers compute
        collectively whatever their parameters hold, and other pipeline stages' layers are not on this rank, so
        there is no whole model to gather in place: export it instead."""
        assert self.dims is not None
        if self.dims.tp > 1 or self.dims.pp > 1 or self.dims.cp > 1:
            raise RuntimeError(
                f"full_model() needs tensor_parallel_size, pipeline_parallel_size and context_parallel_size of 1 (got"
                f" {self.dims.tp}, {self.dims.pp} and {self.dims.cp}): write the full model with"
                " strategy.export_full(path) and load that file into the plain model")
        return super().full_model(model)

    def _expert_parallel(self, target: nn.Module, device: torch.device, precision: str) -> None:
        """Split the experts over the expert-parallel ranks (the model's own expert plan, applied by transformers)
        and give each experts module an FSDP unit of its own over the ranks that hold the same experts. An expert's
        gradient arrives summed over the tokens every rank sent it; dividing by all data-parallel ranks (not only
        those of its unit) makes it the same mean over the global batch as every other weight's."""
        from torch.distributed.fsdp import FSDPModule

        from disttrain.parallel.families.hf_plans import HF_PLANS

        assert self.meshes is not None and self.dims is not None
        found = find_model(target)
        if found is None or found[2] is not HF_PLANS:
            name = type(found[1] if found else target).__name__
            raise ValueError(f"expert_parallel_size={self.dims.ep}: expert parallelism splits the experts of HF MoE"
                             f" models whose config declares an expert plan (Mixtral, Qwen2-MoE, Qwen3-MoE, ...), not"
                             f" {name}; use expert_parallel_size=1")
        experts = HF_PLANS.apply_ep(found[1], self.meshes.ep, self.meshes.ep_tokens, self.dims.tp)
        unit_options = replace(self.sharding_options, activation_checkpointing=False, compile=False)
        for module in experts:
            shard_blocks(module, [module], self.meshes.expert_fsdp, unit_options, precision, device)
            assert isinstance(module, FSDPModule)
            module.set_gradient_divide_factor(float(self.dims.dp_shard))
            # gloo has no pre-multiplied sum: sum, then divide. (Not on a one-rank unit: FSDP divides its copy of
            # the gradient there already and would divide it twice.)
            if device.type == "cpu" and self.meshes.expert_fsdp.size() > 1:
                module.set_force_sum_reduction_for_comms(True)

    def _shard_stages(self, device: torch.device, precision: str, dynamic: Optional[bool] = None) -> None:
        """FSDP2 per block, then each stage module as its root (torchtitan's layout for PP x FSDP), as
        :func:`apply_fsdp` shards a whole model: the schedule calls the stage modules, so FSDP's root hooks run
        around every microbatch."""
        assert self.pipeline is not None and self.meshes is not None
        options = self.sharding_options
        if self.pipeline.schedule_name in SPLIT_BACKWARD:
            # torch's split backward (weight gradients in a pass of their own) reads the gathered parameters, which
            # FSDP frees after each forward otherwise: gradients then go missing or wrong. Keep them for the step.
            options = replace(options, reshard_after_forward=False)
        for stage in self.pipeline.stage_modules:
            blocks = list((stage.layers if hasattr(stage, "layers") else stage.blocks).values())
            shard_blocks(stage, blocks, self.meshes.fsdp, options, precision, device, dynamic=dynamic)
            shard_root(stage, self.meshes.fsdp, options, precision, device)

    # -- checkpoints and export -----------------------------------------------------------------------------
    def storage_layout(self) -> ckpt.StorageLayout:
        return self.tp_result.storage_layout(prefixes=("", self._target_prefix))

    def export(self, model: nn.Module, path: str | os.PathLike, prefix: str = "") -> Path:
        """The full model in its own layout (qkv rows restored) as one safetensors file on rank 0, gathered from
        every pipeline stage. Collective: call on every rank."""
        state = ckpt.model_state(model, full=True) if self.pipeline is None else self._gather_stages(model)
        if _rank() == 0:
            self.tp_result.restore(state, prefix=self._target_prefix_for(model))
        return ckpt.write_from_rank0(state, path, prefix)

    def _target_prefix_for(self, model: nn.Module) -> str:
        # Fabric exports the plain model (the target itself); the Trainer exports the LightningModule.
        _, target = self._target(model)
        return "" if target is model else self._target_prefix

    def _gather_stages(self, model: nn.Module) -> dict[str, Any]:
        """Each pipeline stage's full tensors (gathered over dp/tp in its own groups), then collected on rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.meshes is not None and self.dims is not None
        local = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        local = {k: v.detach().cpu() for k, v in local.items()}
        pp_group = self.meshes.pp.get_group()
        first_of_rest = all(v == 0 for d, v in self.dims.coordinates(_rank()).items() if d != "pp")
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

