"""``disttrain_zero3`` / ``disttrain_zero3_offload`` for the Lightning Trainer: Lightning's DeepSpeed strategy over
our ZeRO engine (CPU support, a config whose batch settings always agree, the one checkpoint layout)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from disttrain._lightning import DeepSpeedPlumbing, layer_sync_request
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

    Options as keywords (:class:`disttrain.parallel.engines.deepspeed.ZeroOptions`): ``offload_optimizer``,
    ``offload_parameters`` ("cpu" or "nvme"), ``nvme_path``, ``config`` (a ds_config merged with ours),
    ``cpu_adam``, ``extensions_dir``. Batch size, accumulation, clipping and precision come from the Trainer.
    ``configure_model`` runs under ``deepspeed.zero.Init``: no rank materialises the whole model.
    """

    strategy_name = "disttrain_zero3"
    engine_cls = ZeroEngine

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision_plugin: Any = None, process_group_backend: Any = None, timeout: Any = None,
                 **options: Any) -> None:
        for name, source in (("micro_batch_size", "the training DataLoader's batch_size"),
                             ("gradient_accumulation_steps", "Trainer(accumulate_grad_batches=...)")):
            if name in options:
                raise TypeError(f"{name}={options[name]!r} is a Fabric option of {self.strategy_name}: under the"
                                f" Trainer it comes from {source}; remove {name}")
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
