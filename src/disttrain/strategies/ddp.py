"""``disttrain_ddp`` for the Lightning Trainer: Lightning's DDP over our DDP engine (compression hooks on CPU too,
the one checkpoint layout)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch import nn

from disttrain._lightning import after_process_group, checked_options, split_timeout
from disttrain.parallel.engines.ddp import DDPEngine
from disttrain.strategies.base import TrainerAdapter


# Lightning's DDPStrategy stays the base: the Trainer accepts a torch.compile'd module only under its DDP, FSDP or
# single-device strategies (an isinstance check), and for manual optimization its DDP strategy prepares DDP's
# reducer (prepare_for_backward, the forward redirection, the static-graph flush) and unwraps the model at teardown.
class DDPStrategy(TrainerAdapter, LightningDDPStrategy):
    """DDP for ``lightning.Trainer``, on CUDA (nccl) and CPU (gloo); gradient compression hooks on CPU too
    (Lightning's own register on CUDA only). Checkpoints are the one disttrain layout."""

    strategy_name = "disttrain_ddp"
    engine_cls = DDPEngine

    # BEGIN generated options: tools/strategy_signatures.py --write, from DDPOptions (edit the dataclass)
    @checked_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision_plugin: Optional[Precision] = None,
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
        arguments the Trainer sets.

        Args:
            accelerator: set by the Trainer from its ``accelerator``.
            parallel_devices: set by the Trainer from its ``devices``.
            cluster_environment: set by the Trainer (torchrun, SLURM, ...).
            precision_plugin: set by the Trainer from its ``precision``.
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
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
                           timeout, options)
    # END generated options

    def _init_adapter(self, accelerator: Any, parallel_devices: Any, cluster_environment: Any, precision_plugin: Any,
                      process_group_backend: Any, timeout: Any, options: dict[str, Any]) -> None:
        self._init_engine(options)
        self._watchdog_timeout, collective = split_timeout(timeout)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=collective,
                         **self.engine.options.ddp_kwargs())

    def setup_distributed(self) -> None:
        super().setup_distributed()
        after_process_group(self)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return self.engine.setup(model, self.root_device, self.precision_plugin.precision)[0]

    def _register_ddp_hooks(self) -> None:
        pass  # the engine installed the compression hook when it wrapped the model
