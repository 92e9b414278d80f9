"""What the ViT recipe runs when the user does not say: the config and the strategy for this machine.

Both are small stand-ins for the planner (``disttrain_auto``): once it exists it replaces them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from disttrain.vision.config import CONFIG_DIR, count_parameters, read_yaml

TINY = CONFIG_DIR / "vit_tiny.yaml"
# fp32 parameter + gradient + AdamW's two moments, sharded over the ranks; the rest of the device is left for
# activations (checkpointed at 2B), the gathered block and the allocator.
BYTES_PER_PARAMETER = 16
MEMORY_FRACTION = 0.6


def default_config(world_size: int, device_memory: Optional[int]) -> Path:
    """The largest configs/vision/vit*.yaml whose training state fits ``device_memory`` bytes per device when
    sharded over ``world_size`` ranks; the tiny config on CPU (``device_memory=None``)."""
    if device_memory is None:
        return TINY
    sizes = sorted((count_parameters(read_yaml(p)["model"]), p) for p in CONFIG_DIR.glob("vit*.yaml"))
    fitting = [p for n, p in sizes if n * BYTES_PER_PARAMETER / world_size <= MEMORY_FRACTION * device_memory]
    return fitting[-1] if fitting else TINY


def default_strategy(devices: int, accelerator: str = "auto") -> tuple[str, dict[str, Any]]:
    """The source document's set-up for the 2B ViT, head-split tensor parallel (tp=2) x data parallel, when CUDA
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
