"""``disttrain_fsdp`` / ``disttrain_fsdp_offload`` for the Lightning Trainer."""

from __future__ import annotations

from disttrain.parallel.engines.fsdp import FSDPEngine
from disttrain.strategies.base import EngineStrategy


class FSDPStrategy(EngineStrategy):
    """FSDP2 for ``lightning.Trainer``; runs on CUDA (nccl) and on CPU (gloo).

    Pass options as keywords (see :class:`disttrain.parallel.split.fsdp.FSDPOptions`), e.g.
    ``FSDPStrategy(activation_checkpointing=True, cpu_offload=True)``. Mixed precision follows
    ``Trainer(precision=...)``. A model built in ``configure_model`` with ``empty_init=True`` is created on the meta
    device and only each rank's shard is ever allocated.
    """

    strategy_name = "disttrain_fsdp"
    engine_cls = FSDPEngine
