"""``disttrain_ddp`` for Lightning Fabric."""

from __future__ import annotations

from disttrain.fabric.base import EngineStrategy
from disttrain.parallel.engines.ddp import DDPEngine


# Fabric has no check for its own DDPStrategy class (the Trainer has: see disttrain.strategies.ddp), so this one
# needs no Lightning DDP base: the engine wraps the model in DistributedDataParallel.
class DDPStrategy(EngineStrategy):
    """DDP for ``lightning.Fabric``; the same options as :class:`disttrain.strategies.DDPStrategy`
    (:class:`disttrain.parallel.engines.ddp.DDPOptions`), compression hooks on CPU too. Checkpoints are the one disttrain
    layout; a single-file checkpoint (Lightning's own DDP format) is loaded as Lightning does."""

    strategy_name = "disttrain_ddp"
    engine_cls = DDPEngine
