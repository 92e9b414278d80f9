"""What happens to the categorical ids of each day the daily job trains, and the warm start of managed-collision
tables from a hashed model.

Per day and over all columns (``IdCounts``): ``new_ids``, the distinct ids not seen on any earlier day of the model;
for hashed tables ``collisions``, the distinct ids that land on a row another id already holds (the row's first id
keeps it); for managed tables ``evictions``, the ids the tables held at the start of the day and dropped by its end.
Memory stays bounded whatever the number of ids: the ids seen are a Bloom filter of ``SEEN_BITS`` bits per column
(an id may rarely be taken for seen: new ids are counted at most that much low), and a hashed table keeps a 32-bit
fingerprint of each row's first id (4 bytes a row). Both are saved with the model, so a resumed run and a warm start
go on counting where the model left off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from disttrain.parallel.engines.managed_ids import admit, held_ids, local_modules
from disttrain.parallel.families.managed_ids import id_space

SEEN_BITS = 2 ** 20  # per column: 128 KiB; about 2% of new ids taken for seen after 100k distinct ids (3 hashes)
HASHES = 3
KEEP_DAYS = 400  # per-day figures kept with the model (the record of each day holds its own)
STATE_KEY = "id_counts"  # in the model's metadata (meta.pt)


def _mix(values: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of uint64 ``values`` (a well-spread 64-bit hash)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) % 2 ** 64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def fingerprint(ids: np.ndarray) -> np.ndarray:
    """A non-zero 32-bit fingerprint per id (0 marks a row no id holds yet)."""
    return ((_mix(ids, HASHES) >> np.uint64(32)).astype(np.uint32)) | np.uint32(1)


class IdCounts:
    """Counts of new ids, collisions (hashed tables) and evictions (managed tables) per day, for a ``model:`` mapping.
    Call :meth:`count_day` with each day's ids before it is trained, :meth:`add_evictions` after; :meth:`state` is
    what is saved with the model, :meth:`restore` reads it back."""

    def __init__(self, model: Mapping[str, Any], bits: int = SEEN_BITS) -> None:
        self.managed = model.get("ids", "hashed") == "managed"
        # An id as the tables tell ids apart: the raw 64 bits (hashed), the raw id modulo the input hash size (managed).
        self.space = np.asarray(id_space(model), dtype=np.uint64) if self.managed else None
        self.rows = [int(n) for n in model["num_embeddings_per_feature"]]
        self.seen = np.zeros((len(self.rows), bits // 8), dtype=np.uint8)
        self.owners = None if self.managed else [np.zeros(n, dtype=np.uint32) for n in self.rows]
        self.days: dict[str, dict[str, Any]] = {}

    # -- counting ------------------------------------------------------------------------------------------------
    def count_day(self, day: str, sparse: np.ndarray) -> dict[str, Any]:
        """Count one day's raw ids (N, F) (0: a missing field, left out) and remember them as seen."""
        new, collisions = [], []
        for f in range(sparse.shape[1]):
            column = np.asarray(sparse[:, f]).view(np.uint64)
            if self.space is not None:
                column = column % self.space[f]
            ids, first = np.unique(column, return_index=True)
            keep = ids != 0
            ids = ids[keep][np.argsort(first[keep], kind="stable")]  # in the order the day meets them
            new.append(self._see(f, ids))
            if self.owners is not None:
                collisions.append(self._claim(f, ids))
        figures: dict[str, Any] = {"ids": "managed" if self.managed else "hashed", "new_ids": int(sum(new)),
                                   "new_ids_per_table": new}
        if self.owners is not None:
            figures.update(collisions=int(sum(collisions)), collisions_per_table=collisions)
        self.days[day] = figures
        for old in sorted(self.days)[:-KEEP_DAYS]:
            del self.days[old]
        return figures

    def _see(self, f: int, ids: np.ndarray) -> int:
        bits = self.seen.shape[1] * 8
        positions = [(_mix(ids, k) % np.uint64(bits)).astype(np.int64) for k in range(HASHES)]
        present = np.ones(len(ids), dtype=bool)
        for p in positions:
            present &= (self.seen[f, p >> 3] >> (p & 7).astype(np.uint8)) & 1 == 1
        for p in positions:
            np.bitwise_or.at(self.seen[f], p >> 3, (1 << (p & 7)).astype(np.uint8))
        return int((~present).sum())

    def _claim(self, f: int, ids: np.ndarray) -> int:
        """Rows nobody holds go to the first id that lands on them; returns how many ids land on another id's row."""
        owners = self.owners[f]
        rows = (ids % np.uint64(self.rows[f])).astype(np.int64)
        prints = fingerprint(ids)
        free = owners[rows] == 0
        claimed, first = np.unique(rows[free], return_index=True)
        owners[claimed] = prints[free][first]
        return int((owners[rows] != prints).sum())

    def add_evictions(self, day: str, evictions: Sequence[int]) -> None:
        self.days[day].update(evictions=int(sum(evictions)), evictions_per_table=[int(e) for e in evictions])

    # -- saved with the model ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"ids": "managed" if self.managed else "hashed", "seen": torch.from_numpy(self.seen),
                                 "days": self.days}
        if self.owners is not None:
            state["owners"] = [torch.from_numpy(o.view(np.int32)) for o in self.owners]
        return state

    def restore(self, state: Optional[Mapping[str, Any]]) -> "IdCounts":
        """Go on from a saved :meth:`state` (None: a model saved without one, counted from here on). The ids seen
        carry over between hashed and managed tables; the row owners only between hashed tables of the same sizes."""
        if not state:
            return self
        seen = state["seen"].numpy()
        if seen.shape == self.seen.shape:
            self.seen = seen.copy()
        self.days = dict(state.get("days") or {})
        owners = state.get("owners")
        if self.owners is not None and owners is not None and [len(o) for o in owners] == self.rows:
            self.owners = [o.numpy().view(np.uint32).copy() for o in owners]
        return self


