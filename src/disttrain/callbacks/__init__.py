"""Callbacks shared by every disttrain strategy, for the Trainer (as ``lightning.Callback``) and for Fabric (as
plain objects with methods a Fabric loop calls)."""

from disttrain.callbacks.accumulation import GradientAccumulation, accumulation_steps

__all__ = ["GradientAccumulation", "accumulation_steps"]
