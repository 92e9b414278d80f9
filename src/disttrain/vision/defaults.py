"""What the ViT recipe runs when the user does not say: the config and the strategy for this machine.

The config is the planner's call (what fits); the strategy follows the set-up of the 2B ViT reference
case (head-split tensor parallel x data parallel on 16 GPUs): the registered strategy that splits heads (the one
whose options have ``tensor_parallel_size``, asked through the registry), at tp=2.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from disttrain.launch import degree_options, takes
from disttrain.parallel import registry
from disttrain.vision.config import CONFIG_DIR, count_parameters, read_yaml

TINY = CONFIG_DIR / "vit_tiny.yaml"
# The 2B reference case splits each block's heads over 2 ranks (tensor parallel), data parallel over the rest.
REFERENCE_TP = 2
TP_OPTION = "tensor_parallel_size"
DEFAULT_STRATEGY = "disttrain_fsdp"  # when the reference set-up cannot run (no CUDA, an odd device count)


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


def head_split_strategy() -> Optional[str]:
    """The registered strategy that splits attention heads (takes ``tensor_parallel_size``), or None."""
    return next((row.name for row in registry.STRATEGIES if takes(row.name, TP_OPTION)), None)


def reference_options(strategy: str, given: Mapping[str, Any], world_size: Optional[int]) -> dict[str, Any]:
    """The reference case's head-split TP (``tensor_parallel_size=2``) for a ``strategy`` that takes it, when
    ``given`` sets no parallel size of its own and the processes pair up (an even ``world_size``); else {}."""
    if not takes(strategy, TP_OPTION) or any(option in given for option in degree_options()):
        return {}
    if not world_size or world_size % REFERENCE_TP:
        return {}
    return {TP_OPTION: REFERENCE_TP}


def default_strategy(devices: int, accelerator: str = "auto") -> tuple[str, dict[str, Any]]:
    """The set-up of the 2B ViT reference case, head-split tensor parallel (tp=2) x data parallel, when CUDA
    devices are used, a registered strategy splits heads (:func:`head_split_strategy`) and the device count is
    even; otherwise ``disttrain_fsdp``. Returns the name and its options."""
    cuda = accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    name = head_split_strategy() if cuda else None
    options = reference_options(name, {}, devices) if name is not None and devices >= REFERENCE_TP else {}
    if not options:
        return DEFAULT_STRATEGY, {}
    return name, options


def cuda_memory() -> Optional[int]:
    """Memory of the first CUDA device in bytes, or None without one."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
