"""Managed-collision tables under ``disttrain_recsys`` (torch and torchrec only): their sharder, a CPU stand-in for
the eviction kernel fbgemm ships for CUDA only, and what the daily job reads off them (the ids each rank holds,
the end of a day's pending admissions, the layout a checkpoint was saved in).

torchrec shards managed tables row-wise only: rank r holds rows [r * N / W, (r + 1) * N / W) of a table and admits
the raw ids of input block r (``id // ceil(input_hash_size / W)``). Which rank holds an id thus depends on the
number of processes W: a checkpoint saved on another number is loaded by :func:`readmit`, which routes every id it
holds to its new process with its row, optimizer state and eviction metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

EMPTY = torch.iinfo(torch.int64).max  # torchrec's marker of a free slot in _mch_sorted_raw_ids
MC_BUFFER = "_mch_sorted_raw_ids"
# The checkpoint metadata entry naming the number of processes the managed tables' ids were laid out for. A folder
# written by one process from full tensors (a version rebuilt from a chain of deltas) holds every table in one
# chunk, so only this entry tells its layout apart from a one-process model's.
PROCESSES_KEY = "managed_table_processes"


def managed_sharder(ebc_sharder: Any) -> Any:
    """torchrec's ``ManagedCollisionEmbeddingBagCollectionSharder`` over ``ebc_sharder`` (which must offer row-wise
    sharding, see engines.recsys.sharders), offering the kernels ``ebc_sharder`` offers (torchrec's own list names
    UVM and key-value kernels, which the planner cannot estimate on CPU) and resetting evicted rows on CPU too."""
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
        ShardedManagedCollisionEmbeddingBagCollection,
    )

    class CpuEvictions(ShardedManagedCollisionEmbeddingBagCollection):
        def _evict(self, evictions_per_table: dict[str, Any]) -> None:
            if self._device.type != "cpu":
                return super()._evict(evictions_per_table)
            reset_rows(self, evictions_per_table)

    class Sharder(ManagedCollisionEmbeddingBagCollectionSharder):
        def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
            return self._e_sharder.compute_kernels(sharding_type, compute_device_type)

        def shard(self, module: Any, params: Any, env: Any, device: Any = None, module_fqn: Any = None) -> Any:
            return CpuEvictions(module, params, ebc_sharder=self._e_sharder, mc_sharder=self._mc_sharder, env=env,
                                device=device or torch.device("cpu"))

    return Sharder(ebc_sharder=ebc_sharder)


@torch.no_grad()
def reset_rows(sharded: Any, evictions_per_table: dict[str, Any]) -> None:
    """What torchrec's ``_evict`` does, in plain torch: the rows given to new ids start from the table's ``init_fn``
    and with zero optimizer state (fbgemm's ``reset_weight_momentum`` has no CPU kernel)."""
    for table, rows in evictions_per_table.items():
        if rows is None or rows.numel() == 0:
            continue
        tbe, index = sharded._table_to_tbe_and_index[table]
        rows = rows.long()
        weights = tbe.split_embedding_weights()[int(index)]  # views into the kernel's own storage
        weights[rows] = sharded._embedding_module._table_name_to_config[table].init_fn(weights[rows])
        for state in tbe.split_optimizer_states()[int(index)]:
            state[rows] = 0


def sharded_managed(root: nn.Module) -> Iterator[Any]:
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection

    for module in root.modules():
        if isinstance(module, BaseShardedManagedCollisionEmbeddingCollection):
            yield module


def local_modules(root: nn.Module) -> dict[str, Any]:
    """``{table: this rank's MCHManagedCollisionModule}`` of every sharded managed table in ``root``."""
    return {table: mcm for sharded in sharded_managed(root)
            for table, mcm in sharded._managed_collision_collection._managed_collision_modules.items()}


@torch.no_grad()
def held_ids(root: nn.Module) -> dict[str, torch.Tensor]:
    """``{table: the raw ids this rank's part of the table holds, sorted}`` (a copy)."""
    held = {}
    for table, mcm in local_modules(root).items():
        ids = mcm._mch_sorted_raw_ids
        held[table] = torch.sort(ids[ids != EMPTY]).values.clone()
    return held


@torch.no_grad()
def finish_admissions(root: nn.Module) -> None:
    """Admit the ids seen since the last eviction now and reset their rows, as the next eviction would: called at the
    end of a day, so that the model saved then holds no pending state that a resumed run (a new process) would lose;
    the next batch starts a fresh interval, as it does after a load."""
    for sharded in sharded_managed(root):
        mcc = sharded._managed_collision_collection
        for mcm in mcc._managed_collision_modules.values():
            if getattr(mcm, "_current_history_buffer_offset", 0) > 0:
                mcm._coalesce_history()
            mcm._current_iter = -1  # as after a load: the next batch reads the count from _current_iter_tensor
            # and sizes the buffer of ids awaiting admission (torchrec: 1.25 x eviction_interval x the ids of the
            # first batch this process routes to it; ids beyond it wait for the next interval)
            mcm._input_history_buffer_size = -1
        evictions = mcc.evict()
        if any(rows is not None for rows in evictions.values()):
            sharded._evict(evictions)


def _processes() -> int:
    """The processes of the run (1 without a process group: a model loaded in a plain process)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def has_managed(root: nn.Module) -> bool:
    return any(True for _ in sharded_managed(root))


def layout_processes(root: nn.Module) -> dict[str, int]:
    """The metadata entry a checkpoint of ``root`` records its managed tables' layout with (empty without any)."""
    if not has_managed(root):
        return {}
    return {PROCESSES_KEY: _processes()}


def saved_world_size(path: str | Path, root: nn.Module,
                     metadata: dict[str, Any] | None = None) -> tuple[int, int] | None:
    """(processes a checkpoint's managed tables were laid out for, processes now) when they differ, else None. Read
    from the checkpoint's metadata (:func:`layout_processes`); a checkpoint written before it was recorded, from the
    number of chunks its ids were saved in (one per process of a sharded save). ``metadata``: the checkpoint's, when
    the caller has read it already (``ckpt.read_meta``)."""
    from disttrain.parallel.checkpoint import io as ckpt

    if not has_managed(root):
        return None
    world = _processes()
    saved = (ckpt.read_meta(path) if metadata is None else metadata).get(PROCESSES_KEY)
    if saved is None:
        stored = ckpt.CheckpointReader(path).metadata.state_dict_metadata
        saved = next((len(meta.chunks) for key, meta in stored.items()
                      if key.endswith(MC_BUFFER) and hasattr(meta, "chunks")), None)
    return (int(saved), world) if saved is not None and int(saved) != world else None


def one_bucket_per_process(module: nn.Module, world_size: int) -> None:
    """Give every managed table of the unsharded ``module`` one input bucket per process before planning: torchrec's
    planner refuses a bucket count the processes do not divide (one, by default), and one per process is what the
    sharded tables are rebuilt with anyway."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    for m in module.modules():
        if isinstance(m, MCHManagedCollisionModule):
            m._buckets = world_size


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested checkpoint dict (``read_full``'s) as ``{"a/b/c": leaf}``."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


@torch.no_grad()
def admit(sharded: Any, table: str, mcm: Any, ids: torch.Tensor, metadata: dict[str, torch.Tensor],
          weights: torch.Tensor, states: list[torch.Tensor] | None = None) -> None:
    """Make ``ids`` the ids this process's part of ``table`` holds: slot k (row offset + k) gets ``ids[k]``, its
    eviction ``metadata[name][k]`` and its row ``weights[k]``; the optimizer state of those rows is ``states[i][k]``
    (None: fresh, as is every other row's)."""
    n, offset = ids.numel(), mcm._output_global_offset
    fresh = torch.full_like(mcm._mch_sorted_raw_ids, EMPTY)
    fresh[:n] = ids
    mcm._mch_sorted_raw_ids.copy_(fresh)
    mcm._mch_remapped_ids_mapping.copy_(torch.arange(offset, offset + mcm._zch_size))
    for name, buffer in mcm._mch_metadata.items():
        buffer.zero_()
        buffer[:n] = metadata[name]
    mcm._sort_mch_buffers()
    tbe, index = sharded._table_to_tbe_and_index[table]
    rows = tbe.split_embedding_weights()[int(index)]  # this process's rows, a view into the kernel's storage
    rows[:n] = weights.to(rows.dtype)
    for i, target in enumerate(tbe.split_optimizer_states()[int(index)]):
        target.zero_()
        if states is not None:
            target[:n] = states[i].reshape(target[:n].shape).to(target.dtype)


@torch.no_grad()
def readmit(path: str | Path, root: nn.Module, fused_key: str) -> dict[str, int]:
    """Rebuild ``root``'s managed tables (sharded over this run's processes) from a checkpoint saved on another
    number: every id the checkpoint holds is routed to the process of its input range now, and each process admits
    its ids, most frequent (LFU, distance-LFU) or most recently seen (LRU) first, as many as its part of the table
    holds (its last row stays the shared row of ids not held), each with its row, its optimizer state and its
    eviction metadata as saved. Collective-free: every process reads the checkpoint itself (``read_full``).
    Returns ``{table: ids left out}`` (none when the new parts hold at least as many ids as the old ones did)."""
    import numpy as np

    from disttrain.parallel.checkpoint import io as ckpt

    state = _flat(ckpt.read_full(path, keys={"state_dict", fused_key}))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = _processes()
    dropped: dict[str, int] = {}
    for sharded in sharded_managed(root):
        for table, mcm in sharded._managed_collision_collection._managed_collision_modules.items():
            def saved(suffix: str) -> torch.Tensor:
                found = [v for k, v in state.items() if k.startswith("state_dict/") and k.endswith(suffix)]
                if len(found) != 1:
                    raise ckpt.CheckpointError(f"checkpoint {str(path)!r} has no single {suffix.lstrip('.')} for"
                                               f" managed table {table}; it is not a checkpoint of this model")
                return found[0]

            raw, rows = saved(f".{table}.{MC_BUFFER}"), saved(f".{table}._mch_remapped_ids_mapping")
            weight = saved(f"embedding_bags.{table}.weight")
            metadata = {name: saved(f".{table}._mch_{name}") for name in mcm._mch_metadata}
            states = [state[k] for k in sorted(state) if k.startswith(f"{fused_key}/")
                      and f"embedding_bags.{table}.weight" in k and isinstance(state[k], torch.Tensor)
                      and state[k].dim() >= 1 and state[k].shape[0] == weight.shape[0]]
            held = raw != EMPTY
            ids, rows = raw[held], rows[held]
            metadata = {name: values[held] for name, values in metadata.items()}
            block = -(-int(mcm._input_hash_size) // world)  # torchrec routes id to process id // block
            mine = (ids // block) == rank
            ids, rows = ids[mine], rows[mine]
            metadata = {name: values[mine] for name, values in metadata.items()}
            rank_by = metadata.get("counts", metadata.get("last_access_iter"))
            order = np.lexsort((ids.numpy(), -rank_by.numpy())) if rank_by is not None else np.argsort(ids.numpy())
            keep = torch.from_numpy(order[:mcm._zch_size - 1])
            dropped[table] = int(ids.numel() - keep.numel())
            ids, rows = ids[keep], rows[keep]
            admit(sharded, table, mcm, ids, {name: values[keep] for name, values in metadata.items()},
                  weight[rows], [source[rows] for source in states])
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = torch.tensor(list(dropped.values()), dtype=torch.int64)
        dist.all_reduce(counts)
        dropped = dict(zip(dropped, counts.tolist()))
    return dropped
