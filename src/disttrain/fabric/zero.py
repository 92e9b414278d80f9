"""``disttrain_zero3`` / ``disttrain_zero3_offload`` for Lightning Fabric: Lightning's DeepSpeed strategy,
changed only where it refuses CPU or builds a config whose batch settings can disagree."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as _LightningDeepSpeed
from lightning.fabric.utilities.seed import reset_seed
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from disttrain._lightning import ZeroPlumbing, register_names
from disttrain.parallel.buffers import sync_buffers_after_forward
from disttrain.parallel.checkpoint import check_checkpoint
from disttrain.parallel.options import build_options
from disttrain.parallel.recsys import refuse_torchrec_tables
from disttrain.parallel.zero import (
    ZeroOptions,
    attach_zero3_optimizer,
    export_zero3,
    is_zero_checkpoint,
    load_zero3_checkpoint,
    save_zero3_checkpoint,
    set_extensions_dir,
    zero3_grad_norm,
)


class ZeroStrategy(ZeroPlumbing, _LightningDeepSpeed):
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
    register_strategies = classmethod(register_names)

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        self.zero_options = build_options(ZeroOptions, self.strategy_name, options)
        set_extensions_dir(self.zero_options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, stage=3, config={},
                         remote_device=self.zero_options.offload_parameters)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips Lightning's "DeepSpeed needs CUDA" check

    def _setup_distributed(self) -> None:
        self._validate_devices()
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        self._format_config()
        self._config_initialized = True
        _allow_setup_optimizers_after_setup_module()

    def _format_config(self) -> None:
        self.config = self._build_zero_config(self.precision.precision,
                                              micro_batch_size=self.zero_options.micro_batch_size,
                                              accumulation=self.zero_options.gradient_accumulation_steps,
                                              gradient_clipping=None)

    def _initialize_engine(self, model: Any, optimizer: Any = None, scheduler: Any = None) -> Any:
        refuse_torchrec_tables(model, self.strategy_name)
        model = self._prepare_batchnorm(model, training=True)
        engine, zero_optimizer, scheduler = super()._initialize_engine(model, self._maybe_cpu_adam(optimizer),
                                                                       scheduler)
        self._broadcast_buffers(engine.module)
        if self.zero_options.broadcast_buffers:
            sync_buffers_after_forward(engine)
        return engine, zero_optimizer, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Any:
        """``fabric.setup_optimizers(optimizer)`` after ``fabric.setup_module(model)``: the ZeRO-3 optimizer over the
        partitioned parameters, attached to the engine ``setup_module`` made (DeepSpeed takes one per model)."""
        engine = self._deepspeed_engine
        if engine is None:
            raise RuntimeError(f"{self.strategy_name}: fabric.setup_optimizers needs the model first; call model ="
                               " fabric.setup_module(model), make the optimizer from model.parameters(), then"
                               " fabric.setup_optimizers(optimizer) (or fabric.setup(model, optimizer) at once)")
        own = {id(p) for p in engine.module.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(f"{self.strategy_name}: the optimizer holds parameters that are not the last model set"
                             " up with fabric.setup_module; make it from that model's parameters, right after"
                             " setting it up")
        zero_optimizer = attach_zero3_optimizer(engine, self._maybe_cpu_adam(optimizer))
        self._set_deepspeed_activation_checkpointing()
        return zero_optimizer

    # -- gradient clipping by DeepSpeed ---------------------------------------------------------------------
    @override
    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Returns the whole model's gradient 2-norm and has DeepSpeed clip to ``max_norm`` in the next optimizer
        step (its ZeRO-3 optimizer computes the same norm there and scales the fp32 gradient partitions)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: {self.strategy_name} clips with DeepSpeed, by the 2-norm only;"
                             " pass norm_type=2")
        zero_optimizer = getattr(module, "optimizer", None)  # the DeepSpeedEngine's
        if zero_optimizer is None or not hasattr(zero_optimizer, "clip_grad"):
            raise RuntimeError(f"{self.strategy_name}: fabric.clip_gradients needs the optimizer set up with the model"
                               " (fabric.setup(model, optimizer) or fabric.setup_optimizers(optimizer))")
        norm = zero3_grad_norm(zero_optimizer)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({norm.item()}), so it"
                               " cannot be clipped; pass error_if_nonfinite=False to let DeepSpeed skip the step")
        zero_optimizer.clip_grad = float(max_norm)
        return norm

    @override
    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: Union[float, int]) -> None:
        raise NotImplementedError(f"{self.strategy_name} clips with DeepSpeed, by norm only: use"
                                  f" fabric.clip_gradients(model, optimizer, max_norm={clip_val}) instead of clip_val")

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        engine = self._deepspeed_engine
        stepping = engine is not None and engine.is_gradient_accumulation_boundary()
        output = super().optimizer_step(optimizer, **kwargs)
        if stepping and hasattr(engine.optimizer, "clip_grad"):
            engine.optimizer.clip_grad = engine.gradient_clipping()  # clip_gradients holds for one step
        return output

    def save_checkpoint(self, path: Any, state: dict, storage_options: Optional[Any] = None,
                        filter: Optional[dict] = None) -> None:
        """Writes the one disttrain layout (a DCP folder, parameters and optimizer state by FQN, each rank writing
        only its partitions) that every disttrain strategy reads at any world size; see
        :func:`disttrain.parallel.zero.zero3_model_state`."""
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        save_zero3_checkpoint(self.broadcast(path), state)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restores a disttrain checkpoint of any strategy and world size, each rank reading only what its
        partitions need; a DeepSpeed folder (written by
        disttrain before 0.2 or by DeepSpeed itself) is still read by DeepSpeed, at the world size it was saved."""
        path = Path(self.broadcast(path))
        if is_zero_checkpoint(path):
            return super().load_checkpoint(check_checkpoint(path, layout="zero"), state, strict, weights_only)
        if isinstance(state, nn.Module):
            state = {"model": state}
        return load_zero3_checkpoint(path, state or {}, strict=strict, weights_only=weights_only is not False)

    def export_full(self, module: nn.Module, path: Any, prefix: str = "") -> Path:
        """The full model (in its training dtype) as one safetensors file (rank 0)."""
        module = getattr(module, "module", module)  # _FabricModule -> DeepSpeedEngine -> the user's module
        return export_zero3(getattr(module, "module", module), path, prefix=prefix)


def _allow_setup_optimizers_after_setup_module() -> None:
    """Fabric refuses ``fabric.setup_optimizers`` for every DeepSpeed strategy (Lightning's needs the model and the
    optimizer in one call); this one attaches the optimizer to the engine ``setup_module`` made. For it, Fabric's
    other checks (launched, at least one optimizer, not set up twice, no meta tensors) still run; every other
    strategy keeps Fabric's validation as it is. Installed once, when the first process group starts."""
    from lightning.fabric import Fabric

    original = Fabric._validate_setup_optimizers
    if getattr(original, "_disttrain_zero3", False):
        return

    @functools.wraps(original)
    def validate(fabric: Any, optimizers: Any) -> None:
        strategy = fabric._strategy
        if not isinstance(strategy, ZeroStrategy):
            return original(fabric, optimizers)
        fabric._strategy = None  # a strategy of no particular kind: Fabric checks all but the DeepSpeed refusal
        try:
            return original(fabric, optimizers)
        finally:
            fabric._strategy = strategy

    validate._disttrain_zero3 = True  # type: ignore[attr-defined]
    Fabric._validate_setup_optimizers = validate
