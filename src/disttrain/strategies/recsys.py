"""``disttrain_recsys`` for the Lightning Trainer: torchrec DistributedModelParallel."""

from __future__ import annotations

from disttrain.parallel.engines.recsys import RecsysEngine
from disttrain.strategies.base import EngineStrategy


class RecsysStrategy(EngineStrategy):
    """torchrec DistributedModelParallel for ``lightning.Trainer``, on CUDA (nccl) and CPU (gloo).

    Each direct child of the LightningModule that holds an ``EmbeddingBagCollection`` (``DeepFM.net``) is wrapped
    in DMP: tables sharded by torchrec's planner, the dense rest data-parallel. Options as keywords
    (:class:`disttrain.parallel.engines.recsys.RecsysOptions`): ``sharding_types``, ``constraints``, ``sparse_optimizer``,
    ``sparse_lr``, ``batch_size``. The tables' optimizer is fused into backward (it steps implicitly); the
    optimizers from ``configure_optimizers`` must cover the dense parameters only
    (``disttrain.parallel.engines.recsys.dense_parameters``). Checkpoints are DCP folders with the table shards and the
    fused optimizer state. Gradient accumulation does not apply to the tables (they update every backward).
    """

    strategy_name = "disttrain_recsys"
    engine_cls = RecsysEngine
