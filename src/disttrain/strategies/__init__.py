"""Strategies for ``lightning.Trainer``. ``import disttrain`` registers them by name (``disttrain_fsdp``...)."""

from disttrain.strategies.auto import AutoStrategy
from disttrain.strategies.ddp import DDPStrategy
from disttrain.strategies.fsdp import FSDP2MixedPrecision, FSDPStrategy
from disttrain.strategies.megatron import MegatronStrategy
from disttrain.strategies.zero import ZeroStrategy
from disttrain.strategies.recsys import RecsysStrategy

__all__ = ["AutoStrategy", "DDPStrategy", "FSDP2MixedPrecision", "FSDPStrategy", "MegatronStrategy",
           "RecsysStrategy", "ZeroStrategy"]
