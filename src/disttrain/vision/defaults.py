"""What the ViT recipe runs when the user does not say: the config and the strategy for this machine.

The config is the planner's call (what fits); the strategy follows the set-up of the 2B ViT reference
case (head-split tensor parallel x data parallel on 16 GPUs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from disttrain.vision.config import CONFIG_DIR, count_parameters, read_yaml

TINY = CONFIG_DIR / "vit_tiny.yaml"


def default_config(world_size: int, device_memory: Optional[int], micro_batch: Optional[int] = None) -> Path:
    """The largest configs/vision/vit*.yaml that the planner (:func:`disttrain.planner.choose`) fits on
    ``world_size`` devices of ``device_memory`` bytes each under the recipe's default strategy
    (:func:`default_strategy`; activations of the config's own micro batch included); the tiny config on CPU
    (``device_memory=None``)."""
    if device_memory is None:
        return TINY
    from disttrain.planner import choose

    strategy = default_strategy(world_size, "cuda")[0]

    sizes = sorted((count_parameters(read_yaml(p)["model"]), p) for p in CONFIG_DIR.glob("vit*.yaml"))
    for _, path in reversed(sizes):
        config = read_yaml(path)
        batch = micro_batch or int(config.get("data", {}).get("batch_size", 1))
        plan = choose(path, world_size, device_memory=device_memory, micro_batch=batch,
                      precision=config.get("train", {}).get("precision", "bf16-mixed"),
                      available=[strategy])
        if plan.choice is not None:
            return path
    return TINY


def default_strategy(devices: int, accelerator: str = "auto") -> tuple[str, dict[str, Any]]:
    """The set-up of the 2B ViT reference case, head-split tensor parallel (tp=2) x data parallel, when CUDA
    devices are used, ``disttrain_megatron`` is registered and the device count is even; otherwise
    ``disttrain_fsdp``."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    cuda = accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    if cuda and "disttrain_megatron" in STRATEGY_REGISTRY and devices >= 2 and devices % 2 == 0:
        return "disttrain_megatron", {"tensor_parallel_size": 2}
    return "disttrain_fsdp", {}


def cuda_memory() -> Optional[int]:
    """Memory of the first CUDA device in bytes, or None without one."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
