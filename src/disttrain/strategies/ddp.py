"""``disttrain_ddp`` for the Lightning Trainer: Lightning's DDP plus our compression hooks, on CPU too."""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy as _LightningDDP

from disttrain._lightning import register_names
from disttrain.parallel.checkpoint import (
    export_safetensors,
    is_sharded_checkpoint,
    load_sharded,
    model_state,
    optimizer_state,
    save_sharded,
)
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

    @contextmanager
    def full_model(self) -> Iterator[torch.nn.Module]:
        """The sharded strategies' ``with trainer.strategy.full_model(): y = module.model(x)``, so such code runs
        unchanged under DDP: every rank already holds the whole model; this only enters ``torch.no_grad()``."""
        with torch.no_grad():
            yield self.lightning_module

    # -- checkpoints: the one disttrain layout (DCP folders by parameter name), which every strategy loads -------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizers must exist to restore their state in place

    @property
    def lightning_restore_optimizer(self) -> bool:
        # Restored in place from a checkpoint folder; Lightning restores it from a single-file checkpoint.
        return not getattr(self, "_restored_in_place", False)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return model_state(self.model)  # names without DDP's "module." prefix

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return optimizer_state(self.model, optimizer)  # keyed by parameter name, not by index

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options; it writes"
                            " torch.distributed.checkpoint folders itself")
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        save_sharded(self.broadcast(filepath), tensors, checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A disttrain checkpoint folder of any strategy and world size is restored in place; a single file
        (Lightning's own DDP format) is loaded as Lightning does."""
        path = self.broadcast(checkpoint_path)
        self._restored_in_place = is_sharded_checkpoint(path)
        if not self._restored_in_place:
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.model is not None and self.lightning_module is not None
        targets: dict[str, Any] = {"state_dict": self.model}
        targets.update({f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)})
        return load_sharded(path, targets, self.model, strict=self.lightning_module.strict_loading,
                            weights_only=weights_only is not False)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not getattr(self, "_restored_in_place", False):
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not getattr(self, "_restored_in_place", False):
            super().load_optimizer_state_dict(checkpoint)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def export_full(self, path: Any, prefix: str = "") -> Path:
        """The full model as one safetensors file (rank 0); ``prefix`` as in the FSDP strategy."""
        return export_safetensors(self.lightning_module, path, prefix=prefix)
