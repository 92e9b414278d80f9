"""``disttrain_recsys`` for Lightning Fabric: torchrec DistributedModelParallel."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from torch import nn

from disttrain._lightning import checked_options
from disttrain.fabric.base import EngineStrategy
from disttrain.parallel.engines.recsys import RecsysEngine


class RecsysStrategy(EngineStrategy):
    """torchrec DistributedModelParallel for ``lightning.Fabric``; the same options as
    :class:`disttrain.strategies.RecsysStrategy`. ``fabric.setup(model, dense_optimizer)`` shards the model's
    tables; create the dense optimizer over ``disttrain.parallel.engines.recsys.dense_parameters(model)`` (the tables'
    optimizer is fused into backward). ``fabric.save``/``fabric.load`` write/read DCP folders with the table
    shards and the fused optimizer state."""

    strategy_name = "disttrain_recsys"
    engine_cls = RecsysEngine
    engine: RecsysEngine

    def train_pipeline(self, model: nn.Module, optimizer: Any,
                       step: Callable[[Any], tuple[torch.Tensor, Any]]) -> Any:
        """torchrec's training pipeline for a hand-written loop over the model and optimizer ``fabric.setup``
        returned: ``pipeline.progress(batches)`` takes the next batch of the iterator ``batches`` (``TableBatch``es,
        e.g. ``map(module.pipeline_batch, loader)``), runs ``step(batch) -> (loss, output)``, backward as
        ``fabric.backward`` does and ``optimizer.step()``, and returns ``output``; ``StopIteration`` ends the epoch.
        With ``pipeline="sparse_dist"`` the next batch's input all-to-all overlaps this one's forward and backward
        (the same losses as ``pipeline="none"``, bit for bit)."""
        return self.engine.train_pipeline(model, optimizer, self.root_device, step,
                                          backward=lambda loss: self.backward(loss, model))

    # BEGIN generated options: tools/strategy_signatures.py --write, from RecsysOptions (edit the dataclass)
    @checked_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = None,
        *,
        sharding_types: Optional[list[str]] = None,
        constraints: Optional[dict[str, dict[str, Any]]] = None,
        sparse_optimizer: str = 'adagrad',
        sparse_lr: float = 0.05,
        sparse_eps: float = 1e-08,
        batch_size: int = 512,
        pipeline: str = 'none',
        comm_precision: str = 'fp32',
    ) -> None:
        """The options of ``disttrain_recsys`` as keywords (:class:`~disttrain.parallel.engines.recsys.RecsysOptions`),
        after the arguments Fabric sets. ``None`` for ``constraints`` is its default.

        Args:
            accelerator: set by Fabric from its ``accelerator``.
            parallel_devices: set by Fabric from its ``devices``.
            cluster_environment: set by Fabric (torchrun, SLURM, ...).
            precision: set by Fabric from its ``precision``.
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
            pipeline: "sparse_dist": torchrec's TrainPipelineSparseDist, the next batch's input all-to-all (ids to the
                ranks holding their tables) in flight during this batch's forward and backward, the same losses and
                weights bit for bit (the module gives ``pipeline_batch``, as DeepFM does); "none": the plain loop.
            comm_precision: the dtype the pooled embeddings and their gradients cross ranks in (torchrec's quantized
                comms codecs): "fp32", "fp16", "bf16", or "fp8" (CUDA only: fbgemm's CPU build has no fp8 codec).
        """
        options = {"sharding_types": sharding_types, "constraints": constraints, "sparse_optimizer": sparse_optimizer,
                   "sparse_lr": sparse_lr, "sparse_eps": sparse_eps, "batch_size": batch_size, "pipeline": pipeline,
                   "comm_precision": comm_precision}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision, process_group_backend,
                           timeout, options)
    # END generated options