def count_evictions(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                    device: torch.device = torch.device("cpu")) -> list[int]:
    """Per table (in ``before``'s order): ids held before and not after, summed over all ranks (collective)."""
    counts = torch.tensor([int((~torch.isin(before[t], after[t])).sum()) for t in before], dtype=torch.int64,
                          device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return counts.tolist()


# -- hashed -> managed ------------------------------------------------------------------------------------------
def is_hashed_checkpoint(path: str | Path, module: nn.Module) -> bool:
    """Whether ``path`` holds hashed tables (plain ``embedding_bags`` weights) while ``module`` has managed ones."""
    from disttrain.parallel.checkpoint import io as ckpt

    if not local_modules(module):
        return False
    keys = ckpt.CheckpointReader(path).metadata.state_dict_metadata
    return any(".ebc.embedding_bags." in k for k in keys) and not any("_managed_collision" in k for k in keys)


@torch.no_grad()
def warm_start_from_hashed(engine: Any, module: nn.Module, path: str | Path, model: Mapping[str, Any],
                           days: Sequence[np.ndarray]) -> dict[str, Any]:
    """Warm-start ``module`` (sharded, managed tables) from a hashed checkpoint: the dense part as saved; in every
    table the ids of ``days`` (raw (N, F) arrays), most frequent first, as many as each rank's part holds (its last
    row stays the shared row of ids not held), each id's row starting from the row the id hashed to in the old table.
    The tables' optimizer state starts afresh. Returns the checkpoint's metadata. Collective (the load)."""
    from disttrain.parallel.checkpoint import io as ckpt
    from disttrain.parallel.engines.managed_ids import sharded_managed

    metadata = engine.load(path, module, strict=False, optimizer=False)
    old = _old_tables(ckpt.read_full(path, keys={"state_dict"}))
    space = id_space(model)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for sharded in sharded_managed(module):
        for table, mcm in sharded._managed_collision_collection._managed_collision_modules.items():
            f = int(table.rsplit("_", 1)[1])
            if table not in old:
                raise ckpt.CheckpointError(f"checkpoint {str(path)!r} has no hashed table {table}; warm-start a"
                                           " managed model from a hashed one of the same columns")
            column = np.concatenate([np.asarray(d[:, f]).view(np.uint64) % np.uint64(space[f]) for d in days])
            ids, counts = np.unique(column, return_counts=True)
            block = -(-space[f] // world)  # torchrec routes id to rank id // block
            mine = (ids // np.uint64(block)).astype(np.int64) == rank
            ids, counts = ids[mine], counts[mine]
            order = np.lexsort((ids, -counts))[:mcm._zch_size - 1]
            _admit(sharded, table, mcm, ids[order].astype(np.int64), counts[order], old[table])
    return metadata


def _old_tables(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{table: full weight}`` of the hashed tables in a checkpoint read by ``read_full``."""
    found: dict[str, torch.Tensor] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{name}.")
            elif ".ebc.embedding_bags." in f".{name}" and name.endswith(".weight"):
                found[name.split(".")[-2]] = value
    walk(state, "")
    return found


def _admit(sharded: Any, table: str, mcm: Any, ids: np.ndarray, counts: np.ndarray, old: torch.Tensor) -> None:
    """Put ``ids`` into this rank's part of ``table`` (slot k: row offset + k) with their counts as their frequency,
    seen now, and start row offset + k from the old table's row ``ids[k] % old rows``."""
    now = int(mcm._current_iter_tensor.item())
    metadata = {name: torch.from_numpy(counts.astype(np.int64)) if name == "counts" else torch.full((len(ids),), now)
                for name in mcm._mch_metadata}
    admit(sharded, table, mcm, torch.from_numpy(ids), metadata,
          old[torch.from_numpy((ids.astype(np.uint64) % np.uint64(old.shape[0])).astype(np.int64))])


def describe_ids(figures: Mapping[str, Any]) -> str:
    """One day's figures for the job's line: "1,234 new ids, 56 collisions" (hashed) or "..., 7 evictions"."""
    kind = "collisions" if figures.get("ids") == "hashed" else "evictions"
    return f"{figures['new_ids']:,} new ids, {figures.get(kind, 0):,} {kind}"
