"""``disttrain_recsys`` for Lightning Fabric: an adapter over RecsysEngine (torchrec DMP)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torch.optim import Optimizer

from disttrain._lightning import DEFAULT_TIMEOUT, DistributedPlumbing
from disttrain.parallel.checkpoint import restore_rest, the_model
from disttrain.parallel.options import build_options
from disttrain.parallel.recsys import RecsysEngine, RecsysOptions, dense_parameters


class RecsysStrategy(DistributedPlumbing, ParallelStrategy):
    """torchrec DistributedModelParallel for ``lightning.Fabric``; the same options as
    :class:`disttrain.strategies.RecsysStrategy`. ``fabric.setup(model, dense_optimizer)`` shards the model's
    tables; create the dense optimizer over ``disttrain.parallel.recsys.dense_parameters(model)`` (the tables'
    optimizer is fused into backward). ``fabric.save``/``fabric.load`` write/read DCP folders with the table
    shards and the fused optimizer state."""

    strategy_name = "disttrain_recsys"
    _launcher_cls = _SubprocessScriptLauncher

    def __init__(self, accelerator: Optional[Any] = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[Any] = None, precision: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
                 **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self._init_common(RecsysEngine(build_options(RecsysOptions, self.strategy_name, options)),
                          process_group_backend, timeout)

    def setup_module(self, module: nn.Module) -> nn.Module:
        return self.engine.parallelize(module, self.root_device, whole=True)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        dense = {id(p) for p in dense_parameters(module)}
        for optimizer in optimizers:
            if any(id(p) not in dense for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("the optimizer covers embedding-table parameters; under disttrain_recsys the tables"
                                 " have a fused optimizer: create it over"
                                 " disttrain.parallel.recsys.dense_parameters(model)")
        return self.setup_module(module), optimizers, scheduler

    def module_to_device(self, module: nn.Module) -> None:
        pass  # DMP placed the shards and the dense part

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        return nullcontext()

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(self, path: Any, state: dict[str, Union[nn.Module, Optimizer, Any]],
                        storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        model = the_model(state)
        metadata = {k: (v.state_dict() if callable(getattr(v, "state_dict", None)) else v)
                    for k, v in state.items() if v is not model}
        self.engine.save(self.broadcast(path), model, metadata)

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore the model's shards and fused optimizer state, then the dense optimizer and other stateful
        objects of ``state``, in place; returns what ``state`` did not ask for."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not state:
            raise ValueError("load_checkpoint needs state={'model': model, ...} naming at least the model to restore")
        model = the_model(state)
        metadata = self.engine.load(self.broadcast(path), model, strict=strict)
        return restore_rest(state, {k: v for k, v in state.items() if v is model}, metadata)

