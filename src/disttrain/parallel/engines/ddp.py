"""DDP with optional gradient compression (communication hooks from torch.distributed.algorithms): the engine of
``disttrain_ddp``."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from disttrain.parallel.checkpoint.io import is_sharded_checkpoint
from disttrain.parallel.engines.base import Engine, Optimizers, refuse_user_sharding
from disttrain.parallel.engines.layout import (
    Buffers,
    Capabilities,
    Grads,
    Layout,
    Optimizer,
    Params,
    Reduce,
    Steps,
    Work,
)
from disttrain.parallel.engines.tables import refuse_torchrec_tables
from disttrain.parallel.split.ac import apply_ac, has_ac
from disttrain.parallel.split.blocks import find_blocks
from disttrain.parallel.split.compile import compile_blocks, is_compiled
from disttrain.parallel.split.compress import DDP_HOOKS, HookState, Traffic, wire

COMPRESSIONS = ("fp16", "bf16", "int8", "powersgd")
BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb


@dataclass
class DDPOptions:
    """What a user can set on ``disttrain_ddp`` (the same names on the Trainer and Fabric strategies).

    gradient_compression: None, "fp16", "bf16" (halve all-reduce bytes), "int8" (a quarter: a scale per chunk of
        256 elements, error feedback) or "powersgd" (low-rank, error feedback).
    powersgd_rank: rank of PowerSGD's approximation (higher: closer to exact, more bytes).
    powersgd_start_iter: plain all-reduce for this many steps (at least 2) before PowerSGD starts (warm-up).
    find_unused_parameters, static_graph: passed to DistributedDataParallel.
    activation_checkpointing: recompute each block's activations in backward (blocks found as disttrain_fsdp finds
        them).
    async_checkpoint: write sharded checkpoints in the background: a save copies the tensors to host memory and
        training goes on while they are written (the same folder, manifest and checksums; at most one save in flight;
        the run's end waits for the last one).
    compile: ``torch.compile`` each block (after activation checkpointing, before DDP wraps the model; DDP's
        gradient hooks stay outside the graph); the compiled code is cached under ``TORCHINDUCTOR_CACHE_DIR``.
    """

    gradient_compression: Optional[str] = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10
    find_unused_parameters: bool = False
    static_graph: bool = False
    activation_checkpointing: bool = False
    async_checkpoint: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.gradient_compression is not None and self.gradient_compression not in COMPRESSIONS:
            raise ValueError(f"gradient_compression={self.gradient_compression!r} is not known; choose None or one"
                             f" of {', '.join(COMPRESSIONS)}")
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank={self.powersgd_rank} must be at least 1")
        if self.powersgd_start_iter < 2:  # torch's PowerSGD (error feedback) needs DDP's first two steps plain
            raise ValueError(f"powersgd_start_iter={self.powersgd_start_iter} must be at least 2: PowerSGD starts after"
                             " DDP's first two steps, which reduce the gradients uncompressed")
        for name, default in (("powersgd_rank", 1), ("powersgd_start_iter", 10)):
            if getattr(self, name) != default and self.gradient_compression != "powersgd":
                raise ValueError(f"{name}={getattr(self, name)} applies with gradient_compression='powersgd'; set"
                                 f" it, or remove {name}")

    def ddp_kwargs(self) -> dict:
        return {"find_unused_parameters": self.find_unused_parameters, "static_graph": self.static_graph}


def register_compression(model: DistributedDataParallel, options: DDPOptions, traffic: Traffic) -> None:
    """Install the communication hook chosen in ``options`` on a DDP model: the all-reduce, compressed or not, with
    its bytes counted into ``traffic`` (PowerSGD's are not counted: its low-rank factors and the tensors it leaves
    uncompressed go through torch's own hook)."""
    kind = options.gradient_compression
    if kind in DDP_HOOKS:
        model.register_comm_hook(HookState(traffic), DDP_HOOKS[kind])
    elif kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=options.powersgd_start_iter,
            min_compression_rate=1,  # compress small test models too; real models pass the default check anyway
        )
        gloo = dist.get_backend() == "gloo"
        model.register_comm_hook(state, powersgd_in_order if gloo else powerSGD_hook.powerSGD_hook)


def powersgd_in_order(state, bucket):  # unannotated: DDP checks a hook's annotations against its classes themselves
    """torch's PowerSGD hook (``state``: its PowerSGDState, ``bucket``: a dist.GradBucket), each bucket's exchange
    finished before backward goes on to the next bucket (gloo). The hook issues its later all-reduces (the P and Q
    factors) from the completion callback of the first, which gloo runs on its own thread: there they can overtake
    the next bucket's all-reduce on one rank and not on another, and gloo ends the run with "Received data size
    doesn't match expected size ... collective mismatch" or hangs (2 of 6 runs across two hosts; most runs of a
    12-bucket model on loopback). NCCL orders its collectives on the stream as they are enqueued, and keeps torch's
    hook. On CPU processes little of an exchange hides behind backward anyway."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future


class DDPEngine(Engine):
    """Every rank holds the whole model; DistributedDataParallel all-reduces the gradients (compressed as the options
    say) and keeps the buffers equal itself. Checkpoints are the one DCP layout, so they move to and from every
    sharded strategy."""

    options_cls = DDPOptions
    replicates = True
    options: DDPOptions

    def __init__(self, options: DDPOptions, name: str = "disttrain_ddp") -> None:
        super().__init__(options, name)
        self.traffic = Traffic()

    @classmethod
    def layout(cls, options: DDPOptions) -> Layout:
        """A replica on every rank: parameters, gradients and optimizer state whole, in the precision's parameter
        dtype; gradients all-reduced bucket by bucket while backward runs, from a second copy of them (the
        buckets), compressed as ``gradient_compression`` says (:func:`disttrain.parallel.split.compress.wire`);
        a plain optimizer over plain tensors; plain modules."""
        return Layout(
            params=Params(),
            grads=Grads(reduce=Reduce.ALL_REDUCE, bucket_bytes=BUCKET_BYTES,
                        **wire(options.gradient_compression, rank=options.powersgd_rank)),
            optimizer=Optimizer(steps=Steps.TENSORS),
            buffers=Buffers(gradient_copy=True),
            work=Work.PLAIN,
            can=Capabilities(),
        )

    def comm_bytes(self) -> Optional[int]:
        return None if self.options.gradient_compression == "powersgd" else self.traffic.bytes_sent

    @property
    def follows_rank0_buffers(self) -> bool:
        return False  # DDP's own broadcast_buffers=True does it

    def setup(self, module: nn.Module, device: torch.device, precision: str, optimizers: Optimizers = (), *,
              container: bool = False, training: bool = True, forward_methods: tuple[str, ...] = (),
              sync_batchnorm: bool = False, convert: Callable[[nn.Module], nn.Module] | None = None,
              ) -> tuple[nn.Module, Optimizers]:
        """``module`` on ``device`` wrapped in DistributedDataParallel (its parameters stay the same objects, so
        optimizers made before need nothing)."""
        refuse_torchrec_tables(module, self.name)
        refuse_user_sharding(module, self.name)
        for transform in self.module_transforms:
            transform(module)
        blocks = None
        if self.options.activation_checkpointing and not has_ac(module):
            blocks = apply_ac(module, find_blocks(module))
        if self.options.compile and not is_compiled(module):
            compile_blocks(blocks if blocks is not None else find_blocks(module))
        if sync_batchnorm:
            module = convert(module) if convert is not None else nn.SyncBatchNorm.convert_sync_batchnorm(module)
        return self.wrap(module.to(device), device), list(optimizers)

    def wrap(self, module: nn.Module, device: torch.device) -> DistributedDataParallel:
        """DistributedDataParallel with the options' arguments and compression hook."""
        device_ids = None if device.type == "cpu" else [device.index]
        # DDP's constructor broadcasts the parameters; on CUDA that goes on a side stream, as torch's notes advise.
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with stream:
            ddp = DistributedDataParallel(module, device_ids=device_ids, **self.options.ddp_kwargs())
        register_compression(ddp, self.options, self.traffic)
        return ddp

    def no_sync(self, module: nn.Module) -> AbstractContextManager:
        return module.no_sync() if isinstance(module, DistributedDataParallel) else nullcontext()

    def reads_checkpoint(self, path: str | os.PathLike) -> bool:
        return is_sharded_checkpoint(path)  # a single file is Lightning's own DDP format

    @contextmanager
    def full_model(self, module: nn.Module) -> Iterator[nn.Module]:
        """Every rank already holds the whole model: only ``torch.no_grad()``, so code written for the sharded
        strategies runs unchanged."""
        with torch.no_grad():
            yield module

    def export(self, module: nn.Module, path: str | os.PathLike, prefix: str = "") -> Any:
        return super().export(module.module if isinstance(module, DistributedDataParallel) else module, path, prefix)
