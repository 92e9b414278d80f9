"""The FSDP2 engine (``disttrain_fsdp``, ``disttrain_fsdp_offload``): ``fully_shard`` per block, then the root
(:mod:`disttrain.parallel.split.fsdp`), over the data-parallel mesh of its ``ParallelDims``."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.engines.base import Engine, Optimizers, refuse_user_sharding
from disttrain.parallel.engines.buffers import has_plain_batchnorm
from disttrain.parallel.engines.init import has_meta_tensors, materialize, same_across
from disttrain.parallel.engines.layout import (
    Buffers,
    Capabilities,
    Dtype,
    Gather,
    Grads,
    Layout,
    Optimizer,
    Params,
    Partition,
    Precision,
    Reduce,
    Steps,
    Units,
    Where,
    Work,
)
from disttrain.parallel.engines.tables import refuse_torchrec_tables
from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.split.compress import Traffic, wire
from disttrain.parallel.split.fsdp import FSDPOptions, apply_fsdp, claim_root, gathered, set_gradient_sync


class FSDPEngine(Engine):
    """FSDP2: holds the options and the data-parallel mesh; shards, checkpoints and exports a model."""

    options_cls = FSDPOptions
    builds_meshes = True
    options: FSDPOptions
    #: Allocate and initialise the sharded parameters after sharding; ``disttrain.simulate`` turns it off to keep the
    #: shards on the meta device (their shapes are what it counts; a world of fake ranks allocates nothing).
    allocates: bool = True

    def __init__(self, options: FSDPOptions, name: str = "disttrain_fsdp") -> None:
        super().__init__(options, name)
        self.traffic: Traffic | None = None  # counted once the model is sharded

    def comm_bytes(self) -> Optional[int]:
        return self.traffic.bytes_sent if self.traffic is not None else None

    # -- how it holds a model's states ----------------------------------------------------------------------
    @classmethod
    def layout(cls, options: FSDPOptions) -> Layout:
        """Parameters, gradients and optimizer state in the precision's parameter dtype, each parameter chunked on
        dim 0 over the data-sharding ranks (``dp_shard`` x ``cp``) and replicated over ``dp_replicate`` (HSDP); in
        host memory under ``cpu_offload``. Parameters are gathered unit by unit (each block, sub-network and the
        root) in the compute dtype for forward and again for backward, while the next unit is prefetched; the root
        stays gathered throughout; each unit's gradients are reduce-scattered as its backward ends (and all-reduced
        across replicas), compressed as ``gradient_compression`` says. The optimizer steps the DTensor shards. The
        planner may replicate across nodes and shard within one (``dp_replicate``: ``hybrid_shard``)."""
        shard, where = ("dp_shard", "cp"), Where.HOST if options.cpu_offload else Where.DEVICE
        return Layout(
            params=Params(shard, Dtype.PARAM, where, gather=Gather.PER_UNIT, units=Units.FSDP),
            grads=Grads(shard, Dtype.PARAM, where, reduce=Reduce.REDUCE_SCATTER, reduce_dtype=Dtype.PARAM,
                        **wire(options.gradient_compression, all_gathered=False)),
            optimizer=Optimizer(shard, Dtype.PARAM, where, steps=Steps.DTENSORS),
            partition=Partition.DIM0,
            buffers=Buffers(gathered_units=2, root_gathered=True, unit_gradients=1),
            work=Work.SHARDED,
            searched=("dp_replicate",),
            can=Capabilities(precision=Precision.CASTS_ITSELF, float8_all_gather=True,
                             offload=("params", "grads", "optimizer")),
        )

    @classmethod
    def degree_options(cls, degrees: dict[str, int]) -> dict[str, Any]:
        """``{"dp_replicate": r, "dp_shard": s}`` with r > 1: hybrid sharding over groups of s ranks."""
        unknown = set(degrees) - {"dp_replicate", "dp_shard"}
        if unknown:
            raise ValueError(f"{cls.__name__} takes the degrees dp_replicate and dp_shard as options, not"
                             f" {sorted(unknown)}")
        if degrees.get("dp_replicate", 1) == 1:
            return {}
        if "dp_shard" not in degrees:
            raise ValueError("hybrid sharding needs the shard group's size: pass dp_shard= with dp_replicate=")
        return {"hybrid_shard": True, "shard_size": degrees["dp_shard"]}

    # -- processes ------------------------------------------------------------------------------------------
    @classmethod
    def parallel_dims(cls, options: FSDPOptions, world_size: int, local_size: int | None = None) -> ParallelDims:
        """Every rank shards one copy; under ``hybrid_shard`` the processes of one node (``shard_size``, else
        ``local_size``, else torchrun's LOCAL_WORLD_SIZE) form a shard group and the groups replicate."""
        if not options.hybrid_shard:
            if options.shard_size is not None:
                raise ValueError(f"shard_size={options.shard_size} applies to hybrid sharding only; pass"
                                 " hybrid_shard=True with it, or leave shard_size out")
            return ParallelDims(world_size)
        shard = options.shard_size or local_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if shard < 1 or world_size % shard:
            raise ValueError(f"shard_size={shard} does not divide world_size={world_size}; pass shard_size= the"
                             " processes per node (a divisor of the world size)")
        return ParallelDims(world_size, dp_replicate=world_size // shard, dp_shard=shard)

    # -- the model ------------------------------------------------------------------------------------------
    def init_context(self, empty_init: bool | None) -> AbstractContextManager:
        """The meta device (nothing allocated) when ``empty_init`` (default: the option), else as usual."""
        meta = self.options.empty_init if empty_init is None else empty_init
        return torch.device("meta") if meta else nullcontext()

    def setup(self, module: nn.Module, device: torch.device, precision: str, optimizers: Optimizers = (), *,
              container: bool = False, training: bool = True, forward_methods: tuple[str, ...] = (),
              sync_batchnorm: bool = False, convert: Callable[[nn.Module], nn.Module] | None = None,
              ) -> tuple[nn.Module, Optimizers]:
        """Shard in place (per block, then root), allocate meta tensors on ``device``, point ``optimizers`` made
        before (even on meta parameters) at the shards, so users can create them before or after set-up as with
        DDP (parameters that left this rank, other pipeline stages, leave them too)."""
        module = self._convert_batchnorm_once(module, sync_batchnorm, convert)
        before: dict[int, list[str]] = {}  # every name of a parameter: a tied one may stay under either
        for name, param in _named_parameters(module, remove_duplicate=False):
            before.setdefault(id(param), []).append(name)
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
                # a pipeline's last stage keeps a tied head as a copy of its own: the same entry, another name
                group["params"] = list({id(after[n]): after[n] for found in names for n in found if n in after}
                                       .values())
        self.settle_buffers(module, device, training)
        return module, list(optimizers)

    def parallelize(self, module: nn.Module, device: torch.device, precision: str,
                    forward_methods: tuple[str, ...] = ()) -> nn.Module:
        """Shard ``module`` in place (per block, then root) and allocate/initialise meta tensors on ``device``.

        ``forward_methods`` are methods called instead of ``forward`` (a LightningModule's ``training_step``):
        FSDP2 gathers the root's parameters around them as it does around ``forward``.
        """
        assert self.meshes is not None, "setup_mesh() first"
        if any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
            raise TypeError("the model is wrapped in FSDP1 (FullyShardedDataParallel); disttrain_fsdp applies FSDP2"
                            " itself: pass the plain model")
        if isinstance(module, FSDPModule):
            reshard(module)  # set up again (Trainer.validate, then fit): optimizers must see the sharded params
        else:
            refuse_torchrec_tables(module, "disttrain_fsdp")
            refuse_user_sharding(module, self.name)
            for transform in self.module_transforms:
                transform(module)
            self.traffic = self.traffic or Traffic()
            apply_fsdp(module, self.meshes.fsdp, self.sharding_options, precision, device, traffic=self.traffic)
            register_forward_methods(module, forward_methods)
        if self.allocates:
            self.materialize(module, device)
            claim_root(module)
        return module

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Allocate and initialise a meta-device model; what ranks hold copies of then takes the values of the first
        rank of each copy (:meth:`copies`): each had drawn its own."""
        if not has_meta_tensors(module):
            return
        materialize(module, device, cpu_offload=self.options.cpu_offload)
        for mesh in self.copies():
            same_across(module, mesh)

    def copies(self) -> list[DeviceMesh]:
        """The one-dimension meshes whose ranks hold the same values of what they hold: HSDP's replicas."""
        assert self.meshes is not None, "setup_mesh() first"
        return [self.meshes.replicate] if self.meshes.replicate is not None else []

    @property
    def sharding_options(self) -> FSDPOptions:
        """The options ``fully_shard`` is applied with: without allocation (``disttrain.simulate``) the shards stay on
        the meta device, offloaded or not (meta tensors cannot move to the host; their bytes are the same)."""
        return self.options if self.allocates else replace(self.options, cpu_offload=False)

    def is_parallelized(self, module: nn.Module) -> bool:
        """Whether ``module`` was set up before (a Trainer's validate, then fit): it is not sharded again."""
        return isinstance(module, FSDPModule)

    def _convert_batchnorm_once(self, module: nn.Module, asked: bool,
                                convert: Callable[[nn.Module], nn.Module] | None) -> nn.Module:
        """A model sharded before (an earlier fit, validate or fabric.setup) keeps the layers it was sharded with."""
        if not self.is_parallelized(module):
            return self.convert_batchnorm(module, asked, convert)
        if (self.options.sync_batchnorm or asked) and has_plain_batchnorm(module):
            raise RuntimeError("sync_batchnorm=True, but the model was already sharded without it (an earlier"
                               " fit, validate or fabric.setup); ask for it at the model's first setup")
        return module

    # -- training -------------------------------------------------------------------------------------------
    def no_sync(self, module: nn.Module) -> AbstractContextManager:
        """No reduce-scatter on the non-final micro-steps of gradient accumulation."""
        return _GradientSyncOff(module)

    # -- checkpoints ----------------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return self.options.save_distributed_checkpoint

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        reshard(module)  # after a validation the last block may still hold its gathered parameters
        return ckpt.model_state(module, full=not self.sharded)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        reshard(module)  # the optimizer's parameters are the sharded ones: map them by identity
        return ckpt.optimizer_state(module, optimizer, full=not self.sharded)

    def save_checkpoint(self, path: str | os.PathLike, module: nn.Module, tensors: dict[str, Any],
                        metadata: dict[str, Any]) -> Path:
        """Sharded, or one full file written by rank 0 when ``save_distributed_checkpoint=False``."""
        if self.sharded:
            self.storage_layout().before_save(tensors)
            return ckpt.save_sharded(path, tensors, metadata, saver=self.async_saver())
        return ckpt.save_full(path, {**tensors, **metadata})

    def load_checkpoint(self, path: str | os.PathLike, module: nn.Module, targets: dict[str, Any],
                        strict: bool = True, weights_only: Optional[bool] = None, source: Any = None) -> dict[str, Any]:
        self.wait_checkpoint()  # a folder written in the background exists once it is complete
        # Each loader checks the path (a missing one goes to load_full, which names it).
        if source is not None or ckpt.is_sharded_checkpoint(path):
            return ckpt.load_sharded(path, targets, module, strict=strict, weights_only=weights_only is not False,
                                     layout=self.storage_layout(), source=source)
        return ckpt.load_full(path, targets, module, strict=strict, weights_only=weights_only is not False)

    def storage_layout(self) -> ckpt.StorageLayout:
        """What differs between this engine's sharded tensors and the one checkpoint layout (nothing for FSDP)."""
        return ckpt.StorageLayout()

    # -- the full model -------------------------------------------------------------------------------------
    def full_model(self, module: nn.Module) -> AbstractContextManager[nn.Module]:
        return gathered(module)

    def export(self, module: nn.Module, path: str | os.PathLike, prefix: str = "") -> Path:
        reshard(module)
        return ckpt.export_safetensors(module, path, prefix=prefix)


class _GradientSyncOff(AbstractContextManager):
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        set_gradient_sync(self.module, False)

    def __exit__(self, *exc: Any) -> None:
        set_gradient_sync(self.module, True)


def register_forward_methods(module: nn.Module, names: tuple[str, ...]) -> None:
    """FSDP2 gathers the root's parameters around each of these methods as it does around ``forward``."""
    for name in names:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)


def reshard(module: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state. A forward without backward (validation) leaves the units that
    do not reshard after forward (the last block) holding their gathered parameters, which then replace the sharded
    ones as the module's parameters: an optimizer created then, or a state dict mapped by parameter identity,
    would see the wrong tensors."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _named_parameters(module: nn.Module, remove_duplicate: bool = True) -> list[tuple[str, nn.Parameter]]:
    """Parameter names without the activation-checkpoint wrapper's part, so they match before and after."""
    return [(name.replace("_checkpoint_wrapped_module.", ""), p)
            for name, p in module.named_parameters(remove_duplicate=remove_duplicate)]
