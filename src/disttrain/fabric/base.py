"""The one Fabric adapter base: the Lightning plumbing every ``disttrain_*`` Fabric strategy shares, written once
over the strategy's engine (:mod:`disttrain.parallel.engines.base`). A registered strategy is a short subclass naming its
registered strategy and its engine (whose options dataclass it takes), listed in the package's ``ADAPTERS``::

    class FSDPStrategy(EngineStrategy):
        strategy_name = "disttrain_fsdp"
        engine_cls = FSDPEngine

and an ``__init__`` whose keywords are the dataclass's fields, generated from it (``python
tools/strategy_signatures.py --write`` writes it between two marker lines; tests/test_signatures.py fails when it
differs from the dataclass).

:class:`FabricAdapter` holds what every adapter does (checkpoints of the one layout from Fabric's state dict,
clipping, ``full_model``/``export_full``); :class:`EngineStrategy` puts it over Fabric's ``ParallelStrategy`` for
engines that set models up themselves. ZeRO-3 puts it over Lightning's DeepSpeed strategy (see its module).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Union

import torch
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from disttrain._lightning import STEP_METHODS, DistributedPlumbing, EngineAdapter, split_timeout
from disttrain.parallel.checkpoint.frozen import leave_out_frozen_base
from disttrain.parallel.checkpoint.io import restore_rest, the_model
from disttrain.parallel.engines.base import Engine
from disttrain.parallel.engines.precision import sharded_grad_scaler
from disttrain.parallel.guards import watchdog


class FabricAdapter(EngineAdapter):
    """Mixin (before a Lightning Fabric strategy): what every disttrain Fabric strategy does through its engine."""

    precision: Precision

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clips by the norm of the whole model's gradients (every shard, tp rank and pipeline stage); returns it."""
        self.precision.unscale_gradients(optimizer)
        return self.engine.clip_grad_norm_(module, self.precision.main_params(optimizer), max_norm, norm_type,
                                           error_if_nonfinite)

    def full_model(self, module: nn.Module) -> AbstractContextManager[nn.Module]:
        """Collective, on every rank: ``with fabric.strategy.full_model(model): y = model(x)``. Inside the block every
        rank holds the full parameters and ``model``, or any part of it, can be called on any rank without
        communication, under ``torch.no_grad()``; shards are restored on exit. Yields ``module``."""
        return self.engine.full_model(module)

    def export_full(self, module: nn.Module, path: Any, prefix: str = "") -> Path:
        """Write the full model as one safetensors file (rank 0) that loads into the unwrapped model."""
        return self.engine.export(getattr(module, "module", module), path, prefix=prefix)  # Fabric's wrapper off

    def load_pretrained(self, module: nn.Module, folder: Any, prefix: str = "", partial: bool = False,
                        exclude: Collection[str] = ()) -> list[str]:
        """Collective: a Hugging Face folder's (or one safetensors file's) weights into the model ``fabric.setup``
        returned (built empty: ``fabric.init_module(empty_init=True)``), each rank reading only its own slices of the
        safetensors files into its shards (:mod:`disttrain.parallel.checkpoint.pretrained`). ``prefix``: the HF model's path
        inside ``module``; ``partial``: only the tensors the folder has (LoRA adapters' first values); ``exclude``:
        stored tensor names left at their initialisation (a new classifier head)."""
        return self.engine.load_pretrained(getattr(module, "_forward_module", module), folder, prefix=prefix,
                                           partial=partial, exclude=exclude)

    # -- checkpoints: the one layout, from Fabric's state dict ----------------------------------------------------
    def _is_tensor_state(self, value: Any) -> bool:
        """A value of Fabric's state the engine writes as tensors (the model; optimizers by parameter name)."""
        return isinstance(value, nn.Module) or (self.engine.optimizers_by_name and self.engine.is_optimizer(value))

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """One DCP folder (tensors by parameter name, written atomically), which every disttrain strategy loads at
        any world size; stateful objects and plain values of ``state`` go to its ``meta.pt``."""
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        module = the_model(state)
        tensors, metadata = {}, {}
        for key, value in state.items():
            if isinstance(value, nn.Module):
                tensors[key] = self.engine.model_state(value)
            elif self._is_tensor_state(value):
                tensors[key] = self.engine.optimizer_state(module, value)
            else:
                metadata[key] = value.state_dict() if callable(getattr(value, "state_dict", None)) else value
        leave_out_frozen_base(tensors, metadata, {k: v for k, v in state.items() if isinstance(v, nn.Module)})
        self.engine.save_checkpoint(self.broadcast(path), module, tensors, metadata)

    def wait_checkpoint(self) -> None:
        """Collective: block until the checkpoint written in the background (``async_checkpoint=True``) is complete
        and raise its error (a full disk) here; call it once training ends (Fabric has no end-of-run hook). No-op
        for synchronous saves."""
        self.engine.wait_checkpoint()

    def teardown(self) -> None:
        self.engine.wait_checkpoint()
        super().teardown()  # type: ignore[misc]

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore modules, optimizers and stateful objects of ``state`` in place from a disttrain checkpoint of any
        strategy and world size, or one Lightning's own strategies wrote; returns what ``state`` did not ask for.
        What the engine does not read (single files under disttrain_ddp, DeepSpeed folders under disttrain_zero3) is
        loaded as Lightning loads it."""
        path = self.broadcast(path)
        self.engine.wait_checkpoint()  # a checkpoint written in the background exists once it is complete
        if not self.engine.reads_checkpoint(path):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)  # type: ignore
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not state:
            raise ValueError("load_checkpoint needs state={'model': model, ...} naming at least the model to restore")
        targets = {k: v for k, v in state.items() if self._is_tensor_state(v)}
        source = self._lightning_checkpoint(path, the_model(state), targets, trainer=False, weights_only=weights_only)
        metadata = self.engine.load_checkpoint(path, the_model(state), targets, strict=strict,
                                               weights_only=weights_only, source=source)
        return restore_rest(state, targets, metadata)


def use_async_checkpoint(strategy: Any, where: str) -> None:
    """Recipes: turn on ``async_checkpoint`` on the strategy their Fabric runs (named by a launcher or a flag);
    ``where`` names the recipe's setting in the one-line error of a strategy that cannot write in the background."""
    if not isinstance(strategy, FabricAdapter):
        raise ValueError(f"{where}: async checkpoints are written by disttrain_fsdp, disttrain_ddp and"
                         f" disttrain_megatron, not by {type(strategy).__name__}; choose one of them or turn it off")
    strategy.set_async_checkpoint()


