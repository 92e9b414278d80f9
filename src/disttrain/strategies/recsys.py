"""``disttrain_recsys`` for the Lightning Trainer: torchrec DistributedModelParallel."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from disttrain._lightning import checked_options
from disttrain.parallel.engines.recsys import RecsysEngine
from disttrain.strategies.base import EngineStrategy


class RecsysStrategy(EngineStrategy):
    """torchrec DistributedModelParallel for ``lightning.Trainer``, on CUDA (nccl) and CPU (gloo).

    Each direct child of the LightningModule that holds an ``EmbeddingBagCollection`` (``DeepFM.net``) is wrapped
    in DMP: tables sharded by torchrec's planner, the dense rest data-parallel. The tables' optimizer is fused into
    backward (it steps implicitly); the
    optimizers from ``configure_optimizers`` must cover the dense parameters only
    (``disttrain.parallel.engines.recsys.dense_parameters``). Checkpoints are DCP folders with the table shards and the
    fused optimizer state. Gradient accumulation does not apply to the tables (they update every backward).
    """

    strategy_name = "disttrain_recsys"
    engine_cls = RecsysEngine

    # BEGIN generated options: tools/strategy_signatures.py --write, from RecsysOptions (edit the dataclass)
    @checked_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = None,
        *,
        sharding_types: Optional[list[str]] = None,
        constraints: Optional[dict[str, dict[str, Any]]] = None,
        sparse_optimizer: str = 'adagrad',
        sparse_lr: float = 0.05,
        sparse_eps: float = 1e-08,
        batch_size: int = 512,
    ) -> None:
        """The options of ``disttrain_recsys`` as keywords (:class:`~disttrain.parallel.engines.recsys.RecsysOptions`),
        after the arguments the Trainer sets. ``None`` for ``constraints`` is its default.

        Args:
            accelerator: set by the Trainer from its ``accelerator``.
            parallel_devices: set by the Trainer from its ``devices``.
            cluster_environment: set by the Trainer (torchrun, SLURM, ...).
            precision_plugin: set by the Trainer from its ``precision``.
            process_group_backend: "gloo" or "nccl"; default: the devices' own.
            timeout: seconds (or a ``timedelta``) a process may stay silent before every process ends the run; a
                collective waits a few seconds longer. Default: ``$DISTTRAIN_TIMEOUT``, else 600.
            sharding_types: sharding types the planner may choose from for every table (default: table_wise,
                column_wise, table_column_wise, row_wise, table_row_wise; "data_parallel" to allow replication).
            constraints: per-table overrides, ``{"table_name": {"sharding_types": ["row_wise"], "min_partition": 8}}``
                (keyword arguments of torchrec's ``ParameterConstraints``).
            sparse_optimizer: the fused in-backward optimizer of the tables when the model does not name one: "adagrad",
                "rowwise_adagrad" or "sgd" (the ones fbgemm runs on CPU too).
            sparse_lr: its learning rate (the model's ``sparse_optimizer`` mapping wins when present).
            sparse_eps: its epsilon.
            batch_size: the per-rank batch size the planner assumes when it estimates costs.
        """
        options = {"sharding_types": sharding_types, "constraints": constraints, "sparse_optimizer": sparse_optimizer,
                   "sparse_lr": sparse_lr, "sparse_eps": sparse_eps, "batch_size": batch_size}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
                           timeout, options)
    # END generated options
