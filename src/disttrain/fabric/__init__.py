"""Strategies for ``lightning.Fabric``. ``import disttrain`` registers them by name (``disttrain_fsdp``...)."""

from disttrain.fabric.ddp import DDPStrategy
from disttrain.fabric.fsdp import FSDP2MixedPrecision, FSDPStrategy
from disttrain.fabric.zero import ZeroStrategy
from disttrain.fabric.recsys import RecsysStrategy

__all__ = ["DDPStrategy", "FSDP2MixedPrecision", "FSDPStrategy", "ZeroStrategy", "RecsysStrategy"]
