"""The checks ``bench/gpu_check.py`` runs, in the order it runs them (headline figures first), each with the time
it usually takes on one H200 and the most it may take before it is stopped.

A check is a module with ``CHECK`` (its report label) and ``run(ctx)``, which returns or yields its rows; it is
imported only when it runs, so the orchestrating process stays free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    module: str
    label: str
    expected_s: float  # typical time on one H200, worker start excluded; a check starts only if this much is left
    budget_s: float  # stopped after this long (and always at the run's deadline)
    what: str


CHECKS = (
    Check("mfu", "gpu_checks.mfu", "1 MFU", 45, 110,
          "MFU (Throughput's figure) of dialogue_1b at seq 2048 and of a 4-layer full-width dialogue_10b slice"),
    Check("attention", "gpu_checks.attn", "2 attention", 15, 45,
          "SDPA flash vs eager attention at 2k/4k/8k tokens: time and peak memory"),
    Check("fp8", "gpu_checks.fp8", "3 FP8", 45, 100,
          "torchao float8 tensorwise/rowwise vs bf16 on the 10B slice: losses over 20 steps, step time"),
    Check("fp16", "gpu_checks.fp16", "4 fp16 + sharded scaler", 25, 60,
          "fp16-mixed with the sharded scaler: no NaN, skipped steps counted"),
    Check("planner", "gpu_checks.planner", "6 planner", 35, 80,
          "planner estimate vs max_memory_allocated, ddp/fsdp, 1B, with and without activation checkpointing"),
    Check("offload", "gpu_checks.offload", "5 offload", 60, 130,
          "disttrain_fsdp_offload (and zero3_offload) vs no offload: step time, device peak, host RSS"),
    Check("megatron", "gpu_checks.megatron", "7 megatron / pipeline", 35, 90,
          "disttrain_megatron and pipeline schedules on CUDA tensors at world size 1; tp=2 in 2 processes"),
    Check("recipes", "gpu_checks.recipes", "8 recipes", 60, 180,
          "dialogue LLM, ViT and daily DeepFM recipes: a few steps each on the device"),
    Check("steptime", "gpu_checks.steptime", "9 step time", 90, 240,
          "planner step time vs measured steps after calibrating the device: dialogue_1b, best two plans"),
)

BY_NAME = {c.name: c for c in CHECKS}
