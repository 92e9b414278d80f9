"""``disttrain_zero3`` / ``disttrain_zero3_offload`` for the Lightning Trainer: Lightning's DeepSpeed strategy over
our ZeRO engine (CPU support, a config whose batch settings always agree, the one checkpoint layout)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from disttrain._lightning import DeepSpeedPlumbing, checked_options, layer_sync_request
from disttrain.parallel.engines.zero import ZeroEngine
from disttrain.strategies.base import TrainerAdapter, refuse_callbacks

ZERO3_REFUSALS = {
    LearningRateFinder: "DeepSpeed wraps the optimizer in its ZeRO-3 optimizer, which the finder's learning-rate"
    " scheduler cannot drive; find the rate under disttrain_fsdp or disttrain_ddp and pass it to your optimizer",
}


# Lightning's DeepSpeed strategy stays the base: the Trainer gives it DeepSpeedPrecision (an isinstance check),
# whose backward and optimizer step go through DeepSpeed's engine, and ModelSummary (partitioned parameter counts),
# BaseFinetuning, GradientAccumulationScheduler, StochasticWeightAveraging and torch.compile check for it.
class ZeroStrategy(TrainerAdapter, DeepSpeedPlumbing, DeepSpeedStrategy):
    """DeepSpeed ZeRO stage 3 for ``lightning.Trainer``, on CUDA (nccl) and on CPU (gloo).

    Batch size, accumulation, clipping and precision come from the Trainer (so the options ``micro_batch_size`` and
    ``gradient_accumulation_steps``, Fabric's, are refused here). ``configure_model`` runs under
    ``deepspeed.zero.Init``: no rank materialises the whole model.
    """

    strategy_name = "disttrain_zero3"
    engine_cls = ZeroEngine
    options_from_elsewhere = {
        "micro_batch_size": "a Fabric option of disttrain_zero3: under the Trainer it comes from the training"
                            " DataLoader's batch_size",
        "gradient_accumulation_steps": "a Fabric option of disttrain_zero3: under the Trainer it comes from"
                                       " Trainer(accumulate_grad_batches=...)"}

    # BEGIN generated options: tools/strategy_signatures.py --write, from ZeroOptions (edit the dataclass)
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
        stage: int = 3,
        offload_optimizer: Optional[str] = None,
        offload_parameters: Optional[str] = None,
        nvme_path: str = '/local_nvme',
        config: Union[dict, str, None] = None,
        cpu_adam: Optional[bool] = None,
        extensions_dir: Optional[str] = None,
        broadcast_buffers: bool = True,
        sync_batchnorm: bool = False,
        async_checkpoint: bool = False,
    ) -> None:
        """The options of ``disttrain_zero3`` as keywords (:class:`~disttrain.parallel.engines.deepspeed.ZeroOptions`),
        after the arguments the Trainer sets.

        Args:
            accelerator: set by the Trainer from its ``accelerator``.
            parallel_devices: set by the Trainer from its ``devices``.
            cluster_environment: set by the Trainer (torchrun, SLURM, ...).
            precision_plugin: set by the Trainer from its ``precision``.
            process_group_backend: "gloo" or "nccl"; default: the devices' own.
            timeout: seconds (or a ``timedelta``) a process may stay silent before every process ends the run; a
                collective waits a few seconds longer. Default: ``$DISTTRAIN_TIMEOUT``, else 600.
            stage: the ZeRO stage (each name sets its own): 1 partitions the optimizer state and fp32 master weights
                over the ranks, 2 the gradients too, 3 the parameters too (built under ``deepspeed.zero.Init``).
            offload_optimizer: None, "cpu" or "nvme": where optimizer state and fp32 master weights live ("nvme": stage
                3).
            offload_parameters: None, "cpu" or "nvme": where parameters live between uses (stage 3).
            nvme_path: a folder on a fast local disk, for "nvme" offload.
            config: a DeepSpeed config (dict or JSON file) merged with ours; e.g. bucket sizes. A value that contradicts
                the Trainer/Fabric settings (batch sizes, accumulation, clipping, precision, stage) is an error.
            cpu_adam: use DeepSpeedCPUAdam for an offloaded optimizer (the user's Adam/AdamW hyper-parameters are kept).
                None = on GPU yes (fast), on CPU no (the torch optimizer runs on the CPU anyway, and DeepSpeedCPUAdam
                costs a ~2.5-minute JIT build the first time).
            extensions_dir: where DeepSpeed JIT-builds ops such as CPU Adam (TORCH_EXTENSIONS_DIR); reuse it to build
                once.
            broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the ranks: rank 0's after every
                training forward, as DDP's ``broadcast_buffers=True`` does; False lets each rank keep its own.
            sync_batchnorm: BatchNorm layers as SyncBatchNorm (GPU only, as under DDP); the Trainer's
                ``sync_batchnorm=True`` does the same.
            async_checkpoint: not offered here (refused): DCP's host-memory staging cannot copy the ShardedTensors that
                hold DeepSpeed's partitions; disttrain_fsdp (the same ZeRO-3 sharding) offers it.
        """
        options = {"stage": stage, "offload_optimizer": offload_optimizer, "offload_parameters": offload_parameters,
                   "nvme_path": nvme_path, "config": config, "cpu_adam": cpu_adam, "extensions_dir": extensions_dir,
                   "broadcast_buffers": broadcast_buffers, "sync_batchnorm": sync_batchnorm,
                   "async_checkpoint": async_checkpoint}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
                           timeout, options)
    # END generated options

    def _init_adapter(self, accelerator: Any, parallel_devices: Any, cluster_environment: Any, precision_plugin: Any,
                      process_group_backend: Any, timeout: Any, options: dict[str, Any]) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=self._split_timeout(timeout),
                         **self._deepspeed_init_kwargs(options))

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips Lightning's "DeepSpeed needs CUDA" check

    def setup_distributed(self) -> None:
        self._start_deepspeed(self.set_world_ranks)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        refuse_callbacks(trainer, self.strategy_name, ZERO3_REFUSALS)
        asked, convert = layer_sync_request(self._layer_sync)
        self.model = self.engine.prepare(self.model, self.root_device, trainer.state.fn == TrainerFn.FITTING,
                                         asked, convert)
        super().setup(trainer)
        self.engine.broadcast_buffers(self.model)  # DDP starts every rank from rank 0's buffers too

    def _format_config(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self.config = self.engine.configure(
            self.precision_plugin.precision, micro_batch_size=self._micro_batch_size(),
            accumulation=trainer.accumulate_grad_batches if trainer is not None else 1, world_size=self.world_size,
            gradient_clipping=trainer.gradient_clip_val if trainer is not None else None, device=self.root_device)

    def _micro_batch_size(self) -> int:
        """The training DataLoader's batch size; 1 for pre-batched data (``batch_size=None``), where DeepSpeed uses
        it only for throughput reporting."""
        source = self.lightning_module.trainer.fit_loop._data_source if self.lightning_module is not None else None
        if source is None or not source.is_defined():
            return 1
        sampler = getattr(source.dataloader(), "batch_sampler", None)
        return getattr(sampler, "batch_size", None) or 1

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        engine, zero_optimizer, _ = self.engine.initialize(model, optimizer, lr_scheduler, self.root_device)
        return engine, zero_optimizer

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # The Trainer already divided the loss by accumulate_grad_batches; DeepSpeed's engine would divide it by
        # gradient_accumulation_steps again (gradients 1/steps too small; Adam hides it, SGD does not).
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)
