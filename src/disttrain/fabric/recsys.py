"""``disttrain_recsys`` for Lightning Fabric: torchrec DistributedModelParallel."""

from __future__ import annotations

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
