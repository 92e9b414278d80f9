"""``disttrain_zero3`` / ``disttrain_zero3_offload`` for Lightning Fabric: Lightning's DeepSpeed strategy over our
ZeRO engine (CPU support, a config whose batch settings always agree, the one checkpoint layout)."""

from __future__ import annotations

from typing import Any, Union

from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from torch.optim import Optimizer
from typing_extensions import override

from disttrain._lightning import DeepSpeedPlumbing
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
    norm.
    """

    strategy_name = "disttrain_zero3"
    engine_cls = ZeroEngine

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision: Any = None, process_group_backend: Any = None, timeout: Any = None,
                 **options: Any) -> None:
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
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        engine = self._deepspeed_engine
        stepping = engine is not None and engine.is_gradient_accumulation_boundary()
        output = super().optimizer_step(optimizer, **kwargs)
        if stepping:
            self.engine.after_optimizer_step(engine)
        return output
