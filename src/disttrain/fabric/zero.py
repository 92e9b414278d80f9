"""``disttrain_zero3`` / ``disttrain_zero3_offload`` for Lightning Fabric: Lightning's DeepSpeed strategy,
changed only where it refuses CPU or builds a config whose batch settings can disagree."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as _LightningDeepSpeed
from lightning.fabric.utilities.seed import reset_seed
from torch import nn

from disttrain._lightning import ZeroPlumbing, register_names
from disttrain.parallel.checkpoint import check_checkpoint
from disttrain.parallel.options import build_options
from disttrain.parallel.recsys import refuse_torchrec_tables
from disttrain.parallel.zero import (
    ZeroOptions,
    export_zero3,
    is_zero_checkpoint,
    load_zero3_checkpoint,
    save_zero3_checkpoint,
    set_extensions_dir,
)


class ZeroStrategy(ZeroPlumbing, _LightningDeepSpeed):
    """DeepSpeed ZeRO stage 3 for ``lightning.Fabric``; the same options as the Trainer strategy, plus
    ``micro_batch_size`` and ``gradient_accumulation_steps`` (Fabric has no DataLoader to read them from).
    ``fabric.init_module(empty_init=True)`` builds under ``deepspeed.zero.Init``."""

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

    def _format_config(self) -> None:
        self.config = self._build_zero_config(self.precision.precision,
                                              micro_batch_size=self.zero_options.micro_batch_size,
                                              accumulation=self.zero_options.gradient_accumulation_steps,
                                              gradient_clipping=None)

    def _initialize_engine(self, model: Any, optimizer: Any = None, scheduler: Any = None) -> Any:
        refuse_torchrec_tables(model, self.strategy_name)
        return super()._initialize_engine(model, self._maybe_cpu_adam(optimizer), scheduler)

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
