"""``disttrain_fsdp`` / ``disttrain_fsdp_offload`` for Lightning Fabric."""

from __future__ import annotations

from disttrain.fabric.base import EngineStrategy
from disttrain.parallel.engines.fsdp import FSDPEngine


class FSDPStrategy(EngineStrategy):
    """FSDP2 for ``lightning.Fabric``; runs on CUDA (nccl) and on CPU (gloo).

    Options as keywords, the same as the Trainer strategy (:class:`disttrain.parallel.split.fsdp.FSDPOptions`).
    ``fabric.init_module(empty_init=True)`` builds on the meta device; ``fabric.setup`` shards and initialises.
    """

    strategy_name = "disttrain_fsdp"
    engine_cls = FSDPEngine
