"""``disttrain_ddp`` for Lightning Fabric: Lightning's DDP plus our compression hooks, on CPU too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.strategies import DDPStrategy as _LightningDDP
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain._lightning import register_names
from disttrain.parallel.checkpoint import export_safetensors
from disttrain.parallel.ddp import DDPOptions, register_compression
from disttrain.parallel.options import build_options
from disttrain.parallel.recsys import refuse_torchrec_tables


class DDPStrategy(_LightningDDP):
    """DDP for ``lightning.Fabric``; the same options as :class:`disttrain.strategies.DDPStrategy`."""

    strategy_name = "disttrain_ddp"
    register_strategies = classmethod(register_names)

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        self.ddp_options = build_options(DDPOptions, self.strategy_name, options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, **self.ddp_options.ddp_kwargs())

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        refuse_torchrec_tables(module, self.strategy_name)
        ddp = super().setup_module(module)
        register_compression(ddp, self.ddp_options)
        return ddp

    def export_full(self, module: nn.Module, path: Any, prefix: str = "") -> Path:
        """The full model as one safetensors file (rank 0)."""
        return export_safetensors(getattr(module, "module", module), path, prefix=prefix)
