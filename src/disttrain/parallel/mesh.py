"""Parallel degrees and the device mesh: the one place that does world-size arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (dp), tensor (tp) and pipeline (pp) parallelism over ``world_size`` ranks.

    ``dp=-1`` means "whatever is left": ``world_size / (tp * pp)``.
    """

    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} must be a positive integer")
        model_parallel = self.tp * self.pp
        if self.world_size % model_parallel:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tp*pp={model_parallel} (tp={self.tp}, pp={self.pp});"
                f" choose sizes whose product divides {self.world_size}"
            )
        if self.dp == -1:
            object.__setattr__(self, "dp", self.world_size // model_parallel)
        if self.dp * model_parallel != self.world_size:
            raise ValueError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.dp * model_parallel} does not equal"
                f" world_size={self.world_size}; set dp=-1 to derive it"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A mesh with only the dimensions whose degree is above 1 (always at least ``dp``)."""
        names, shape = [], []
        for name, degree in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)):
            if degree > 1 or name == "dp":
                names.append(name)
                shape.append(degree)
        return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def device_type_of(device: torch.device | str) -> str:
    return torch.device(device).type
