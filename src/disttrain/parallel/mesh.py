"""Parallel degrees and the device meshes: the one place that does world-size arithmetic.

:class:`ParallelDims` is how degrees travel everywhere (strategy options -> engine -> planner -> simulator -> CLI ->
run reports); every strategy states its options as one (``Engine.parallel_dims``). :meth:`ParallelDims.build` makes
the device meshes the engines shard over, named by what they are for (:class:`Meshes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# The dimensions in mesh order (outermost first): pipeline stages talk least, tensor-parallel ranks most, so the
# tensor-parallel ranks are neighbours (one node) and the pipeline spans nodes.
DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism over ``world_size`` ranks; their product is the world size.

    dp_replicate: copies of the model that see different data (DDP's replicas, or HSDP's replicas across nodes).
    dp_shard: ranks that share one copy's shards (FSDP2 / ZeRO-3) and see different data; -1: what is left.
    cp: context parallel: ranks that split each sequence (they see the same samples, different tokens).
    tp: tensor parallel: ranks that split each block's heads and MLP.
    pp: pipeline parallel: stages over ranks.
    ep: expert parallel: ranks that split an MoE layer's experts, borrowed from ``dp_shard`` (as torchtitan
        does), so it adds no ranks of its own; they see different samples and exchange tokens with all-to-all.

    Data parallel (different samples per rank) is ``dp = dp_replicate * dp_shard``; FSDP shards over
    ``dp_shard * cp`` ranks (context-parallel ranks hold the same parameters, so they share the shards too).
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be a positive integer")
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        fixed = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % fixed:
                raise ValueError(f"world_size={self.world_size} is not divisible by"
                                 f" {self._product(without='dp_shard')}; choose sizes whose product divides"
                                 f" {self.world_size}")
            object.__setattr__(self, "dp_shard", self.world_size // fixed)
        elif not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ValueError(f"dp_shard={self.dp_shard!r} must be a positive integer, or -1 for what is left")
        if fixed * self.dp_shard != self.world_size:
            raise ValueError(f"{self._product(every=True)} does not equal world_size={self.world_size}; pass"
                             " dp_shard=-1 to derive it")
        if self.dp_shard % self.ep:
            choices = ", ".join(map(str, divisors(self.dp_shard)))
            raise ValueError(f"ep={self.ep} does not divide dp_shard={self.dp_shard}: expert-parallel ranks are taken"
                             f" from the data-sharding ranks; choose one of {choices}")

    def _product(self, without: str = "", every: bool = False) -> str:
        """``"tp*pp=4 (tp=2, pp=2)"``: the product of the degrees above 1 (of all of them with ``every``)."""
        names = [n for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if n != without and
                 (every or getattr(self, n) > 1)] or ["tp"]
        product = math.prod(getattr(self, n) for n in names)
        if len(names) == 1:
            return f"{names[0]}={product}"
        return f"{'*'.join(names)}={product} ({', '.join(f'{n}={getattr(self, n)}' for n in names)})"

    @classmethod
    def data_parallel(cls, world_size: int, replicate: bool = False) -> ParallelDims:
        """Every rank a data-parallel rank: DDP's replicas (``replicate=True``) or FSDP's / ZeRO-3's shards."""
        return cls(world_size, dp_replicate=world_size, dp_shard=1) if replicate else cls(world_size)

    # -- derived degrees ------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks one copy of the parameters is sharded over (FSDP's group): ``dp_shard * cp``."""
        return self.dp_shard * self.cp

    @property
    def hybrid(self) -> bool:
        """Sharded copies replicated across groups (HSDP)."""
        return self.dp_replicate > 1 and self.shard > 1

    def degrees(self) -> dict[str, int]:
        """The degrees above 1 (``{"dp_shard": 8, "tp": 2}``), the data-sharding one always, for labels and run
        reports."""
        values = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
                  "pp": self.pp, "ep": self.ep}
        return {k: v for k, v in values.items() if v > 1 or (k == "dp_shard" and self.dp_replicate == 1)}

    def label(self) -> str:
        """``"dp_shard=8 tp=2"``: what :meth:`degrees` holds, in one line."""
        return " ".join(f"{k}={v}" for k, v in self.degrees().items())

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits along each dimension (mesh order :data:`DIMENSIONS`: tp fastest)."""
        out = {}
        for name in reversed(DIMENSIONS):
            size = getattr(self, name)
            out[name], rank = rank % size, rank // size
        return out

    def rank_of(self, **coordinates: int) -> int:
        """The global rank at these coordinates (unnamed dimensions at 0)."""
        rank = 0
        for name in DIMENSIONS:
            rank = rank * getattr(self, name) + coordinates.get(name, 0)
        return rank

    # -- meshes -------------------------------------------------------------------------------------------------
    def build(self, device_type: str) -> Meshes:
        """The device meshes of these degrees (collective: every rank calls it once the process group exists)."""
        sizes = {name: getattr(self, name) for name in DIMENSIONS}
        # Only dimensions above 1 (the data-sharding one always, so that every mesh below exists).
        names = tuple(n for n in DIMENSIONS if sizes[n] > 1 or n == "dp_shard")
        if self.ep > 1:
            if self.cp > 1 or self.dp_replicate > 1 or self.pp > 1:
                raise ValueError(f"ep={self.ep} with {self._product(without='ep')}: expert parallelism composes with"
                                 " data sharding and tensor parallelism; use cp=1, dp_replicate=1 and pp=1 with it")
            # The data-sharding ranks split into (copies of each expert, expert-parallel ranks): neighbours hold
            # different experts.
            sizes = {**sizes, "dp_shard_mod_ep": self.dp_shard // self.ep, "ep": self.ep}
            names = tuple(x for n in names for x in (("dp_shard_mod_ep", "ep") if n == "dp_shard" else (n,)))
        world = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        dp_shard = world[("dp_shard_mod_ep", "ep")]._flatten("dp_shard") if self.ep > 1 else None

        def joined(parts: tuple[str, ...], name: str) -> DeviceMesh:
            if dp_shard is not None:  # expert parallel: dp_shard alone (other dimensions they join are refused)
                return dp_shard
            present = tuple(p for p in parts if p in names)
            return world[present]._flatten(name) if len(present) > 1 else world[present[0]]

        dp = joined(("dp_replicate", "dp_shard"), "dp")
        shard = joined(("dp_shard", "cp"), "dp_shard_cp")
        if self.hybrid and self.cp > 1:
            raise ValueError(f"dp_replicate={self.dp_replicate} with cp={self.cp}: hybrid sharding and context"
                             " parallelism together are not supported; use dp_replicate=1")
        # Replicas (HSDP; also of unsharded copies, dp_shard=1): fully_shard takes a 2-D (replicate, shard) mesh and
        # all-reduces gradients over its first dimension. On the shard mesh alone the replicas would never meet.
        fsdp = world["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else shard
        experts: dict[str, DeviceMesh] = {}
        if self.ep > 1:
            # Each rank dispatches the tokens it holds itself (ranks of one tensor-parallel group hold the same
            # ones): a one-rank mesh per rank, for transformers' expert dispatch.
            own = init_device_mesh(device_type, (self.world_size, 1), mesh_dim_names=("all", "own"))["own"]
            experts = dict(ep=world["ep"], expert_fsdp=world["dp_shard_mod_ep"], ep_tokens=own)
        return Meshes(world=world, dp=dp, fsdp=fsdp, cp=world["cp"] if self.cp > 1 else None,
                      replicate=world["dp_replicate"] if self.dp_replicate > 1 else None,
                      tp=world["tp"] if self.tp > 1 else None, pp=world["pp"] if self.pp > 1 else None, **experts)


@dataclass(frozen=True)
class Meshes:
    """The device meshes of one :class:`ParallelDims`, by use. ``world``: every dimension above 1 (what Lightning's
    ``device_mesh`` shows); ``dp``: the ranks that see different samples (samplers, buffers); ``fsdp``: what
    ``fully_shard`` shards over (``dp_shard x cp``; 2-D with ``dp_replicate`` for HSDP); ``replicate``/``cp``/``tp``/
    ``pp``: those dimensions, None when their degree is 1. Under expert parallelism: ``ep`` (the ranks that split the
    experts), ``expert_fsdp`` (the ranks holding the same experts, which FSDP shards them over) and ``ep_tokens`` (the
    ranks holding this rank's tokens: itself)."""

    world: DeviceMesh
    dp: DeviceMesh
    fsdp: DeviceMesh
    replicate: Optional[DeviceMesh] = None
    cp: Optional[DeviceMesh] = None
    tp: Optional[DeviceMesh] = None
    pp: Optional[DeviceMesh] = None
    ep: Optional[DeviceMesh] = None
    expert_fsdp: Optional[DeviceMesh] = None
    ep_tokens: Optional[DeviceMesh] = None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


