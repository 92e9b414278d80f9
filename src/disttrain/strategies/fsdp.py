"""``disttrain_fsdp`` / ``disttrain_fsdp_offload`` for the Lightning Trainer: an adapter over FSDPEngine."""

from __future__ import annotations

import shutil
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from disttrain._lightning import (
    DEFAULT_TIMEOUT,
    DistributedPlumbing,
    fsdp2_mixed_precision_class,
    layer_sync_request,
    to_fsdp2_precision,
)
from disttrain.parallel.engine import FSDPEngine
from disttrain.parallel.fsdp import FSDPOptions, set_gradient_sync
from disttrain.parallel.options import build_options

FSDP2MixedPrecision = fsdp2_mixed_precision_class(MixedPrecision)
# The Trainer calls these on the LightningModule (the FSDP root) instead of forward.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FSDPStrategy(DistributedPlumbing, ParallelStrategy):
    """FSDP2 for ``lightning.Trainer``; runs on CUDA (nccl) and on CPU (gloo).

    Pass options as keywords (see :class:`disttrain.parallel.fsdp.FSDPOptions`): ``wrap_classes``,
    ``activation_checkpointing``, ``cpu_offload``, ``reshard_after_forward``, ``empty_init``,
    ``save_distributed_checkpoint``. Mixed precision follows ``Trainer(precision=...)``.
    A model built in ``configure_model`` with ``empty_init=True`` is created on the meta device and only each
    rank's shard is ever allocated.
    """

    strategy_name = "disttrain_fsdp"
    _launcher_cls = _SubprocessScriptLauncher
    _engine_cls, _options_cls = FSDPEngine, FSDPOptions  # disttrain_megatron swaps in its own

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        self._init_common(self._engine_cls(build_options(self._options_cls, self.strategy_name, options)),
                          process_group_backend, timeout)

    # Lightning picks an autocast plugin for "*-mixed"; FSDP2 casts by itself.
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = to_fsdp2_precision(plugin, MixedPrecision, FSDP2MixedPrecision)

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self.engine.mesh  # in configure_model as self.device_mesh

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self.engine.convert_batchnorm(self.model, *layer_sync_request(self._layer_sync))
        self.engine.parallelize(self.model, self.root_device, self.precision_plugin.precision,
                                forward_methods=_STEP_METHODS)
        self.engine.settle_buffers(self.model, self.root_device, self.strategy_name,
                                   training=trainer.state.fn == TrainerFn.FITTING)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()  # a re-setup must not keep optimizers of the old parameters
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._route_gradient_clipping()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        assert self.model is not None
        self.engine.broadcast_buffers(self.model)  # rank 0's BatchNorm statistics, as under ddp
        return output

    def _route_gradient_clipping(self) -> None:
        """``gradient_clip_val`` clips by the whole model's norm. The Trainer asks the precision plugin, never the
        strategy, and torch's clip sees only this rank's pipeline stage (or fails on TP's two meshes)."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: Union[int, float]) -> None:
            self.engine.clip_grad_norm_(plugin.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        with self.engine.init_context(empty_init), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No reduce-scatter on the non-final micro-steps of gradient accumulation."""
        assert self.model is not None
        set_gradient_sync(self.model, False)
        try:
            yield
        finally:
            set_gradient_sync(self.model, True)

    def full_model(self) -> AbstractContextManager[torch.nn.Module]:
        """Collective, on every rank: ``with trainer.strategy.full_model(): y = module.model(x)``. Inside the block
        every rank holds the full parameters and the LightningModule, or any part of it, can be called on any rank
        (rank 0 alone too) without communication, under ``torch.no_grad()``; shards are restored on exit. For use
        after ``trainer.fit`` (a notebook, an evaluation script); yields the LightningModule."""
        if self.model is None:
            raise RuntimeError("full_model() needs the model trainer.fit/validate/test/predict set up: call it after"
                               " one of them")
        return self.engine.full_model(self.model)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints: sharded DCP folders by default ---------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self.engine.model_state(self.model)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint() already restored the shards in place

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return self.engine.optimizer_state(self.model, optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint() already restored the optimizer shards in place

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options; it writes"
                            " torch.distributed.checkpoint folders itself")
        path = self.broadcast(filepath)
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self.engine.save(path, tensors, checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        path = self.broadcast(checkpoint_path)
        targets: dict[str, Any] = {"state_dict": self.model}
        targets.update({f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)})
        return self.engine.load(path, targets, self.model, strict=self.lightning_module.strict_loading,
                                weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def export_full(self, path: Any, prefix: str = "") -> Path | None:
        """Write the full model as one safetensors file (rank 0). ``prefix="model."`` keeps only the keys under
        ``self.model`` of the LightningModule, without the prefix, so they load into that plain module."""
        assert self.model is not None
        return self.engine.export(self.model, path, prefix=prefix)
