"""``disttrain_ddp`` for Lightning Fabric."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision

from disttrain._lightning import checked_options
from disttrain.fabric.base import EngineStrategy
from disttrain.parallel.engines.ddp import DDPEngine


# Fabric has no check for its own DDPStrategy class (the Trainer has: see disttrain.strategies.ddp), so this one
# needs no Lightning DDP base: the engine wraps the model in DistributedDataParallel.
class DDPStrategy(EngineStrategy):
    """DDP for ``lightning.Fabric``; the same options as :class:`disttrain.strategies.DDPStrategy`
    (:class:`disttrain.parallel.engines.ddp.DDPOptions`), compression hooks on CPU too. Checkpoints are the one disttrain
    layout; a single-file checkpoint (Lightning's own DDP format) is loaded as Lightning does."""

    strategy_name = "disttrain_ddp"
    engine_cls = DDPEngine

    # BEGIN generated options: tools/strategy_signatures.py --write, from DDPOptions (edit the dataclass)
    @checked_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = None,
        *,
        gradient_compression: Optional[str] = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        activation_checkpointing: bool = False,
        async_checkpoint: bool = False,
        compile: bool = False,
    ) -> None:
        """The options of ``disttrain_ddp`` as keywords (:class:`~disttrain.parallel.engines.ddp.DDPOptions`), after the
        arguments Fabric sets.

        Args:
            accelerator: set by Fabric from its ``accelerator``.
            parallel_devices: set by Fabric from its ``devices``.
            cluster_environment: set by Fabric (torchrun, SLURM, ...).
            precision: set by Fabric from its ``precision``.
            process_group_backend: "gloo" or "nccl"; default: the devices' own.
            timeout: seconds (or a ``timedelta``) a process may stay silent before every process ends the run; a
                collective waits a few seconds longer. Default: ``$DISTTRAIN_TIMEOUT``, else 600.
            gradient_compression: None, "fp16", "bf16" (halve all-reduce bytes), "int8" (a quarter: a scale per chunk of
                256 elements, error feedback) or "powersgd" (low-rank, error feedback).
            powersgd_rank: rank of PowerSGD's approximation (higher: closer to exact, more bytes).
            powersgd_start_iter: plain all-reduce for this many steps (at least 2) before PowerSGD starts (warm-up).
            find_unused_parameters: passed to DistributedDataParallel.
            static_graph: passed to DistributedDataParallel.
            activation_checkpointing: recompute each block's activations in backward (blocks found as disttrain_fsdp
                finds them).
            async_checkpoint: write sharded checkpoints in the background: a save copies the tensors to host memory and
                training goes on while they are written (the same folder, manifest and checksums; at most one save in
                flight; the run's end waits for the last one).
            compile: ``torch.compile`` each block (after activation checkpointing, before DDP wraps the model; DDP's
                gradient hooks stay outside the graph); the compiled code is cached under ``TORCHINDUCTOR_CACHE_DIR``.
        """
        options = {"gradient_compression": gradient_compression, "powersgd_rank": powersgd_rank,
                   "powersgd_start_iter": powersgd_start_iter, "find_unused_parameters": find_unused_parameters,
                   "static_graph": static_graph, "activation_checkpointing": activation_checkpointing,
                   "async_checkpoint": async_checkpoint, "compile": compile}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision, process_group_backend,
                           timeout, options)
    # END generated options