def wait_checkpoint(strategy: Any) -> None:
    """Recipes, once training ends: the checkpoint written in the background is complete, or its error raised
    (no-op for synchronous saves and Lightning's own strategies)."""
    if isinstance(strategy, FabricAdapter):
        strategy.wait_checkpoint()


def builds_empty(strategy: Any) -> bool:
    """Whether ``fabric.init_module(empty_init=True)`` gives a trained-from-scratch model under ``strategy``: every
    disttrain strategy builds on the meta device (or under ``deepspeed.zero.Init``) and initialises the weights in
    ``setup`` (or builds as usual), while Lightning's own single-device and DDP strategies leave them as
    uninitialised memory (a NaN loss from the first step). Recipes pass it as ``empty_init``."""
    return isinstance(strategy, FabricAdapter)


class FSDP2MixedPrecision(MixedPrecision):
    """``*-mixed`` under FSDP2: loss scaling kept, autocast dropped (the MixedPrecisionPolicy already runs each block
    in half precision and reduces gradients in fp32)."""

    @override
    def forward_context(self) -> AbstractContextManager:
        return nullcontext()


class _NoSyncByEngine(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the engine's way to skip gradient sync on non-final micro-steps."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.engine.no_sync(module) if enabled else nullcontext()


class EngineStrategy(FabricAdapter, DistributedPlumbing, ParallelStrategy):
    """The base of the Fabric strategies whose engine sets models up (DDP, FSDP, Megatron, recsys); CUDA (nccl) and
    CPU (gloo). Subclasses set ``strategy_name`` and ``engine_cls``; their ``__init__``, generated from the engine's
    options dataclass (tools/strategy_signatures.py), takes the same options as the Trainer strategy's as keywords and
    calls :meth:`_init_adapter`. Optimizers may be created before ``fabric.setup`` or after it."""

    _launcher_cls = _SubprocessScriptLauncher

    def _init_adapter(self, accelerator: Optional[Any], parallel_devices: Optional[list[torch.device]],
                      cluster_environment: Optional[Any], precision: Optional[Precision],
                      process_group_backend: Optional[str], timeout: Any, options: dict[str, Any]) -> None:
        self._init_engine(options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self._process_group_backend = process_group_backend
        self._watchdog_timeout, self._timeout = split_timeout(timeout)
        self._backward_sync_control = _NoSyncByEngine(self.engine)

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        # Lightning picks an autocast plugin for "*-mixed"; an engine that casts itself (FSDP2) must not autocast.
        if self.engine.casts_itself and isinstance(precision, MixedPrecision) and \
                not isinstance(precision, FSDP2MixedPrecision):
            scaler = sharded_grad_scaler(precision.device) if precision.precision == "16-mixed" else None
            precision = FSDP2MixedPrecision(precision.precision, precision.device, scaler)
        self._precision = precision

    @property
    def device_mesh(self) -> Any:
        return self.engine.mesh

    def setup_module(self, module: nn.Module) -> nn.Module:
        return self.setup_module_and_optimizers(module, [])[0]

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        # Fabric has no wrapper to redirect a LightningModule's step methods through forward when the engine shards
        # in place: the engine itself gathers the parameters around them.
        watchdog.set_phase("setting the model up")
        module, optimizers = self.engine.setup(module, self.root_device, self.precision.precision, optimizers,
                                               forward_methods=STEP_METHODS)
        watchdog.set_phase("training")
        self.engine.settle_optimizers(optimizers)
        self.engine.sync_buffers_after_forward(module)  # rank 0's BatchNorm statistics after every forward
        return module, optimizers, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers(optimizer)``: one made from the set-up model's parameters."""
        self.engine.settle_optimizers([optimizer])
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        pass  # setup_module_and_optimizers places the module (or its shards)

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(self.engine.init_context(empty_init))
        stack.enter_context(self.precision.module_init_context())
        return stack
