"""DDP with optional gradient compression (communication hooks from torch.distributed.algorithms)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

COMPRESSIONS = ("fp16", "bf16", "powersgd")


@dataclass
class DDPOptions:
    """What a user can set on ``disttrain_ddp`` (the same names on the Trainer and Fabric strategies).

    gradient_compression: None, "fp16", "bf16" (halve all-reduce bytes) or "powersgd" (low-rank, error feedback).
    powersgd_rank: rank of PowerSGD's approximation (higher: closer to exact, more bytes).
    powersgd_start_iter: plain all-reduce for this many steps before PowerSGD starts (warm-up).
    find_unused_parameters, static_graph: passed to DistributedDataParallel.
    """

    gradient_compression: Optional[str] = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10
    find_unused_parameters: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        if self.gradient_compression is not None and self.gradient_compression not in COMPRESSIONS:
            raise ValueError(f"gradient_compression={self.gradient_compression!r} is not known; choose None or one"
                             f" of {', '.join(COMPRESSIONS)}")
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank={self.powersgd_rank} must be at least 1")

    def ddp_kwargs(self) -> dict:
        return {"find_unused_parameters": self.find_unused_parameters, "static_graph": self.static_graph}


def register_compression(model: DistributedDataParallel, options: DDPOptions) -> None:
    """Install the compression hook chosen in ``options`` on a DDP model (no-op without compression)."""
    kind = options.gradient_compression
    if kind == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=options.powersgd_start_iter,
            min_compression_rate=1,  # compress small test models too; real models pass the default check anyway
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
