"""Strategies for ``lightning.Fabric``. ``import disttrain`` registers them by name (``disttrain_fsdp``...)."""

from disttrain.fabric.auto import AutoStrategy
from disttrain.fabric.base import builds_empty
from disttrain.fabric.ddp import DDPStrategy
from disttrain.fabric.fsdp import FSDP2MixedPrecision, FSDPStrategy
from disttrain.fabric.megatron import MegatronStrategy
from disttrain.fabric.zero import ZeroStrategy
from disttrain.fabric.recsys import RecsysStrategy

__all__ = ["builds_empty", "AutoStrategy", "DDPStrategy", "FSDP2MixedPrecision", "FSDPStrategy", "MegatronStrategy",
           "RecsysStrategy", "ZeroStrategy"]
