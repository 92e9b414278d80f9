"""Map a Lightning-style precision string to what FSDP2 needs: a MixedPrecisionPolicy, a dtype, a grad scaler."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

SUPPORTED = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}


def normalize_precision(precision: str | int | None) -> str:
    value = _ALIASES.get(str(precision), str(precision)) if precision is not None else "32-true"
    if value not in SUPPORTED:
        raise ValueError(f"precision={precision!r} is not supported by disttrain's sharded strategies; choose one of"
                         f" {', '.join(SUPPORTED)}")
    return value


def mixed_precision_policy(precision: str, root: bool = False,
                           reduce_dtype: torch.dtype | None = None) -> MixedPrecisionPolicy | None:
    """FSDP2 casts parameters for compute and reduces gradients in fp32 (``reduce_dtype``: in that dtype instead,
    whatever the precision); the root returns fp32 outputs so that a loss computed outside the model (cross-entropy
    in ``training_step``) is not computed in half precision."""
    precision = normalize_precision(precision)
    if not precision.endswith("-mixed"):
        # Parameters keep their dtype (fp32, or bf16/fp16 under *-true); only the reduction is cast.
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype is not None else None
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype or torch.float32,
                                output_dtype=torch.float32 if root else None)


def sharded_grad_scaler(device_type: str) -> torch.amp.GradScaler:
    """Dynamic loss scaling whose inf/nan check is all-reduced across ranks, so every rank skips the same step."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device_type)
