"""``disttrain_recsys`` for the Lightning Trainer: an adapter over RecsysEngine (torchrec DMP)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

from disttrain._lightning import DEFAULT_TIMEOUT, DistributedPlumbing
from disttrain.parallel.options import build_options
from disttrain.parallel.recsys import RecsysEngine, RecsysOptions


class RecsysStrategy(DistributedPlumbing, ParallelStrategy):
    """torchrec DistributedModelParallel for ``lightning.Trainer``, on CUDA (nccl) and CPU (gloo).

    Each direct child of the LightningModule that holds an ``EmbeddingBagCollection`` (``DeepFM.net``) is wrapped
    in DMP: tables sharded by torchrec's planner, the dense rest data-parallel. Options as keywords
    (:class:`disttrain.parallel.recsys.RecsysOptions`): ``sharding_types``, ``constraints``, ``sparse_optimizer``,
    ``sparse_lr``, ``batch_size``. The tables' optimizer is fused into backward (it steps implicitly); the
    optimizers from ``configure_optimizers`` must cover the dense parameters only
    (``disttrain.parallel.recsys.dense_parameters``). Checkpoints are DCP folders with the table shards and the
    fused optimizer state. Gradient accumulation does not apply to the tables (they update every backward).
    """

    strategy_name = "disttrain_recsys"
    _launcher_cls = _SubprocessScriptLauncher

    def __init__(self, accelerator: Optional[Any] = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[Any] = None, precision_plugin: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
                 **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        self._init_common(RecsysEngine(build_options(RecsysOptions, self.strategy_name, options)),
                          process_group_backend, timeout)

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards exist only after setup

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.engine.parallelize(self.model, self.root_device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            self._check_dense_only()
        self.setup_precision_plugin()

    def _check_dense_only(self) -> None:
        from disttrain.parallel.recsys import dense_parameters

        assert self.model is not None
        dense = {id(p) for p in dense_parameters(self.model)}
        for optimizer in self.optimizers:
            if any(id(p) not in dense for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("configure_optimizers returned an optimizer over embedding-table parameters; the"
                                 " tables have a fused optimizer under disttrain_recsys: pass"
                                 " disttrain.parallel.recsys.dense_parameters(self) to the dense optimizer")

    def model_to_device(self) -> None:
        pass  # setup() placed the dense part and DMP placed the shards

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints: table shards and fused optimizer state through DCP; the dense optimizer in meta.pt ------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # save_checkpoint takes the (sharded) state from the module itself

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint() already restored the shards in place

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options; it writes"
                            " torch.distributed.checkpoint folders itself")
        assert self.model is not None
        checkpoint.pop("state_dict", None)
        self.engine.save(self.broadcast(filepath), self.model, checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        return self.engine.load(self.broadcast(checkpoint_path), self.model,
                                strict=self.lightning_module.strict_loading)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
