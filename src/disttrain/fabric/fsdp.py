"""``disttrain_fsdp`` / ``disttrain_fsdp_offload`` for Lightning Fabric: an adapter over FSDPEngine."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer

from disttrain._lightning import DEFAULT_TIMEOUT, DistributedPlumbing, fsdp2_mixed_precision_class, to_fsdp2_precision
from disttrain.parallel.checkpoint import restore_rest, split_state, the_model
from disttrain.parallel.engine import FSDPEngine, reshard
from disttrain.parallel.fsdp import FSDPOptions, set_gradient_sync
from disttrain.parallel.options import build_options

FSDP2MixedPrecision = fsdp2_mixed_precision_class(MixedPrecision)
# fully_shard shards the module in place, so Fabric has no wrapper to redirect a LightningModule's step methods
# through forward: FSDP2 itself must gather the root's parameters around them (as the Trainer adapter does).
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class _GradientSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: skip FSDP2's reduce-scatter on non-final accumulation steps."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        stack = ExitStack()
        if enabled:
            set_gradient_sync(module, False)
            stack.callback(set_gradient_sync, module, True)
        return stack


class FSDPStrategy(DistributedPlumbing, ParallelStrategy):
    """FSDP2 for ``lightning.Fabric``; runs on CUDA (nccl) and on CPU (gloo).

    Options as keywords, the same as the Trainer strategy (:class:`disttrain.parallel.fsdp.FSDPOptions`).
    ``fabric.init_module(empty_init=True)`` builds on the meta device; ``fabric.setup`` shards and initialises.
    """

    strategy_name = "disttrain_fsdp"
    _launcher_cls = _SubprocessScriptLauncher
    _engine_cls, _options_cls = FSDPEngine, FSDPOptions  # disttrain_megatron swaps in its own

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self._init_common(self._engine_cls(build_options(self._options_cls, self.strategy_name, options)),
                          process_group_backend, timeout)
        self._backward_sync_control = _GradientSyncControl()

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = to_fsdp2_precision(precision, MixedPrecision, FSDP2MixedPrecision)

    @property
    def device_mesh(self) -> Any:
        return self.engine.mesh

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.engine.parallelize(self.engine.convert_batchnorm(module), self.root_device,
                                         self.precision.precision, forward_methods=_STEP_METHODS)
        return self._keep_buffers_in_sync(module)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        module = self.engine.parallelize_with_optimizers(self.engine.convert_batchnorm(module), optimizers,
                                                         self.root_device, self.precision.precision, _STEP_METHODS)
        return self._keep_buffers_in_sync(module), optimizers, scheduler

    def _keep_buffers_in_sync(self, module: nn.Module) -> nn.Module:
        """BatchNorm statistics as DDP keeps them: every rank starts from and, after each training forward, holds
        the first data-parallel rank's buffers."""
        self.engine.settle_buffers(module, self.root_device, self.strategy_name)
        self.engine.broadcast_buffers_after_forward(module)
        return module

    def module_to_device(self, module: nn.Module) -> None:
        pass  # setup_module placed the shards

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(self.engine.init_context(empty_init))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return self.engine.clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type,
                                           error_if_nonfinite)

    def full_model(self, module: nn.Module) -> AbstractContextManager[nn.Module]:
        """Collective, on every rank: ``with fabric.strategy.full_model(model): y = model(x)``. Inside the block every
        rank holds the full parameters and ``model``, or any part of it, can be called on any rank without
        communication, under ``torch.no_grad()``; shards are restored on exit. Yields ``module``."""
        return self.engine.full_model(module)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(self, path: Any, state: dict[str, Union[nn.Module, Optimizer, Any]],
                        storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        path = self.broadcast(path)
        reshard(the_model(state))  # after a validation the last block may still hold its gathered parameters
        tensors, metadata = split_state(state, the_model(state), full=not self.engine.sharded)
        self.engine.save(path, tensors, metadata)

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore modules, optimizers and stateful objects of ``state`` in place; returns what ``state`` did not
        ask for."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not state:
            raise ValueError("load_checkpoint needs state={'model': model, ...} naming at least the model to restore")
        path = self.broadcast(path)
        targets = {k: v for k, v in state.items() if isinstance(v, (nn.Module, Optimizer))}
        metadata = self.engine.load(path, targets, the_model(state), strict=strict, weights_only=weights_only)
        return restore_rest(state, targets, metadata)

    def export_full(self, module: nn.Module, path: Any, prefix: str = "") -> Path:
        """Write the full model as one safetensors file (rank 0) that loads into the unwrapped model."""
        return self.engine.export(getattr(module, "module", module), path, prefix=prefix)

