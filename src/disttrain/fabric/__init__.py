"""Strategies for ``lightning.Fabric``: one adapter per engine (``ADAPTERS``), registered by name
(``disttrain_fsdp``...) from :mod:`disttrain.parallel.registry` when ``import disttrain`` has run."""

from disttrain.fabric.auto import AutoStrategy
from disttrain.fabric.base import FSDP2MixedPrecision, builds_empty, use_async_checkpoint, wait_checkpoint
from disttrain.fabric.ddp import DDPStrategy
from disttrain.fabric.fsdp import FSDPStrategy
from disttrain.fabric.megatron import MegatronStrategy
from disttrain.fabric.recsys import RecsysStrategy
from disttrain.fabric.zero import ZeroStrategy

ADAPTERS = (AutoStrategy, DDPStrategy, FSDPStrategy, MegatronStrategy, RecsysStrategy, ZeroStrategy)

__all__ = ["ADAPTERS", "AutoStrategy", "DDPStrategy", "FSDP2MixedPrecision", "FSDPStrategy", "MegatronStrategy",
           "RecsysStrategy", "ZeroStrategy", "builds_empty", "use_async_checkpoint", "wait_checkpoint"]
