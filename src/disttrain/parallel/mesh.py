"""Parallel degrees and the device mesh: the one place that does world-size arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (dp), tensor (tp) and pipeline (pp) parallelism over ``world_size`` ranks.

    ``dp=-1`` means "whatever is left": ``world_size / (tp * pp)``. ``dp_replicate > 1`` splits the data-parallel
    ranks into ``dp_replicate`` groups that each hold one full sharded copy (HSDP: shard within a node, replicate
    across nodes); ``dp_shard = dp / dp_replicate`` ranks share one copy.
    """

    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1

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

        if self.dp_replicate < 1 or self.dp % self.dp_replicate:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} does not divide the data-parallel degree dp={self.dp}; choose"
                f" {', '.join(str(d) for d in range(1, self.dp + 1) if self.dp % d == 0)} (nodes that each hold one"
                " sharded copy)"
            )

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A mesh with only the dimensions whose degree is above 1 (always at least ``dp``). Hybrid sharding builds
        ("dp_replicate", "dp_shard") and flattens them into "dp" too, so samplers and reductions still use "dp"."""
        names, shape = [], []
        dp_dims = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if self.hybrid \
            else (("dp", self.dp),)
        for name, degree in (("pp", self.pp), *dp_dims, ("tp", self.tp)):
            if degree > 1 or name.startswith("dp"):
                names.append(name)
                shape.append(degree)
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        if self.hybrid:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh fully_shard takes: 2D (replicate, shard) for hybrid sharding, else the 1D "dp" mesh."""
        return mesh["dp_replicate", "dp_shard"] if self.hybrid else mesh["dp"]


def device_type_of(device: torch.device | str) -> str:
    return torch.device(device).type
