"""The engine protocol every disttrain strategy implements, in torch terms.

An engine does everything a strategy does to a model; the Lightning adapters (``disttrain.strategies`` for the
Trainer, ``disttrain.fabric`` for Fabric) only translate Lightning's hooks into these calls:

=============================================  ==================================================================
processes                                      ``setup_mesh``, ``data_parallel_group``, ``sampler_kwargs``,
                                               ``reduce``, ``barrier``
where modules are built                        ``init_context`` (the meta device, ``deepspeed.zero.Init``)
set up a module and its optimizers             ``setup``, ``check_optimizers``, ``settle_optimizers``,
                                               ``module_transforms`` (FP8)
gradient accumulation                          ``no_sync`` (no gradient sync on non-final micro-steps)
gradient traffic                               ``comm_bytes`` (bytes sent to reduce gradients, compressed or not)
backward the engine owns                       ``prepare_step`` (the pipeline schedule); DeepSpeed's own backward
                                               runs through Lightning's DeepSpeed strategies we subclass
a library's own engine (DeepSpeed), set up in  ``device_for``, ``configure`` (batch settings, precision, clipping),
its Lightning strategy's order                 ``prepare`` (before hand-over), ``initialize`` (the hand-over),
                                               ``setup_optimizer`` (an optimizer made after the model),
                                               ``after_optimizer_step``
clipping by the whole model's norm             ``clip_grad_norm_``
buffers as DDP keeps them                      ``broadcast_buffers``, ``sync_buffers_after_forward``
checkpoints in the one DCP layout              ``model_state``, ``optimizer_state``, ``reads_checkpoint``,
                                               ``save_checkpoint``, ``load_checkpoint``
the full model                                 ``full_model``, ``export``
how it holds a model's states (read by the     ``layout`` (:mod:`disttrain.parallel.engines.layout`),
planner, the simulator and the callbacks)      ``degree_options`` (degrees the planner chose, as options)
=============================================  ==================================================================

Engines, one module each in this package: ``parallel.engines.fsdp.FSDPEngine``, ``parallel.engines.ddp.DDPEngine``, ``parallel.engines.zero.ZeroEngine``,
``parallel.engines.megatron.MegatronEngine``, ``parallel.engines.recsys.RecsysEngine``.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, ClassVar, Collection, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.checkpoint.async_save import AsyncSaver
from disttrain.parallel.engines.buffers import (
    broadcast_buffers,
    convert_sync_batchnorm,
    refuse_sync_batchnorm_on_cpu,
    sync_buffers_after_forward,
)
from disttrain.parallel.engines.clip import clip_grad_norm_
from disttrain.parallel.engines.layout import Layout, Precision
from disttrain.parallel.mesh import Meshes, ParallelDims

Optimizers = list[torch.optim.Optimizer]


class Engine:
    """The protocol, with what most engines share. ``options`` is the strategy's option dataclass
    (``options_cls``); ``name`` the registered strategy name that errors quote."""

    #: The options dataclass of the strategy: the single source of its options (docs tables are generated from it).
    options_cls: ClassVar[type]
    #: Checkpoints hold the optimizers' state by parameter name (``optimizer_state``), restored in place by
    #: ``load_checkpoint``; False: the optimizers' own ``state_dict()`` goes to ``meta.pt`` with the metadata.
    optimizers_by_name: ClassVar[bool] = True
    #: The engine shards over device meshes (built in ``setup_mesh`` from its ``ParallelDims``).
    builds_meshes: ClassVar[bool] = False
    #: Every rank keeps a whole copy of the (dense) model (DDP, torchrec's dense part), rather than a shard of one.
    replicates: ClassVar[bool] = False

    def __init__(self, options: Any, name: str = "disttrain") -> None:
        self.options = options
        self.name = name
        self.world_size, self.rank = 1, 0
        self.dims: ParallelDims | None = None  # the degrees, from the options (parallel_dims) in setup_mesh
        self.meshes: Meshes | None = None
        self.mesh: DeviceMesh | None = None  # the world mesh of engines that shard over device meshes
        # Functions that change the plain model right before it is parallelised (the FP8 callback's Linear swap).
        self.module_transforms: list[Callable[[nn.Module], None]] = []
        self._saver: AsyncSaver | None = None  # writes checkpoints in the background (option async_checkpoint)

    # -- how it holds a model's states ------------------------------------------------------------------------
    @classmethod
    def layout(cls, options: Any) -> Layout:
        """How the engine holds a model's states with ``options``: the declaration the planner, the step-time model,
        the simulator and the callbacks read (:mod:`disttrain.parallel.engines.layout`)."""
        raise NotImplementedError(f"{cls.__name__} declares no layout")

    @classmethod
    def degree_options(cls, degrees: dict[str, int]) -> dict[str, Any]:
        """The options that give the degrees ``{dimension: size}`` of the dimensions the layout lets the planner
        choose (``Layout.searched``), as a strategy of this engine takes them."""
        if degrees:
            raise ValueError(f"{cls.__name__} takes no degrees as options (got {degrees})")
        return {}

    @property
    def casts_itself(self) -> bool:
        """The engine casts to half precision itself (FSDP2's MixedPrecisionPolicy): adapters must not autocast."""
        return self.layout(self.options).can.precision is Precision.CASTS_ITSELF

    @property
    def takes_module_transforms(self) -> bool:
        """``module_transforms`` run on the plain model before it is parallelised (the FP8 callback's Linear swap)."""
        return self.layout(self.options).can.module_transforms

    # -- processes --------------------------------------------------------------------------------------------
    @classmethod
    def parallel_dims(cls, options: Any, world_size: int, local_size: int | None = None) -> ParallelDims:
        """The degrees ``options`` ask for on ``world_size`` ranks (``local_size``: processes per node), with the
        strategy's own error for sizes it cannot use: the one mapping from options to degrees, which the engine,
        the planner and the simulator share. Default: every rank a data-parallel rank, holding a replica
        (``replicates``) or a shard of one copy (ZeRO-3)."""
        return ParallelDims.data_parallel(world_size, replicate=cls.replicates)

    def setup_mesh(self, world_size: int, device: torch.device, local_size: int | None = None) -> DeviceMesh | None:
        """Called once the process group exists. ``local_size``: processes per node (Lightning's count)."""
        self.world_size, self.rank = world_size, dist.get_rank() if dist.is_initialized() else 0
        self.dims = self.parallel_dims(self.options, world_size, local_size)
        if self.builds_meshes:
            self.meshes = self.dims.build(device.type)
            self.mesh = self.meshes.world
        return self.mesh

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold the same part of the model and see different samples (None: all ranks)."""
        return self.meshes.dp.get_group() if self.meshes is not None else None

    def sampler_kwargs(self, world_size: int | None = None, rank: int | None = None) -> dict[str, int]:
        """``DistributedSampler`` arguments: one replica per data-parallel rank (context-, tensor- and
        pipeline-parallel ranks of one replica read the same samples). Before ``setup_mesh`` the caller's
        ``world_size`` and ``rank`` give the degrees the options will have."""
        dims = self.dims
        if dims is None and world_size is not None:
            dims = self.parallel_dims(self.options, world_size)
        rank = self.rank if rank is None else rank
        if dims is None:
            return {"num_replicas": self.world_size, "rank": rank}
        at = dims.coordinates(rank)
        return {"num_replicas": dims.dp, "rank": at["dp_replicate"] * dims.dp_shard + at["dp_shard"]}

    @staticmethod
    def reduce(tensor: Any, op: Any = "mean", group: dist.ProcessGroup | None = None) -> Any:
        """All-reduce a tensor in place over ``group`` ("mean"/"avg", "sum", "max", "min" or a ``ReduceOp``);
        other values and single processes are returned as they are."""
        if not isinstance(tensor, torch.Tensor) or not (dist.is_available() and dist.is_initialized()):
            return tensor
        name = {"mean": "avg"}.get(op, op).lower() if isinstance(op, str) else None
        # gloo has no AVG: sum, then divide.
        average = name == "avg" and dist.get_backend(group) == "gloo"
        reduce_op = dist.ReduceOp.SUM if average else getattr(dist.ReduceOp, name.upper()) if name else op
        dist.barrier(group=group)
        dist.all_reduce(tensor, op=reduce_op, group=group)
        if not average:
            return tensor
        size = dist.get_world_size(group)
        return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)

    @staticmethod
    def barrier(device: torch.device | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl" and device is not None:
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()

    # -- the model --------------------------------------------------------------------------------------------
    def init_context(self, empty_init: bool | None) -> AbstractContextManager:
        """Where modules are created (Trainer ``configure_model`` / ``init_module``, Fabric ``init_module``)."""
        return nullcontext()

    def setup(self, module: nn.Module, device: torch.device, precision: str, optimizers: Optimizers = (), *,
              container: bool = False, training: bool = True, forward_methods: tuple[str, ...] = (),
              sync_batchnorm: bool = False, convert: Callable[[nn.Module], nn.Module] | None = None,
              ) -> tuple[nn.Module, Optimizers]:
        """Parallelise ``module`` for ``device`` and ``precision`` (a Lightning precision string); returns the module
        to train (maybe a wrapper) and ``optimizers`` pointing at its parameters.

        ``optimizers``: made before set-up (Fabric); the Trainer creates its own afterwards and passes them to
        :meth:`check_optimizers`. ``container``: the model is inside ``module`` (the Trainer's LightningModule,
        which stays the object Lightning calls). ``training``: False for validate/test/predict. ``forward_methods``:
        methods called instead of ``forward`` (a LightningModule's step methods). ``sync_batchnorm``: BatchNorm
        layers as SyncBatchNorm over the data-parallel ranks (``Trainer(sync_batchnorm=True)``), with ``convert``
        when a user's own plugin converts them."""
        raise NotImplementedError(f"{type(self).__name__} does not set up modules")

    def check_optimizers(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Refuse optimizers the engine cannot step (made after :meth:`setup`, by the Trainer)."""

    @staticmethod
    def settle_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Step a parameter group that holds both DTensors and plain tensors tensor by tensor.

        torch's foreach kernels (its default on GPUs, or ``foreach=True``) take lists of one kind only and fail on
        the first step otherwise ("got mixed torch.Tensor and DTensor"); a few parameters stay plain beside the
        engine's DTensors (a ViT's class token and position embedding under pipeline parallelism). Such a group
        steps with ``foreach=False``, set around each step only, so that its checkpoints keep the user's setting
        (another strategy resuming them runs foreach). Called with the optimizers pointing at the set-up model's
        parameters, on both entry points; other optimizers are left as they are."""
        for optimizer in optimizers:
            hooked = _foreach_off_where_mixed in optimizer._optimizer_step_pre_hooks.values()  # set up again
            if _mixed_groups(optimizer) and not hooked:
                optimizer.register_step_pre_hook(_foreach_off_where_mixed)
                optimizer.register_step_post_hook(_foreach_back)

    # -- engines that hand the model to a library's own engine (DeepSpeed) --------------------------------------
    # Lightning's DeepSpeed strategies, which the ZeRO adapters keep, set the model up in their own order; these are
    # the steps of :meth:`setup` they call one at a time. Engines that set modules up themselves keep the defaults.
    def device_for(self, device: torch.device, local_rank: int) -> torch.device:
        """The device the engine computes on for Lightning's ``device`` of this local rank."""
        return device

    def configure(self, precision: str, micro_batch_size: int, accumulation: int, world_size: int,
                  gradient_clipping: Optional[float], device: torch.device) -> dict[str, Any]:
        """Batch settings, precision and clipping the engine needs before the model is set up (the Trainer's or
        Fabric's); returns its configuration (DeepSpeed's config), or {}."""
        return {}

    def prepare(self, module: nn.Module, device: torch.device, training: bool = True, sync_batchnorm: bool = False,
                convert: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
        """What :meth:`setup` does to the plain module before handing it over (refusals, SyncBatchNorm)."""
        return module

    def initialize(self, module: nn.Module, optimizer: Any, scheduler: Any, device: torch.device) -> tuple[Any, ...]:
        """Hand the prepared module (and one optimizer and scheduler) to the library's engine: (engine, optimizer,
        scheduler)."""
        raise NotImplementedError(f"{type(self).__name__} sets modules up itself: call setup()")

    def setup_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Any:
        """An optimizer made after :meth:`setup` from ``module``'s parameters, as the engine steps it."""
        return optimizer

    def after_optimizer_step(self, module: nn.Module) -> None:
        """After each optimizer step (Fabric): what holds for one step only is undone (a clip of that step)."""

    # -- training ---------------------------------------------------------------------------------------------
    def no_sync(self, module: nn.Module) -> AbstractContextManager:
        """Around a non-final micro-step of gradient accumulation: gradients are not synchronised."""
        return nullcontext()

    def comm_bytes(self) -> Optional[int]:
        """Bytes this rank has sent to reduce gradients since set-up (None: the engine does not count them). The
        ``Throughput`` callback reports them per step as ``comm/grad_bytes_per_step``."""
        return None

    def prepare_step(self, module: nn.Module) -> None:
        """Before a training step's forward (Trainer), for engines whose backward runs inside the forward."""

    def check_accumulation(self, steps: int) -> None:
        """Refuse gradient accumulation over ``steps`` micro-steps (Trainer) that the engine cannot do."""

    def clip_grad_norm_(self, module: nn.Module, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip ``parameters`` (an optimizer's, of ``module``) by the norm of the whole model's gradients (every
        shard, tp rank and pipeline stage); returns that norm."""
        return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, pp_group=self.pipeline_group())

    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The ranks holding different parts of the model along the layers (None without pipeline parallelism)."""
        return None

    # -- buffers: BatchNorm statistics as DDP keeps them ------------------------------------------------------
    @property
    def follows_rank0_buffers(self) -> bool:
        """Whether every data-parallel rank keeps the first rank's buffers (option ``broadcast_buffers``)."""
        return bool(getattr(self.options, "broadcast_buffers", False))

    def convert_batchnorm(self, module: nn.Module, asked: bool = False,
                          convert: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
        """Before parallelising: BatchNorm layers as SyncBatchNorm over the data-parallel ranks when the option
        ``sync_batchnorm`` or the caller (``asked``) asks, with torch's conversion or the caller's ``convert``."""
        if not (getattr(self.options, "sync_batchnorm", False) or asked):
            return module
        if convert is not None:
            return convert(module)
        return convert_sync_batchnorm(module, self.data_parallel_group())

    def settle_buffers(self, module: nn.Module, device: torch.device, training: bool = True) -> None:
        """After parallelising: refuse SyncBatchNorm on CPU for training (as ``ddp`` does) and start every rank
        from the first rank's buffers (DDP broadcasts them when it wraps a model)."""
        if training:
            refuse_sync_batchnorm_on_cpu(module, device, self.name)
        self.broadcast_buffers(module)

    def broadcast_buffers(self, module: nn.Module) -> None:
        """The first data-parallel rank's buffers to the others (after each Trainer training step)."""
        if self.follows_rank0_buffers:
            broadcast_buffers(module, self.data_parallel_group())

    def sync_buffers_after_forward(self, module: nn.Module) -> None:
        """Fabric calls the model's forward: broadcast the buffers after each one that can change them."""
        if self.follows_rank0_buffers:
            sync_buffers_after_forward(module, self.data_parallel_group())

    # -- checkpoints: the one layout (DCP folders, tensors by parameter name) ---------------------------------
    def model_state(self, module: nn.Module) -> dict[str, Any]:
        """The module's tensors in the one layout (what ``save_checkpoint`` writes under the module's key)."""
        return ckpt.model_state(module)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state by parameter name (flattened: ``"state.<fqn>.exp_avg"``)."""
        return ckpt.optimizer_state(module, optimizer)

    def is_optimizer(self, value: Any) -> bool:
        """Whether a value of a checkpoint's state is an optimizer this engine set up."""
        return isinstance(value, torch.optim.Optimizer)

    def reads_checkpoint(self, path: str | os.PathLike) -> bool:
        """Whether ``load_checkpoint`` reads ``path``; False hands it to Lightning's own loader (a single-file
        DDP checkpoint, a DeepSpeed folder)."""
        return True

    def save_checkpoint(self, path: str | os.PathLike, module: nn.Module, tensors: dict[str, Any],
                        metadata: dict[str, Any]) -> Path:
        """Collective: ``tensors`` (``{key: model_state | optimizer_state}``) as one DCP folder, ``metadata``
        (step, loop state) in its ``meta.pt``, written atomically (in the background under ``async_checkpoint``)."""
        return ckpt.save_sharded(path, tensors, metadata, saver=self.async_saver())

    def async_saver(self) -> AsyncSaver | None:
        """The background writer of the option ``async_checkpoint`` (None: saves are synchronous)."""
        if not getattr(self.options, "async_checkpoint", False):
            return None
        if self._saver is None:
            self._saver = AsyncSaver()
        return self._saver

    def wait_checkpoint(self, path: str | os.PathLike | None = None) -> None:
        """Collective: block until the checkpoint being written in the background is complete (no-op without
        ``async_checkpoint``); its error (a full disk) is raised here. Loads, the next save and the end of a run
        call it. ``path``: wait only if that folder is the one being written (before removing it)."""
        if self._saver is not None and (path is None or self._saver.writes(path)):
            self._saver.wait()

    def load_checkpoint(self, path: str | os.PathLike, module: nn.Module, targets: dict[str, Any],
                        strict: bool = True, weights_only: Optional[bool] = None, source: Any = None) -> dict[str, Any]:
        """Collective: restore ``targets`` (``{key: module | optimizer}``, ``module`` among them; optimizers only
        when ``optimizers_by_name``) in place from a checkpoint of any strategy and world size; returns the
        metadata. Non-tensor state is unpickled safely unless the caller explicitly passes ``weights_only=False``.
        ``source``: a checkpoint Lightning's own strategies wrote, seen in the one layout (``reader``, ``metadata``
        and ``stored``: ``disttrain.checkpoint_loading.LightningCheckpoint``), read in place of ``path``."""
        self.wait_checkpoint()
        return ckpt.load_sharded(path, targets, module, strict=strict, weights_only=weights_only is not False,
                                 source=source)

    def load_pretrained(self, module: nn.Module, folder: str | os.PathLike, prefix: str = "",
                        partial: bool = False, exclude: Collection[str] = ()) -> list[str]:
        """Collective: an HF folder's (or one safetensors file's) weights into the set-up ``module``, each rank
        reading only its own slices of the safetensors files (:mod:`disttrain.parallel.checkpoint.pretrained`); ``prefix``: the
        model's path inside ``module``; ``partial``: only the tensors the folder has; ``exclude``: tensor names (as
        stored) left as they are. Returns the tied parameters the folder holds under their other name."""
        layout = self.storage_layout() if hasattr(self, "storage_layout") else None
        return ckpt.load_pretrained(folder, module, prefix, layout=layout, partial=partial, exclude=exclude)

    # -- the full model ---------------------------------------------------------------------------------------
    def full_model(self, module: nn.Module) -> AbstractContextManager[nn.Module]:
        """Collective: ``with engine.full_model(module):`` every rank holds the full parameters and ``module``, or
        any part of it, can be called on any rank without communication (under ``torch.no_grad()``)."""
        raise NotImplementedError(f"{self.name} has no full_model(): write the full model with"
                                  " strategy.export_full(path) and load that file into the plain model")

    def export(self, module: nn.Module, path: str | os.PathLike, prefix: str = "") -> Path:
        """Collective: the full model as one safetensors file written by rank 0; ``prefix`` (``"model."``) keeps
        only that submodule's keys, without the prefix."""
        return ckpt.export_safetensors(module, path, prefix=prefix)


def _mixed_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    from torch.distributed.tensor import DTensor

    return [group for group in optimizer.param_groups if len({isinstance(p, DTensor) for p in group["params"]}) == 2]


def _foreach_off_where_mixed(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _foreach_back(optimizer, args, kwargs)  # a step that raised left its groups' settings to put back first
    saved = [(group, group.get("foreach")) for group in _mixed_groups(optimizer)]
    for group, _ in saved:
        group["foreach"] = False
    optimizer._disttrain_foreach = saved  # type: ignore[attr-defined]


def _foreach_back(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group, value in optimizer.__dict__.pop("_disttrain_foreach", []):
        group["foreach"] = value


def refuse_user_sharding(module: nn.Module, name: str) -> None:
    """Before an engine parallelises a model: one it is given already sharded (``fully_shard`` or
    ``parallelize_module`` in ``configure_model``, as Lightning's ModelParallelStrategy has users write) would be
    sharded twice, which torch reports as "can only be applied to a module once" or a DTensor mesh mismatch. One
    line naming the fix instead."""
    from torch.distributed.tensor import DTensor

    found = next((f"fully_shard was applied to {n or 'the model'!r}" for n, m in module.named_modules()
                  if isinstance(m, FSDPModule)), None)
    found = found or next((f"{n!r} is already a DTensor" for n, p in module.named_parameters()
                           if isinstance(p, DTensor)), None)
    if found is not None:
        raise ValueError(f"{name}: the model is already sharded ({found}, as Lightning's ModelParallelStrategy has"
                         f" configure_model do); {name} shards it itself: remove the fully_shard / parallelize_module"
                         " calls (disttrain_megatron takes your tensor-parallel plan as tp_plan=)")
