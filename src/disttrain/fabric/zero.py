"""``disttrain_zero3`` / ``disttrain_zero3_offload`` for Lightning Fabric: Lightning's DeepSpeed strategy over our
ZeRO engine (CPU support, a config whose batch settings always agree, the one checkpoint layout)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from torch.optim import Optimizer
from typing_extensions import override

from disttrain._lightning import DeepSpeedPlumbing, checked_options
from disttrain.fabric.base import FabricAdapter
from disttrain.parallel.engines.zero import ZeroEngine
from disttrain.patches import allow_setup_optimizers_after


# Lightning's DeepSpeed strategy stays the base: Fabric runs backward through the DeepSpeed engine for it (and asks
# which model to step when several are set up), and the Trainer-side callbacks check for its class.
class ZeroStrategy(FabricAdapter, DeepSpeedPlumbing, DeepSpeedStrategy):
    """DeepSpeed ZeRO stage 3 for ``lightning.Fabric``; the same options as the Trainer strategy, plus
    ``micro_batch_size`` and ``gradient_accumulation_steps`` (Fabric has no DataLoader to read them from).
    ``fabric.init_module(empty_init=True)`` builds under ``deepspeed.zero.Init``.

    Both set-up forms work: ``model, optimizer = fabric.setup(model, optimizer)``, and ``model =
    fabric.setup_module(model)`` then ``optimizer = fabric.setup_optimizers(optimizer)`` (litgpt's form: the optimizer
    is made from the partitioned parameters). ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips by the
    whole model's gradient 2-norm with DeepSpeed's own clipping, in the next ``optimizer.step()``, and returns that
    norm. With ``gradient_accumulation_steps=N``, call ``optimizer.step()`` after every N ``fabric.backward(loss)``
    (the loss undivided: DeepSpeed divides it); another count is an error.
    """

    strategy_name = "disttrain_zero3"
    engine_cls = ZeroEngine

    # BEGIN generated options: tools/strategy_signatures.py --write, from ZeroOptions (edit the dataclass)
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
        stage: int = 3,
        offload_optimizer: Optional[str] = None,
        offload_parameters: Optional[str] = None,
        nvme_path: str = '/local_nvme',
        config: Union[dict, str, None] = None,
        cpu_adam: Optional[bool] = None,
        extensions_dir: Optional[str] = None,
        micro_batch_size: int = 1,
        gradient_accumulation_steps: int = 1,
        broadcast_buffers: bool = True,
        sync_batchnorm: bool = False,
        async_checkpoint: bool = False,
    ) -> None:
        """The options of ``disttrain_zero3`` as keywords (:class:`~disttrain.parallel.engines.deepspeed.ZeroOptions`),
        after the arguments Fabric sets.

        Args:
            accelerator: set by Fabric from its ``accelerator``.
            parallel_devices: set by Fabric from its ``devices``.
            cluster_environment: set by Fabric (torchrun, SLURM, ...).
            precision: set by Fabric from its ``precision``.
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
            micro_batch_size: Fabric only (the Trainer reads its DataLoader and ``accumulate_grad_batches``, and refuses
                these). Under Fabric, call ``optimizer.step()`` after every ``gradient_accumulation_steps`` calls of
                ``fabric.backward(loss)`` (DeepSpeed divides each loss by it).
            gradient_accumulation_steps: Fabric only (the Trainer reads its DataLoader and ``accumulate_grad_batches``,
                and refuses these). Under Fabric, call ``optimizer.step()`` after every ``gradient_accumulation_steps``
                calls of ``fabric.backward(loss)`` (DeepSpeed divides each loss by it).
            broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the ranks: rank 0's after every
                training forward, as DDP's ``broadcast_buffers=True`` does; False lets each rank keep its own.
            sync_batchnorm: BatchNorm layers as SyncBatchNorm (GPU only, as under DDP); the Trainer's
                ``sync_batchnorm=True`` does the same.
            async_checkpoint: not offered here (refused): DCP's host-memory staging cannot copy the ShardedTensors that
                hold DeepSpeed's partitions; disttrain_fsdp (the same ZeRO-3 sharding) offers it.
        """
        options = {"stage": stage, "offload_optimizer": offload_optimizer, "offload_parameters": offload_parameters,
                   "nvme_path": nvme_path, "config": config, "cpu_adam": cpu_adam, "extensions_dir": extensions_dir,
                   "micro_batch_size": micro_batch_size, "gradient_accumulation_steps": gradient_accumulation_steps,
                   "broadcast_buffers": broadcast_buffers, "sync_batchnorm": sync_batchnorm,
                   "async_checkpoint": async_checkpoint}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision, process_group_backend,
                           timeout, options)
    # END generated options

    def _init_adapter(self, accelerator: Any, parallel_devices: Any, cluster_environment: Any, precision: Any,
                      process_group_backend: Any, timeout: Any, options: dict[str, Any]) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, timeout=self._split_timeout(timeout),
                         **self._deepspeed_init_kwargs(options))

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips Lightning's "DeepSpeed needs CUDA" check

    def _setup_distributed(self) -> None:
        self._start_deepspeed(self._set_world_ranks)
        self._format_config()
        self._config_initialized = True
        allow_setup_optimizers_after(ZeroStrategy)

    def _format_config(self) -> None:
        options = self.engine.options
        self.config = self.engine.configure(self.precision.precision, options.micro_batch_size,
                                               options.gradient_accumulation_steps, self.world_size, None,
                                               self.root_device)

    def _initialize_engine(self, model: Any, optimizer: Any = None, scheduler: Any = None) -> Any:
        engine, optimizers = self.engine.setup(model, self.root_device, self.precision.precision,
                                               [optimizer] if optimizer is not None else [], scheduler=scheduler)
        self.engine.sync_buffers_after_forward(engine)
        return engine, optimizers[0] if optimizers else None, engine.lr_scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Any:
        """``fabric.setup_optimizers(optimizer)`` after ``fabric.setup_module(model)``: the ZeRO-3 optimizer over the
        partitioned parameters, attached to the engine ``setup_module`` made (DeepSpeed takes one per model)."""
        if self._deepspeed_engine is None:
            raise RuntimeError(f"{self.strategy_name}: fabric.setup_optimizers needs the model first; call model ="
                               " fabric.setup_module(model), make the optimizer from model.parameters(), then"
                               " fabric.setup_optimizers(optimizer) (or fabric.setup(model, optimizer) at once)")
        zero_optimizer = self.engine.setup_optimizer(self._deepspeed_engine, optimizer, self.root_device)
        self._set_deepspeed_activation_checkpointing()
        return zero_optimizer

    @override
    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: Union[float, int]) -> None:
        raise NotImplementedError(f"{self.strategy_name} clips with DeepSpeed, by norm only: use"
                                  f" fabric.clip_gradients(model, optimizer, max_norm={clip_val}) instead of clip_val")

    @override
    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        # Fabric passes the DeepSpeed engine the loss belongs to; optimizer.step() will not call its step(), so
        # DeepSpeed learns from here which backward ends an accumulation window.
        if module is not None:
            self.engine.mark_backward(module)
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        engine = self._deepspeed_engine
        if engine is not None:
            self.engine.check_window(engine)
        stepping = engine is not None and engine.is_gradient_accumulation_boundary()
        output = super().optimizer_step(optimizer, **kwargs)
        if stepping:
            self.engine.after_optimizer_step(engine)
        return output
