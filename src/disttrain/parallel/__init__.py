"""Torch-only core of disttrain (never imports lightning): meshes, FSDP2, DDP hooks, checkpoints, precision.

The Trainer strategies (``disttrain.strategies``) and Fabric strategies (``disttrain.fabric``) are thin adapters
over :class:`disttrain.parallel.engine.FSDPEngine` and :mod:`disttrain.parallel.ddp`.
"""

from disttrain.parallel.blocks import block_candidates, find_blocks
from disttrain.parallel.checkpoint import CheckpointError, consolidate, export_safetensors
from disttrain.parallel.ddp import DDPOptions
from disttrain.parallel.fsdp import FSDPOptions, apply_fsdp
from disttrain.parallel.memory import rank_state_bytes, unsharded_param_bytes
from disttrain.parallel.mesh import ParallelDims

__all__ = [
    "CheckpointError", "DDPOptions", "FSDPOptions", "ParallelDims", "apply_fsdp", "block_candidates",
    "consolidate", "export_safetensors", "find_blocks", "rank_state_bytes", "unsharded_param_bytes",
]
