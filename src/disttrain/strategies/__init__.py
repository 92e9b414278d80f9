"""Strategies for ``lightning.Trainer``: one adapter per engine (``ADAPTERS``), registered by name
(``disttrain_fsdp``...) from :mod:`disttrain.parallel.registry` when ``import disttrain`` has run."""

from disttrain.strategies.auto import AutoStrategy
from disttrain.strategies.base import FSDP2MixedPrecision
from disttrain.strategies.ddp import DDPStrategy
from disttrain.strategies.fsdp import FSDPStrategy
from disttrain.strategies.megatron import MegatronStrategy
from disttrain.strategies.recsys import RecsysStrategy
from disttrain.strategies.zero import ZeroStrategy

ADAPTERS = (AutoStrategy, DDPStrategy, FSDPStrategy, MegatronStrategy, RecsysStrategy, ZeroStrategy)

__all__ = ["ADAPTERS", "AutoStrategy", "DDPStrategy", "FSDP2MixedPrecision", "FSDPStrategy", "MegatronStrategy",
           "RecsysStrategy", "ZeroStrategy"]
