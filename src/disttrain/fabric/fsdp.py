"""``disttrain_fsdp`` / ``disttrain_fsdp_offload`` for Lightning Fabric."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision

from disttrain._lightning import checked_options
from disttrain.fabric.base import EngineStrategy
from disttrain.parallel.engines.fsdp import FSDPEngine
from disttrain.parallel.split.blocks import BlockSpec


class FSDPStrategy(EngineStrategy):
    """FSDP2 for ``lightning.Fabric``; runs on CUDA (nccl) and on CPU (gloo).

    Options as keywords, the same as the Trainer strategy (:class:`disttrain.parallel.split.fsdp.FSDPOptions`).
    ``fabric.init_module(empty_init=True)`` builds on the meta device; ``fabric.setup`` shards and initialises.
    """

    strategy_name = "disttrain_fsdp"
    engine_cls = FSDPEngine

    # BEGIN generated options: tools/strategy_signatures.py --write, from FSDPOptions (edit the dataclass)
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
        wrap_classes: BlockSpec = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reshard_after_forward: Union[bool, int] = True,
        empty_init: bool = False,
        save_distributed_checkpoint: bool = True,
        async_checkpoint: bool = False,
        hybrid_shard: bool = False,
        shard_size: Optional[int] = None,
        broadcast_buffers: bool = True,
        sync_batchnorm: bool = False,
        gradient_compression: Optional[str] = None,
        compile: bool = False,
    ) -> None:
        """The options of ``disttrain_fsdp`` as keywords (:class:`~disttrain.parallel.split.fsdp.FSDPOptions`), after
        the arguments Fabric sets.

        Args:
            accelerator: set by Fabric from its ``accelerator``.
            parallel_devices: set by Fabric from its ``devices``.
            cluster_environment: set by Fabric (torchrun, SLURM, ...).
            precision: set by Fabric from its ``precision``.
            process_group_backend: "gloo" or "nccl"; default: the devices' own.
            timeout: seconds (or a ``timedelta``) a process may stay silent before every process ends the run; a
                collective waits a few seconds longer. Default: ``$DISTTRAIN_TIMEOUT``, else 600.
            wrap_classes: block class(es) or class name(s) to shard one unit each; default: found automatically.
            activation_checkpointing: recompute each block's activations in backward.
            cpu_offload: keep parameters, gradients and optimizer state on the CPU between uses.
            reshard_after_forward: free gathered parameters after forward (True, ZeRO-3) or keep them until backward
                (False, ZeRO-2 style: more memory, one all-gather less), or an int: reshard to that smaller group size.
            empty_init: build the model on the meta device when the Trainer/Fabric does not say (``configure_model`` /
                ``init_module()``), so no rank ever holds the whole model; shards are initialised after sharding.
            save_distributed_checkpoint: sharded (torch.distributed.checkpoint) checkpoints; False writes one full file.
            async_checkpoint: write sharded checkpoints in the background: a save copies the tensors to host memory and
                training goes on while they are written (the same folder, manifest and checksums; at most one save in
                flight; the run's end waits for the last one).
            hybrid_shard: HSDP on a 2D mesh: shard within a group of ``shard_size`` ranks (default: the processes of one
                node), replicate across groups (nodes): all-gathers stay on the fast intra-node links, only the gradient
                all-reduce crosses nodes.
            shard_size: ranks per shard group under ``hybrid_shard``; must divide the world size.
            broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the data-parallel ranks: the
                first rank's after every training forward, as DDP's ``broadcast_buffers=True`` does; False lets each
                rank keep its own.
            sync_batchnorm: BatchNorm layers as SyncBatchNorm over the data-parallel ranks (GPU only, as under DDP); the
                Trainer's ``sync_batchnorm=True`` does the same.
            gradient_compression: None (gradients reduce-scattered in fp32, whatever the precision), "bf16" (in bf16:
                half the bytes) or "int8" (a quarter: a scale per chunk of 256 elements, error feedback).
            compile: ``torch.compile`` each block (after activation checkpointing, before sharding; FSDP's hooks stay
                outside the graph); the compiled code is cached under ``TORCHINDUCTOR_CACHE_DIR`` for the next run.
        """
        options = {"wrap_classes": wrap_classes, "activation_checkpointing": activation_checkpointing,
                   "cpu_offload": cpu_offload, "reshard_after_forward": reshard_after_forward, "empty_init": empty_init,
                   "save_distributed_checkpoint": save_distributed_checkpoint, "async_checkpoint": async_checkpoint,
                   "hybrid_shard": hybrid_shard, "shard_size": shard_size, "broadcast_buffers": broadcast_buffers,
                   "sync_batchnorm": sync_batchnorm, "gradient_compression": gradient_compression, "compile": compile}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision, process_group_backend,
                           timeout, options)
    # END generated options
