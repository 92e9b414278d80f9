"""Callbacks shared by every disttrain strategy, for the Trainer (as ``lightning.Callback``) and for Fabric (as
plain objects with methods a Fabric loop calls)."""

from disttrain.callbacks.accumulation import GradientAccumulation, accumulation_steps
from disttrain.callbacks.precision import FP8, MixedPrecision, convert_to_fp8

__all__ = ["FP8", "GradientAccumulation", "MixedPrecision", "accumulation_steps", "convert_to_fp8"]
