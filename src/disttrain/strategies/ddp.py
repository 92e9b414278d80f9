"""``disttrain_ddp`` for the Lightning Trainer: Lightning's DDP plus our compression hooks, on CPU too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as _LightningDDP

from disttrain._lightning import register_names
from disttrain.parallel.checkpoint import export_safetensors
from disttrain.parallel.ddp import DDPOptions, register_compression
from disttrain.parallel.options import build_options
from disttrain.parallel.recsys import refuse_torchrec_tables


class DDPStrategy(_LightningDDP):
    """DDP for ``lightning.Trainer``. Options (see :class:`disttrain.parallel.ddp.DDPOptions`):
    ``gradient_compression`` ("fp16", "bf16", "powersgd"), ``powersgd_rank``, ``powersgd_start_iter``,
    ``find_unused_parameters``, ``static_graph``. Lightning's own hooks only register on CUDA; ours also on CPU."""

    strategy_name = "disttrain_ddp"
    register_strategies = classmethod(register_names)

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision_plugin: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        self.ddp_options = build_options(DDPOptions, self.strategy_name, options)
        self._module_transforms: list = []
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, **self.ddp_options.ddp_kwargs())

    def add_module_transform(self, transform: Any) -> None:
        """Run ``transform(model)`` on the plain model right before DDP wraps it (used by the FP8 callback)."""
        self._module_transforms.append(transform)

    def _setup_model(self, model: Any) -> Any:
        refuse_torchrec_tables(model, self.strategy_name)
        for transform in self._module_transforms:
            transform(model)
        return super()._setup_model(model)

    def _register_ddp_hooks(self) -> None:
        register_compression(self.model, self.ddp_options)

    def export_full(self, path: Any, prefix: str = "") -> Path:
        """The full model as one safetensors file (rank 0); ``prefix`` as in the FSDP strategy."""
        return export_safetensors(self.lightning_module, path, prefix=prefix)
