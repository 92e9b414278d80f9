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

from disttrain.parallel.checkpoint.io import CheckpointError, consolidate, export_safetensors
from disttrain.parallel.engines.ddp import DDPOptions
from disttrain.parallel.engines.deepspeed import ZeroOptions
from disttrain.parallel.engines.megatron import MegatronOptions
from disttrain.parallel.engines.memory import rank_state_bytes, unsharded_param_bytes
from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.split.blocks import block_candidates, find_blocks
from disttrain.parallel.split.fsdp import FSDPOptions, apply_fsdp

__all__ = [
    "CheckpointError", "DDPOptions", "FSDPOptions", "MegatronOptions", "ParallelDims", "ZeroOptions", "apply_fsdp",
    "block_candidates", "consolidate", "export_safetensors", "find_blocks", "rank_state_bytes",
    "unsharded_param_bytes",
]
