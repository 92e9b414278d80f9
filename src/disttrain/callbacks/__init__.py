"""Callbacks shared by every disttrain strategy, for the Trainer (as ``lightning.Callback``) and for Fabric (as
plain objects with methods a Fabric loop calls)."""

from disttrain.callbacks.accumulation import GradientAccumulation, accumulation_steps
from disttrain.callbacks.attention import FlashAttention, apply_fast_attention, flash_attn_2_missing, format_report
from disttrain.callbacks.precision import FP8, MixedPrecision, convert_to_fp8
from disttrain.callbacks.throughput import (
    PEAK_FLOPS,
    Throughput,
    TransformerDims,
    hf_transformer_dims,
    measure_train_flops,
    mfu,
    transformer_flops_per_token,
)

__all__ = ["FP8", "PEAK_FLOPS", "FlashAttention", "GradientAccumulation", "MixedPrecision", "Throughput", "TransformerDims",
           "accumulation_steps", "apply_fast_attention", "convert_to_fp8", "flash_attn_2_missing", "format_report", "hf_transformer_dims", "measure_train_flops", "mfu",
           "transformer_flops_per_token"]
