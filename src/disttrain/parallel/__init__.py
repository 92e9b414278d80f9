"""Torch-only core of disttrain (never imports lightning), in rooms by kind:

- ``mesh`` (:class:`ParallelDims`: the degrees and the device mesh), ``registry`` (every strategy name, its engine
  and its options), ``options`` (building an options dataclass, with one clear error for a misspelt option);
- ``engines/``: one module per engine (``fsdp``, ``ddp``, ``zero``, ``megatron``, ``recsys``), each declaring how it
  holds a model's states, and what engines share (``base``: the protocol; buffers, clipping, precision, meta-device
  initialisation, torchrec tables, memory counts);
- ``split/``: ways of splitting and transforming a model, as plain functions applied in one order (FSDP's
  ``fully_shard``, tensor, context and pipeline parallelism, activation checkpointing, compile, gradient
  compression, LoRA, block discovery);
- ``checkpoint/``: the one checkpoint layout (writing and reading, ``io``), its background writer, its checksums
  (``integrity``), ZeRO partitions in it, pretrained weights and exports;
- ``guards/``: run-time guards (the watchdog, disk space, one-line failures);
- ``families/``: what disttrain knows of model families (blocks, tensor-parallel plans, fused weights).

The Trainer strategies (``disttrain.strategies``) and Fabric strategies (``disttrain.fabric``) are thin adapters
over the engines.
"""

from __future__ import annotations

import importlib
from typing import Any

# What ``disttrain.parallel`` re-exports, imported on first use: importing any one room (``guards``, ``registry``)
# then loads that room alone, not every engine and the pipelining and checkpoint modules of torch.distributed
# (seconds of start-up in the launcher, which needs only the guards and the names).
_EXPORTS = {
    "CheckpointError": "disttrain.parallel.checkpoint.io", "consolidate": "disttrain.parallel.checkpoint.io",
    "export_safetensors": "disttrain.parallel.checkpoint.io", "DDPOptions": "disttrain.parallel.engines.ddp",
    "ZeroOptions": "disttrain.parallel.engines.deepspeed", "MegatronOptions": "disttrain.parallel.engines.megatron",
    "rank_state_bytes": "disttrain.parallel.engines.memory",
    "unsharded_param_bytes": "disttrain.parallel.engines.memory", "ParallelDims": "disttrain.parallel.mesh",
    "block_candidates": "disttrain.parallel.split.blocks", "find_blocks": "disttrain.parallel.split.blocks",
    "FSDPOptions": "disttrain.parallel.split.fsdp", "apply_fsdp": "disttrain.parallel.split.fsdp",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'disttrain.parallel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
