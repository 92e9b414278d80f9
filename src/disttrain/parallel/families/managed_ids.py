"""Collisionless ids for torchrec tables (torch and torchrec only): each table wrapped in torchrec's managed-collision
modules (``MCHManagedCollisionModule`` in a ``ManagedCollisionEmbeddingBagCollection``), so that every id the table
holds has a row of its own and ids beyond its size are evicted by a policy instead of silently sharing rows.

A managed table of ``num_embeddings`` rows per shard keeps its last row for the ids it does not hold (before they are
admitted, or when the policy keeps them out): that row is shared, every other row belongs to one id. Ids are
admitted and evicted every ``eviction_interval`` training batches; an evicted id's row starts again from zeros, with
its optimizer state reset.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Sequence

import torch

IDS = ("hashed", "managed")
EVICTION_POLICIES = ("lfu", "lru", "distance_lfu")


@dataclass(frozen=True)
class ManagedCollisions:
    """The ``model.managed_collisions`` mapping of a recipe (used with ``ids: managed``).

    eviction_policy: which ids a full table drops for new ones: "lfu" (least frequently seen), "lru" (least recently
        seen) or "distance_lfu" (frequency decayed by how long ago the id was seen).
    eviction_interval: training batches between admissions and evictions; ids seen in between wait for the next.
    input_hash_size: raw ids are taken modulo this before the table sees them (2**32 keeps Criteo's 32-bit ids).
    """

    eviction_policy: str = "lfu"
    eviction_interval: int = 1
    input_hash_size: int = 2 ** 32

    def __post_init__(self) -> None:
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"managed_collisions.eviction_policy={self.eviction_policy!r} is not one of"
                             f" {', '.join(EVICTION_POLICIES)}")
        if int(self.eviction_interval) < 1:
            raise ValueError(f"managed_collisions.eviction_interval={self.eviction_interval} must be at least 1"
                             " (training batches between evictions)")
        if not 1 <= int(self.input_hash_size) <= 2 ** 62:
            raise ValueError(f"managed_collisions.input_hash_size={self.input_hash_size} must be within 1 .. 2**62;"
                             " e.g. 4294967296 (2**32) for 32-bit ids")

    @classmethod
    def of(cls, mapping: Optional[Mapping[str, Any]]) -> "ManagedCollisions":
        mapping = dict(mapping or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(mapping) - set(known))
        if unknown:
            raise ValueError(f"managed_collisions has unknown key {unknown[0]!r}; its keys are {', '.join(known)}")
        return cls(**mapping)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_ids(ids: str) -> str:
    if ids not in IDS:
        raise ValueError(f"ids={ids!r} is not one of {', '.join(IDS)}; hashed: ids modulo the table size (rows are"
                         " shared silently), managed: one row per id with eviction (torchrec managed collisions)")
    return ids


def eviction_policy(name: str) -> Any:
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy

    return {"lfu": LFU_EvictionPolicy, "lru": LRU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}[name]()


def zero_rows(rows: torch.Tensor) -> torch.Tensor:
    """Where an admitted id's row starts (torchrec calls it on the evicted rows): zeros, the same on any number of
    processes and after any resume, where a random draw would depend on the generator's position."""
    return torch.zeros_like(rows)


def managed_tables(configs: Sequence[Any], options: ManagedCollisions,
                   device: Optional[torch.device] = None) -> Any:
    """A ``ManagedCollisionEmbeddingBagCollection`` over torchrec ``EmbeddingBagConfig``s (one managed-collision module
    per table, as large as the table)."""
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    for config in configs:
        config.init_fn = zero_rows  # what an evicted row is reset to; the first weights are drawn as usual
    buffers = device if device is not None and device.type != "meta" else torch.device("cpu")
    modules = {config.name: MCHManagedCollisionModule(
        zch_size=config.num_embeddings, device=buffers, eviction_policy=eviction_policy(options.eviction_policy),
        eviction_interval=int(options.eviction_interval), input_hash_size=int(options.input_hash_size),
        name=config.name) for config in configs}
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=list(configs), device=device),
        ManagedCollisionCollection(modules, list(configs)))


def is_managed(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds managed-collision tables (plain or sharded)."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    try:
        from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection
    except ImportError:  # pragma: no cover
        BaseShardedManagedCollisionEmbeddingCollection = BaseManagedCollisionEmbeddingCollection
    return any(isinstance(m, (BaseManagedCollisionEmbeddingCollection, BaseShardedManagedCollisionEmbeddingCollection))
               for m in module.modules())


def id_space(model: Mapping[str, Any]) -> list[int]:
    """What each column's raw ids are taken modulo before the tables see them, from a ``model:`` mapping: the table
    size for hashed ids (the id is the row), ``managed_collisions.input_hash_size`` for managed ones (the table
    gives the id its row)."""
    sizes = [int(n) for n in model["num_embeddings_per_feature"]]
    if check_ids(model.get("ids", "hashed")) == "hashed":
        return sizes
    return [int(ManagedCollisions.of(model.get("managed_collisions")).input_hash_size)] * len(sizes)
