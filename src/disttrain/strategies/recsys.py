"""``disttrain_recsys`` for the Lightning Trainer: torchrec DistributedModelParallel."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Union

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from disttrain._lightning import checked_options
from disttrain.parallel.engines.recsys import RecsysEngine
from disttrain.parallel.engines.sparse_pipeline import SteppedPipeline
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
    engine: RecsysEngine
    _pipeline: Optional[SteppedPipeline] = None

    # -- pipeline="sparse_dist": torchrec's pipeline stepped around Lightning's own loop --------------------------
    # Lightning keeps forward (training_step), backward, optimizer step, logging and callbacks; the pipeline sees the
    # training loader's batches as Lightning fetches them (one ahead of the step) and starts the next batch's input
    # all-to-all around this step's forward.
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.engine.options.pipeline == "none" or trainer is None or not trainer.training:
            return dataloader
        return _HandedToPipeline(dataloader, self._add_to_pipeline)

    def _add_to_pipeline(self, batch: Any) -> None:
        if self._pipeline is None:
            self._pipeline = self.engine.stepped_pipeline(self.lightning_module, self.root_device)
        assert self._pipeline is not None
        self._pipeline.add(batch)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        self._pipeline.before_forward(args[0] if args else kwargs["batch"])
        output = super().training_step(*args, **kwargs)
        self._pipeline.after_forward()  # before Lightning's backward: the next batch's ids travel during it
        return output

    @override
    def on_validation_start(self) -> None:
        if self._pipeline is not None:
            self._pipeline.pause()  # the tables' own forward for validation batches
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self._finish_pipeline()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._finish_pipeline()  # also when fit stopped on an error
        super().teardown()

    def _finish_pipeline(self) -> None:
        if self._pipeline is not None:
            pipeline, self._pipeline = self._pipeline, None
            pipeline.finish()

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
        pipeline: str = 'none',
        comm_precision: str = 'fp32',
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
            pipeline: "sparse_dist": torchrec's TrainPipelineSparseDist, the next batch's input all-to-all (ids to the
                ranks holding their tables) in flight during this batch's forward and backward, the same losses and
                weights bit for bit (the module gives ``pipeline_batch``, as DeepFM does); "none": the plain loop.
            comm_precision: the dtype the pooled embeddings and their gradients cross ranks in (torchrec's quantized
                comms codecs): "fp32", "fp16", "bf16", or "fp8" (CUDA only: fbgemm's CPU build has no fp8 codec).
        """
        options = {"sharding_types": sharding_types, "constraints": constraints, "sparse_optimizer": sparse_optimizer,
                   "sparse_lr": sparse_lr, "sparse_eps": sparse_eps, "batch_size": batch_size, "pipeline": pipeline,
                   "comm_precision": comm_precision}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
                           timeout, options)
    # END generated options


_END = object()


class _HandedToPipeline:
    """The training loader, read one batch ahead of Lightning (which does not prefetch from a loader with a length),
    each batch handed to the pipeline as it is read; everything else (length, sampler for ``set_epoch``, state) is
    the loader's."""

    def __init__(self, loader: Any, add: Callable[[Any], None]) -> None:
        self.loader = loader
        self.add = add

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        batch = next(batches, _END)
        if batch is not _END:
            self.add(batch)
        while batch is not _END:
            ahead = next(batches, _END)
            if ahead is not _END:
                self.add(ahead)
            yield batch
            batch = ahead

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
