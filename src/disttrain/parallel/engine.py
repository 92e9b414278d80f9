"""The shared core of the FSDP strategies: everything they do, in torch terms.

``disttrain.strategies.FSDPStrategy`` (Trainer) and ``disttrain.fabric.FSDPStrategy`` (Fabric) only translate
Lightning's hooks into calls on one :class:`FSDPEngine`.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from disttrain.parallel import checkpoint as ckpt
from disttrain.parallel.buffers import (
    broadcast_buffers,
    convert_sync_batchnorm,
    has_plain_batchnorm,
    refuse_sync_batchnorm_on_cpu,
    sync_buffers_after_forward,
)
from disttrain.parallel.clip import clip_grad_norm_
from disttrain.parallel.fsdp import FSDPOptions, apply_fsdp, claim_root, gathered
from disttrain.parallel.init import materialize
from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.recsys import refuse_torchrec_tables


class FSDPEngine:
    """Holds the options and the data-parallel mesh; shards, checkpoints and exports a model."""

    def __init__(self, options: FSDPOptions) -> None:
        self.options = options
        self.dims: ParallelDims | None = None
        self.mesh: DeviceMesh | None = None
        # Functions that change the plain model before it is sharded (e.g. the FP8 callback's Linear swap).
        self.module_transforms: list[Callable[[nn.Module], None]] = []

    # -- processes ------------------------------------------------------------------------------------------
    def setup_mesh(self, world_size: int, device: torch.device, local_size: int | None = None) -> DeviceMesh:
        """``local_size``: processes per node (the adapters pass Lightning's count; else torchrun's
        LOCAL_WORLD_SIZE): under hybrid sharding the processes of one node form one shard group."""
        replicate = 1
        if self.options.hybrid_shard:
            shard = self.options.shard_size or local_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            if shard < 1 or world_size % shard:
                raise ValueError(f"shard_size={shard} does not divide world_size={world_size}; pass shard_size= the"
                                 " processes per node (a divisor of the world size)")
            replicate = world_size // shard
        self.dims = ParallelDims(world_size=world_size, dp_replicate=replicate)
        self.mesh = self.dims.build_mesh(device.type)
        return self.mesh

    def sampler_kwargs(self) -> dict[str, int]:
        assert self.mesh is not None, "setup_mesh() first"
        dp = self.mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    # -- model ----------------------------------------------------------------------------------------------
    def init_context(self, empty_init: bool | None) -> AbstractContextManager:
        """Where modules are created: the meta device (nothing allocated) when empty_init, else as usual."""
        meta = self.options.empty_init if empty_init is None else empty_init
        return torch.device("meta") if meta else nullcontext()

    def parallelize(self, module: nn.Module, device: torch.device, precision: str,
                    forward_methods: tuple[str, ...] = ()) -> nn.Module:
        """Shard ``module`` in place (per block, then root) and allocate/initialise meta tensors on ``device``.

        ``forward_methods`` are methods called instead of ``forward`` (a LightningModule's ``training_step``):
        FSDP2 gathers the root's parameters around them as it does around ``forward``.
        """
        assert self.mesh is not None and self.dims is not None, "setup_mesh() first"
        if any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
            raise TypeError("the model is wrapped in FSDP1 (FullyShardedDataParallel); disttrain_fsdp applies FSDP2"
                            " itself: pass the plain model")
        if isinstance(module, FSDPModule):
            reshard(module)  # set up again (Trainer.validate, then fit): optimizers must see the sharded params
        else:
            refuse_torchrec_tables(module, "disttrain_fsdp")
            for transform in self.module_transforms:
                transform(module)
            apply_fsdp(module, self.dims.fsdp_mesh(self.mesh), self.options, precision, device)
            for name in forward_methods:
                if callable(getattr(module, name, None)):
                    register_fsdp_forward_method(module, name)
        materialize(module, device)
        claim_root(module)
        return module

    def parallelize_with_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    device: torch.device, precision: str,
                                    forward_methods: tuple[str, ...] = ()) -> nn.Module:
        """``parallelize``, then point optimizers created before sharding (even on meta parameters) at the new
        sharded parameters, so users can create the optimizer before or after setup as with DDP. Parameters that
        left this rank (other pipeline stages) leave the optimizer too."""
        before = {id(p): name for name, p in _named_parameters(module)}
        self.parallelize(module, device, precision, forward_methods)
        after = dict(_named_parameters(module))
        for optimizer in optimizers:
            if optimizer.state:
                raise RuntimeError("the optimizer already has state (it stepped before setup); create or step it"
                                   " only after fabric.setup()")
            for group in optimizer.param_groups:
                names = [before.get(id(p)) for p in group["params"]]
                if None in names:
                    raise RuntimeError("the optimizer holds a parameter that is not in the model given to setup")
                group["params"] = [after[n] for n in names if n in after]
        return module

    def is_parallelized(self, module: nn.Module) -> bool:
        """Whether ``module`` was set up before (a Trainer's validate, then fit): it is not sharded again."""
        return isinstance(module, FSDPModule)

    # -- buffers: BatchNorm statistics as DDP keeps them ------------------------------------------------------
    def data_parallel_group(self) -> torch.distributed.ProcessGroup:
        """The ranks that hold the same part of the model and see different samples."""
        assert self.mesh is not None, "setup_mesh() first"
        return self.mesh["dp"].get_group()

    def convert_batchnorm(self, module: nn.Module, asked: bool = False,
                          convert: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
        """Before sharding: BatchNorm layers as SyncBatchNorm over the data-parallel ranks when the option
        ``sync_batchnorm`` or the Trainer (``asked``: ``Trainer(sync_batchnorm=True)``) asks, with torch's
        conversion (Lightning's), or with ``convert`` (a user's own Lightning layer-sync plugin). Returns the module
        to shard."""
        if not (self.options.sync_batchnorm or asked):
            return module
        if self.is_parallelized(module):  # converted (or not asked) when it was set up first
            if has_plain_batchnorm(module):
                raise RuntimeError("sync_batchnorm=True, but the model was already sharded without it (an earlier"
                                   " fit, validate or fabric.setup); ask for it at the model's first setup")
            return module
        if convert is not None:
            return convert(module)
        return convert_sync_batchnorm(module, self.data_parallel_group())

    def settle_buffers(self, module: nn.Module, device: torch.device, strategy: str, training: bool = True) -> None:
        """After sharding: refuse SyncBatchNorm on CPU for training (as ``ddp`` does) and start every rank from the
        first rank's buffers (DDP broadcasts them when it wraps a model)."""
        if training:
            refuse_sync_batchnorm_on_cpu(module, device, strategy)
        self.broadcast_buffers(module)

    def broadcast_buffers(self, module: nn.Module) -> None:
        """The first data-parallel rank's buffers to the others (option ``broadcast_buffers``, on by default)."""
        if self.options.broadcast_buffers:
            broadcast_buffers(module, self.data_parallel_group())

    def broadcast_buffers_after_forward(self, module: nn.Module) -> None:
        """Fabric calls the model's forward: broadcast the buffers after each one that can change them."""
        if self.options.broadcast_buffers:
            sync_buffers_after_forward(module, self.data_parallel_group())

    # -- training -------------------------------------------------------------------------------------------
    def pipeline_group(self) -> torch.distributed.ProcessGroup | None:
        """The group of ranks holding different parts of the model (none under FSDP)."""
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the norm of the whole model's gradients (every shard, tp rank and pipeline stage)."""
        return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, pp_group=self.pipeline_group())

    def full_model(self, model: nn.Module) -> AbstractContextManager[nn.Module]:
        """Collective: ``with engine.full_model(model):`` every rank holds the full parameters, and ``model`` or any
        part of it can be called on any rank without communication (under ``torch.no_grad()``)."""
        return gathered(model)

    # -- checkpoints ----------------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return self.options.save_distributed_checkpoint

    def save(self, path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, Any]) -> Path:
        """``tensors`` come from :func:`checkpoint.model_state`/``optimizer_state`` (sharded or full per option)."""
        if self.sharded:
            self.storage_layout().before_save(tensors)
            return ckpt.save_sharded(path, tensors, metadata)
        return ckpt.save_full(path, {**tensors, **metadata})

    def load(self, path: str | os.PathLike, targets: dict[str, Any], model: nn.Module,
             strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore ``targets`` (``{key: module | optimizer}``) in place; returns the rest. Non-tensor state is
        unpickled safely (``weights_only``) unless the caller explicitly passes False."""
        # Each loader checks the path (a missing one goes to load_full, which names it).
        if ckpt.is_sharded_checkpoint(path):
            return ckpt.load_sharded(path, targets, model, strict=strict, weights_only=weights_only is not False,
                                     layout=self.storage_layout())
        return ckpt.load_full(path, targets, model, strict=strict, weights_only=weights_only is not False)

    def storage_layout(self) -> ckpt.StorageLayout:
        """What differs between this engine's sharded tensors and the one checkpoint layout (nothing for FSDP)."""
        return ckpt.StorageLayout()

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        reshard(model)
        return ckpt.model_state(model, full=not self.sharded)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        reshard(model)  # the optimizer's parameters are the sharded ones: map them by identity
        return ckpt.optimizer_state(model, optimizer, full=not self.sharded)

    @staticmethod
    def export(model: nn.Module, path: str | os.PathLike, prefix: str = "") -> Path:
        reshard(model)
        return ckpt.export_safetensors(model, path, prefix=prefix)


def reshard(module: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state. A forward without backward (validation) leaves the units that
    do not reshard after forward (the last block) holding their gathered parameters, which then replace the sharded
    ones as the module's parameters: an optimizer created then, or a state dict mapped by parameter identity,
    would see the wrong tensors."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameter names without the activation-checkpoint wrapper's part, so they match before and after."""
    return [(name.replace("_checkpoint_wrapped_module.", ""), p) for name, p in module.named_parameters()]
