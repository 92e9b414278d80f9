"""``disttrain_ddp`` for Lightning Fabric: Lightning's DDP plus our compression hooks, on CPU too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.strategies import DDPStrategy as _LightningDDP
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from disttrain._lightning import register_names
from disttrain.parallel.checkpoint import (
    export_safetensors,
    is_sharded_checkpoint,
    load_sharded,
    restore_rest,
    save_sharded,
    split_state,
    the_model,
)
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

    @contextmanager
    def full_model(self, module: nn.Module) -> Iterator[nn.Module]:
        """The sharded strategies' ``with fabric.strategy.full_model(model): y = model(x)``, so such code runs
        unchanged under DDP: every rank already holds the whole model; this only enters ``torch.no_grad()``."""
        with torch.no_grad():
            yield module

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict] = None) -> None:
        """The one disttrain layout (a DCP folder, tensors by FQN, written atomically), which every disttrain
        strategy loads at any world size."""
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        tensors, metadata = split_state(state, the_model(state))
        save_sharded(self.broadcast(path), tensors, metadata)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore a disttrain checkpoint folder of any strategy and world size; a single file (Lightning's own
        DDP format) is loaded as Lightning does."""
        path = self.broadcast(path)
        if not is_sharded_checkpoint(path) or isinstance(state, (nn.Module, Optimizer)):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not state:
            raise ValueError("load_checkpoint needs state={'model': model, ...} naming at least the model to restore")
        targets = {k: v for k, v in state.items() if isinstance(v, (nn.Module, Optimizer))}
        metadata = load_sharded(path, targets, the_model(state), strict=strict, weights_only=weights_only is not False)
        return restore_rest(state, targets, metadata)

    def export_full(self, module: nn.Module, path: Any, prefix: str = "") -> Path:
        """The full model as one safetensors file (rank 0)."""
        return export_safetensors(getattr(module, "module", module), path, prefix=prefix)
