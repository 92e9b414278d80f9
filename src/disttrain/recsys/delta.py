"""Delta versions of the recommender's model store: what changed since the version a run started from.

An hour of clicks touches a small share of a large model's embedding rows, so re-writing the whole model every
hour would move the whole model (the 5B-parameter DeepFM: ~20 GB) to publish a few percent of it. A delta version
holds only the rows that changed since its base (the version the run warm-started from) plus the dense part:

    versions/000007/
      rank00000.pt ...   each rank's changed rows of its table shards and of their fused optimizer state, in
                         global coordinates: per piece its key, first column, rows (numbers or a bit mask) and
                         values, packed into a few tensors (see pack)
      dense.pt           every tensor that is not sharded (the dense network, DDP-replicated) and every other leaf,
                         the job's metadata (dense optimizer state, run info) and the per-row state's column split
      info.json          kind "delta", base, chain (the full version it starts from, then every delta up to this one)
                         and each file's sha256 and size

Each .pt file is written through :func:`pack_tree` (small tensors in one buffer, keys and row ranges compressed) and
read with ``weights_only=True``; a table's weights and optimizer state share one stored row set.

Which rows changed is found by comparing each row's fingerprint (two 31-bit polynomial hashes of the row's bits)
with the fingerprint taken when the base was loaded, so it holds for any table layout, for rows that managed ids
remapped or evicted, and for optimizer state that moved while its row did not. A missed change needs both hashes
of a changed row to match, about 1 in 4.6e18.

Reading a version never needs a process group: :func:`read_version` assembles full tensors from the chain (every
file verified), :func:`materialize` writes them as a full version, and :func:`load_current` gives a serving
process the model ``current`` points at, never a mix of two versions.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.engines.managed_ids import PROCESSES_KEY, saved_world_size
from disttrain.parallel.engines.recsys import FUSED_OPTIMIZER_KEY, ROW_STATE_KEY, fused_optimizer_state, \
    load_fused_optimizer_state, load_model_state, row_states
from disttrain.parallel.guards.diskspace import remove, writing
from disttrain.recsys.publish import ModelStore, StoreError, fsync_dir, read_json, write_json_atomic

DENSE_FILE = "dense.pt"
INFO_FILE = "info.json"
FULL, DELTA = "full", "delta"
_P = 2 ** 31 - 1  # a prime: each lane of a row's fingerprint is a sum of (bits * weight) mod _P
_LANES_SEED = 20261204
_READ_ATTEMPTS = 5


class DeltaError(RuntimeError):
    """A delta version that cannot be used (the message names the file and what to do)."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


# -- the model's state as flat leaves --------------------------------------------------------------------------
def live_state(root: nn.Module) -> dict[str, Any]:
    """What a checkpoint of ``root`` holds, nested as :meth:`RecsysEngine.save` writes it."""
    return {"state_dict": root.state_dict(), FUSED_OPTIMIZER_KEY: fused_optimizer_state(root)}


def leaves(nested: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """``(key, value, container, index)`` for every leaf of nested dicts and lists (keys joined by "/"), with the
    container holding it so that a caller can replace it."""
    items = nested.items() if isinstance(nested, dict) else enumerate(nested)
    for name, value in list(items):
        key = f"{prefix}/{name}" if prefix else str(name)
        if isinstance(value, (dict, list)) and not isinstance(value, torch.Tensor):
            yield from leaves(value, key)
        else:
            yield key, value, nested, name


def is_sharded(value: Any) -> bool:
    return hasattr(value, "local_shards") and hasattr(value, "metadata")


def _size(value: Any) -> list[int]:
    """A sharded or plain tensor's global size (a ShardedTensor's from its metadata: its ``.size()`` warns)."""
    return list(value.metadata().size) if is_sharded(value) else list(value.shape)


def _shards(value: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """(local tensor, global offsets) of each shard this rank holds of a ShardedTensor."""
    return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]


# -- fingerprints ------------------------------------------------------------------------------------------------
def _lane_weights(columns: int) -> torch.Tensor:
    """(2, columns) fixed weights in [1, _P) (the same on every rank and in every run)."""
    generator = torch.Generator().manual_seed(_LANES_SEED)
    return torch.randint(1, _P, (2, max(columns, 1)), generator=generator, dtype=torch.int64)


def row_fingerprints(tensor: torch.Tensor) -> torch.Tensor:
    """One int64 per row of ``tensor`` (per element of a 1-D one) from the bits of its values: equal rows give equal
    fingerprints; a changed row gives another one except with probability ~2^-62."""
    t = tensor.detach().to("cpu")
    t = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.contiguous().view(integer).to(torch.int64)
    if t.element_size() == 8:  # 64-bit values: both 32-bit halves count
        bits = torch.cat([bits & 0xFFFFFFFF, (bits >> 32) & 0xFFFFFFFF], dim=1)
    else:
        bits = bits & ((1 << (8 * t.element_size())) - 1)
    weights = _lane_weights(bits.shape[1])
    lanes = [((bits * w) % _P).sum(1) % _P for w in weights]  # each term < 2^31: no overflow for < 2^32 columns
    return lanes[0] * _P + lanes[1]


Fingerprints = dict[str, list[torch.Tensor]]


def fingerprints(root: nn.Module) -> Fingerprints:
    """Each sharded leaf's per-row fingerprints, one tensor per local shard (what a delta is compared with)."""
    return {key: [row_fingerprints(t) for t, _ in _shards(value)]
            for key, value, _, _ in leaves(live_state(root)) if is_sharded(value)}


# -- writing a delta (collective) ---------------------------------------------------------------------------------
@dataclass
class DeltaSummary:
    """What a delta holds: its files ({name: {"sha256", "bytes"}}), the rows of each table that changed (row
    equivalents: a column shard's rows count by its share of the columns) and each table's rows."""

    files: dict[str, dict[str, Any]]
    changed_rows: dict[str, float]
    table_rows: dict[str, int]

    @property
    def bytes(self) -> int:
        return sum(f["bytes"] for f in self.files.values())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _save(obj: Any, path: Path, what: str) -> dict[str, Any]:
    with writing(path, what, "delta", cleanup=path):
        with open(path, "wb") as f:
            torch.save(pack_tree(obj), f)
            f.flush()
            os.fsync(f.fileno())
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def _changed_pieces(value: Any, base: list[torch.Tensor]) -> tuple[list[dict[str, Any]], float]:
    """This rank's changed rows of a sharded leaf as pieces in global coordinates, and their row equivalents."""
    size = _size(value)
    width = size[1] if len(size) > 1 else 1
    pieces, changed = [], 0.0
    for (tensor, offsets), before in zip(_shards(value), base):
        moved = row_fingerprints(tensor) != before
        rows = torch.nonzero(moved).flatten()
        if rows.numel():
            values = tensor.detach().to("cpu")[rows].clone()
            pieces.append({**encode_rows(moved, rows, offsets[0]), "col": offsets[1] if len(offsets) > 1 else 0,
                           "values": values})
            changed += rows.numel() * (tensor.shape[1] if tensor.dim() > 1 else 1) / width
    return pieces, changed


def encode_rows(moved: torch.Tensor, rows: torch.Tensor, start: int) -> dict[str, Any]:
    """Which rows of a shard (starting at global row ``start``) a piece holds, in the smaller of two forms: a bit
    per shard row (``mask``, packed) when many moved, else their global numbers (int32 when they fit)."""
    if moved.numel() / 8 < 4 * rows.numel():
        packed = np.packbits(moved.numpy().astype(np.uint8))
        return {"start": start, "count": moved.numel(), "mask": torch.from_numpy(packed)}
    numbers = rows + start
    small = int(numbers.max()) < 2 ** 31
    return {"rows": numbers.to(torch.int32 if small else torch.int64)}


def pack(pieces: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """A rank's pieces as a few tensors (values grouped by dtype and width, row masks and row numbers each in one
    tensor) and a list describing each piece: a file entry per tensor would cost more than a small table's rows."""
    groups: dict[str, list[torch.Tensor]] = {}
    filled: dict[str, int] = {}
    masks: list[torch.Tensor] = []
    numbers: list[torch.Tensor] = []
    described = []
    stored: dict[tuple[str, bytes], int] = {}  # a row set already stored -> where
    at_mask = at_rows = 0
    for key, listed in pieces.items():
        for piece in listed:
            values = piece["values"]
            group = f"{str(values.dtype).replace('torch.', '')}x{values.shape[1] if values.dim() > 1 else 0}"
            entry = {"key": key, "col": piece["col"], "n": values.shape[0], "group": group,
                     "at": filled.get(group, 0)}
            groups.setdefault(group, []).append(values)
            filled[group] = entry["at"] + values.shape[0]
            # a table's weights and its optimizer state change in the same rows: their row sets are stored once
            if "mask" in piece:
                mask = piece["mask"]
                same = ("mask", mask.numpy().tobytes())
                if same not in stored:
                    stored[same], at_mask = at_mask, at_mask + mask.numel()
                    masks.append(mask)
                entry.update(start=piece["start"], count=piece["count"], mask_at=stored[same], mask_len=mask.numel())
            else:
                same = ("rows", piece["rows"].to(torch.int64).numpy().tobytes())
                if same not in stored:
                    stored[same], at_rows = at_rows, at_rows + piece["rows"].numel()
                    numbers.append(piece["rows"].to(torch.int64))
                entry.update(rows_at=stored[same])
            described.append(entry)
    rows = torch.cat(numbers) if numbers else torch.zeros(0, dtype=torch.int64)
    if rows.numel() and int(rows.max()) < 2 ** 31:
        rows = rows.to(torch.int32)
    return {"pieces": described, "values": {g: torch.cat(v) for g, v in groups.items()},
            "masks": torch.cat(masks) if masks else torch.zeros(0, dtype=torch.uint8), "rows": rows}


def unpack(part: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The pieces :func:`pack` packed, by key."""
    pieces: dict[str, list[dict[str, Any]]] = {}
    for entry in part["pieces"]:
        piece = {"col": entry["col"], "values": part["values"][entry["group"]][entry["at"]:entry["at"] + entry["n"]]}
        if "mask_at" in entry:
            piece.update(start=entry["start"], count=entry["count"],
                         mask=part["masks"][entry["mask_at"]:entry["mask_at"] + entry["mask_len"]])
        else:
            piece["rows"] = part["rows"][entry["rows_at"]:entry["rows_at"] + entry["n"]]
        pieces.setdefault(entry["key"], []).append(piece)
    return pieces


def decode_rows(piece: dict[str, Any]) -> torch.Tensor:
    """The global row numbers of a piece (see :func:`encode_rows`), int64."""
    if "mask" in piece:
        moved = np.unpackbits(piece["mask"].numpy(), count=piece["count"]).astype(bool)
        return torch.from_numpy(np.nonzero(moved)[0]).to(torch.int64) + piece["start"]
    return piece["rows"].to(torch.int64)


PACKED = "__packed_tensors__"  # a file written by pack_tree: small tensors' bytes in one buffer
_IN_BUFFER = "__in_buffer__"
_OWN_ENTRY = "__own_entry__"
_OWN_ENTRY_BYTES = 1 << 20  # a tensor this large keeps its own entry: copying it into the buffer would cost more


def pack_tree(tree: Any) -> dict[str, Any]:
    """``tree`` (dicts, lists, tensors, plain values) as torch.save should write a delta file of it: the bytes of
    its small tensors in one buffer, its large ones listed apart, and the rest (keys, row ranges, run info) pickled
    and compressed. torch.save gives each tensor its own zip entry and pickled header (~250 bytes) and repeats every
    key (a table's is ~60 characters): an hourly delta of a small model spends ~5% of its bytes on them, while
    compressing the tensors themselves would gain little on trained weights and cost time on large ones."""
    chunks: list[torch.Tensor] = []
    large: list[torch.Tensor] = []
    filled = 0

    def walk(node: Any) -> Any:
        nonlocal filled
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        if isinstance(node, torch.Tensor) and not is_sharded(node):
            tensor = node.detach().to("cpu")
            if tensor.numel() * tensor.element_size() >= _OWN_ENTRY_BYTES:
                large.append(tensor)
                return {_OWN_ENTRY: len(large) - 1}
            flat = tensor.contiguous().reshape(-1)
            raw = flat.view(torch.uint8) if flat.numel() else torch.zeros(0, dtype=torch.uint8)
            chunks.append(raw)
            entry = {_IN_BUFFER: [filled, raw.numel(), str(tensor.dtype).replace("torch.", ""), list(tensor.shape)]}
            filled += raw.numel()
            return entry
        return node

    skeleton = io.BytesIO()
    torch.save(walk(tree), skeleton)
    return {PACKED: torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8), "large": large,
            "tree": torch.frombuffer(bytearray(zlib.compress(skeleton.getvalue(), 6)), dtype=torch.uint8)}


def unpack_tree(part: dict[str, Any]) -> dict[str, Any]:
    """The tree :func:`pack_tree` packed (a file written without packing is returned as it is). Only plain values
    and tensors are read (``weights_only``), as from any checkpoint."""
    if PACKED not in part:
        return part
    buffer, large = part[PACKED], part["large"]
    skeleton = torch.load(io.BytesIO(zlib.decompress(part["tree"].numpy().tobytes())), weights_only=True)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if _IN_BUFFER in node:
                at, size, dtype, shape = node[_IN_BUFFER]
                return buffer[at:at + size].clone().view(getattr(torch, dtype)).reshape(shape)
            if _OWN_ENTRY in node:
                return large[node[_OWN_ENTRY]]
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(skeleton)


def save_delta(folder: str | os.PathLike, root: nn.Module, base: Fingerprints, metadata: dict[str, Any],
               base_meta: Optional[dict[str, Any]] = None, group: Any = None) -> DeltaSummary:
    """Collective: write into ``folder`` the rows of ``root`` whose fingerprints differ from ``base`` (taken when
    the base version was loaded) and the dense part (see the module docstring); ``metadata``'s large arrays as
    their changes from ``base_meta`` (the base version's metadata, :func:`diff_meta`). Every rank returns the same
    summary; a failure on any rank (a full disk) is raised on every rank."""
    folder = Path(folder)
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    ckpt._on_rank0(lambda: folder.mkdir(parents=True, exist_ok=True), group=group)
    state = live_state(root)
    pieces: dict[str, list[dict[str, Any]]] = {}
    changed: dict[str, float] = {}
    sizes: dict[str, list[int]] = {}
    dense: dict[str, Any] = {}
    for key, value, _, _ in leaves(state):
        if is_sharded(value):
            if key not in base:
                raise DeltaError(f"{key} is sharded now but was not when the base was loaded; publish a full"
                                 " version (--full)")
            pieces[key], changed[key] = _changed_pieces(value, base[key])
            sizes[key] = _size(value)
        else:
            dense[key] = value.detach().to("cpu").clone() if isinstance(value, torch.Tensor) else value
    files: dict[str, dict[str, Any]] = {}
    error: Optional[Exception] = None
    try:
        files[rank_file(rank)] = _save({**pack(pieces), "sizes": sizes}, folder / rank_file(rank),
                                       f"rank {rank}'s rows of the delta")
        if rank == 0:
            layout = {s.key: s.columns for s in row_states(root, state[FUSED_OPTIMIZER_KEY])}
            files[DENSE_FILE] = _save({"dense": dense, "meta": diff_meta(metadata, base_meta or {}),
                                       ROW_STATE_KEY: layout},
                                      folder / DENSE_FILE, "the delta's dense part")
    except Exception as e:
        error = e
    ckpt._all_ranks_ok(error, group)
    gathered: list[Any] = [None]
    summary = [files, changed]
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, summary, group=group)
    else:
        gathered = [summary]
    all_files = {name: f for part, _ in gathered for name, f in part.items()}
    totals: dict[str, float] = {}
    for _, part in gathered:
        for key, rows in part.items():
            totals[key] = totals.get(key, 0.0) + rows
    tables = {key: size[0] for key, size in sizes.items()}
    return DeltaSummary(all_files, totals, tables)


def table_touch(summary: DeltaSummary) -> dict[str, Any]:
    """The share of table rows that changed (weights only, not optimizer state), for records and benches."""
    # the tables' weights (a managed-id table's remapping buffers are sharded too, but are not rows of the model)
    weights = [k for k in summary.changed_rows if k.startswith("state_dict/") and k.endswith(".weight")]
    rows = sum(summary.table_rows[k] for k in weights)
    changed = sum(summary.changed_rows[k] for k in weights)
    return {"changed_rows": round(changed, 1), "table_rows": rows, "fraction": round(changed / max(rows, 1), 6)}


# -- the job's metadata: large arrays as the entries that changed ----------------------------------------------
CHANGED = "__changed_entries__"  # marks a metadata tensor stored as the entries that differ from the base's
DIFF_MIN_BYTES = 1 << 10
_DIFFABLE = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
             torch.float64}


def diff_meta(meta: Any, base: Any) -> Any:
    """``meta`` with each tensor of at least 1 KiB that has a same-shaped, same-dtype counterpart in ``base`` (the
    base version's metadata) replaced by the entries that differ, when they take less room: the job's id counts
    (fixed-size Bloom filters and row owners) change by a few bytes an hour but are megabytes whole."""
    if isinstance(meta, dict):
        other = base if isinstance(base, dict) else {}
        return {k: diff_meta(v, other.get(k)) for k, v in meta.items()}
    if isinstance(meta, list):
        other = base if isinstance(base, list) and len(base) == len(meta) else [None] * len(meta)
        return [diff_meta(v, b) for v, b in zip(meta, other)]
    if isinstance(meta, torch.Tensor) and isinstance(base, torch.Tensor) and meta.shape == base.shape and \
            meta.dtype == base.dtype and meta.numel() * meta.element_size() >= DIFF_MIN_BYTES:
        flat_new, flat_old = meta.detach().reshape(-1), base.detach().reshape(-1)
        where = torch.nonzero(flat_new != flat_old).flatten()
        # worth encoding only when the changed values alone take less than half the array (an optimizer's moments
        # change everywhere: compressing them would take seconds on a large model for nothing)
        if meta.dtype in _DIFFABLE and 2 * where.numel() < meta.numel():
            change = _encode_changes(where.numpy(), flat_new.numpy(), list(meta.shape))
            if change["z"].numel() < meta.numel() * meta.element_size():
                return {CHANGED: change}
    return meta


def _encode_changes(where: np.ndarray, now: np.ndarray, shape: list[int]) -> dict[str, Any]:
    """The entries at ``where`` (ascending) of the flat array ``now``: the gaps between them, then their values,
    compressed together (a Bloom filter's changed bytes are a few bits each, its gaps mostly small). The gaps take
    the integer type that stores them in the fewest bytes; a gap wider than it holds is bridged by entries that
    did not change (their value rewritten as it is)."""
    best: Optional[tuple[int, np.dtype, np.ndarray]] = None
    for kind in (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.int64)):
        top = np.iinfo(kind).max
        gaps = np.diff(where, prepend=0)
        wide = np.nonzero(gaps > top)[0]
        if int(((gaps[wide] - 1) // top).sum()) > where.size:  # more bridging entries than changes: a wider type
            continue                                             # is smaller
        if wide.size:
            starts = np.concatenate([[0], where])[wide]
            bridges = np.concatenate([np.arange(start + top, end, top) for start, end in zip(starts, where[wide])])
            stops = np.union1d(where, bridges)
        else:
            stops = where
        cost = stops.size * (kind.itemsize + now.itemsize)
        if best is None or cost < best[0]:
            best = (cost, kind, stops)
    _, kind, stops = best if best is not None else (0, np.dtype(np.uint8), where)
    raw = np.diff(stops, prepend=0).astype(kind).tobytes() + np.ascontiguousarray(now[stops]).tobytes()
    return {"count": int(stops.size), "gaps": kind.name, "shape": shape,
            "z": torch.frombuffer(bytearray(zlib.compress(raw, 6)), dtype=torch.uint8)}


def patch_meta(base: Any, meta: Any) -> Any:
    """The metadata :func:`diff_meta` stored, whole again, from the previous version's (``base``)."""
    if isinstance(meta, dict) and CHANGED in meta:
        change = meta[CHANGED]
        if not isinstance(base, torch.Tensor) or list(base.shape) != change["shape"]:
            raise DeltaError("a delta's metadata names changes to an array its base does not hold; rebuild the"
                             " version from a full one (point current at it and rerun with --full)")
        whole = base.detach().clone().reshape(-1)
        if "z" in change:
            raw = zlib.decompress(change["z"].numpy().tobytes())
            kind, count = np.dtype(change["gaps"]), change["count"]
            gaps = np.frombuffer(raw, dtype=kind, count=count)
            values = np.frombuffer(raw, dtype=whole.numpy().dtype, offset=count * kind.itemsize).copy()
            index = torch.from_numpy(np.cumsum(gaps, dtype=np.int64))
            whole[index] = torch.from_numpy(values)
        else:  # a delta written before the changes were compressed
            whole[change["index"].to(torch.int64)] = change["values"].to(whole.dtype)
        return whole.reshape(change["shape"])
    if isinstance(meta, dict):
        other = base if isinstance(base, dict) else {}
        return {k: patch_meta(other.get(k), v) for k, v in meta.items()}
    if isinstance(meta, list):
        other = base if isinstance(base, list) and len(base) == len(meta) else [None] * len(meta)
        return [patch_meta(b, v) for b, v in zip(other, meta)]
    return meta


# -- applying deltas ---------------------------------------------------------------------------------------------
def _read_delta_file(folder: Path, name: str, files: dict[str, Any]) -> dict[str, Any]:
    """A delta's file, verified against the sha256 its info.json records."""
    path = folder / name
    expected = files.get(name)
    if expected is None:
        raise DeltaError(f"{folder}/{INFO_FILE} lists no {name}; the version is damaged: point current at an"
                         " earlier version (ln -sfn versions/NNNNNN current)")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (the version was removed or damaged)")
    if _sha256(path) != expected["sha256"]:
        raise DeltaError(f"{path} does not match the sha256 in {folder}/{INFO_FILE} (damaged on disk); point current"
                         " at an earlier version (ln -sfn versions/NNNNNN current) or rebuild it with"
                         " `disttrain recsys materialize`")
    return unpack_tree(torch.load(path, map_location="cpu", weights_only=True))


def _place(target: torch.Tensor, offsets: tuple[int, ...], piece: dict[str, Any]) -> None:
    """Copy the part of ``piece`` (global coordinates) that falls in ``target`` (a shard at ``offsets``)."""
    rows, values = decode_rows(piece), piece["values"]
    start = offsets[0]
    inside = (rows >= start) & (rows < start + target.shape[0])
    if not bool(inside.any()):
        return
    local, values = rows[inside] - start, values[inside]
    if target.dim() == 1:
        target[local] = values.to(target.dtype)
        return
    col, own = piece["col"], offsets[1] if len(offsets) > 1 else 0
    lo, hi = max(col, own), min(col + values.shape[1], own + target.shape[1])
    if lo < hi:
        target[local, lo - own:hi - own] = values[:, lo - col:hi - col].to(target.dtype)


def apply_delta_to(state: dict[str, Any], folder: Path, files: dict[str, Any], ranks: list[str],
                   sharded_only: bool = False) -> dict[str, Any]:
    """Apply one delta folder to ``state`` (nested; ShardedTensor leaves get the rows their local shards hold,
    full tensors every row); returns the delta's dense file (its ``meta`` and layout)."""
    flat = {key: (value, container, index) for key, value, container, index in leaves(state)}
    for name in ranks:
        part = _read_delta_file(folder, name, files)
        for key, pieces in unpack(part).items():
            if key not in flat:
                if key.split("/")[0] not in state:  # an entry this read leaves out (keys=)
                    continue
                raise DeltaError(f"{folder}: {key} is in the delta but not in the version it is applied to (another"
                                 " model); point current at a full version of this model and rerun with --full")
            value = flat[key][0]
            size = _size(value)
            if size != part["sizes"][key]:
                raise DeltaError(f"{folder}: {key} is {part['sizes'][key]} in the delta but {size} here (another"
                                 " sharding plan changed the per-row optimizer state's layout); rebuild the version"
                                 " with `disttrain recsys materialize` and warm-start from that")
            targets = _shards(value) if is_sharded(value) else [(value, (0,) * value.dim())]
            for tensor, offsets in targets:
                for piece in pieces:
                    _place(tensor, offsets, piece)
    dense = _read_delta_file(folder, DENSE_FILE, files)
    if not sharded_only:
        for key, value in dense["dense"].items():
            if key not in flat:
                continue
            current, container, index = flat[key]
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and not is_sharded(current):
                current.copy_(value.to(current.dtype))
            elif not is_sharded(current):
                container[index] = value
    return dense


def delta_ranks(info: dict[str, Any]) -> list[str]:
    return sorted(name for name in info.get("files", {}) if name.startswith("rank"))


def load_chain(root: nn.Module, store: ModelStore, info: dict[str, Any], load_full: Callable[[Path], Any]) \
        -> dict[str, Any]:
    """Collective: load a delta version into the sharded ``root``: its full base with ``load_full`` (the engine's
    own load, which reshards), then every delta of its chain in order. Returns the newest delta's metadata. When
    ``root`` splits a per-row optimizer state's columns otherwise than the chain (another number of ranks), rank 0
    first rebuilds the version in full under ``work/`` and that is loaded (and removed)."""
    chain = chain_of(info)
    if not same_layout(root, store, info):  # rows of per-row state are laid out otherwise here: rebuild in full
        folder = store.work / f"materialized-{info['version']}"

        def rebuild() -> None:
            remove(folder)
            materialize(store.root, info["version"], folder)

        ckpt._on_rank0(rebuild)
        try:
            return load_full(folder)
        finally:
            ckpt._on_rank0(remove, folder)
    meta = load_full(store.versions / chain[0])
    state = live_state(root)
    meta = apply_deltas(store, chain[1:], state, meta)
    meta.pop(ROW_STATE_KEY, None)  # as the engine's own load returns its metadata
    load_model_state(root, state["state_dict"])
    load_fused_optimizer_state(root, state[FUSED_OPTIMIZER_KEY])
    return meta


def apply_deltas(store: ModelStore, names: list[str], state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Apply the delta versions ``names`` in order to ``state`` (see :func:`apply_delta_to`); returns the metadata
    of the last, whole again (:func:`patch_meta` from ``meta``, the base's), with its per-row state's column split
    and the base's managed-table layout (a delta is written only on the layout of its base: :func:`same_layout`)."""
    layout = {PROCESSES_KEY: meta[PROCESSES_KEY]} if PROCESSES_KEY in meta else {}
    for name in names:
        folder = store.versions / name
        step = read_json(folder / INFO_FILE, "point current at an earlier version")
        dense = apply_delta_to(state, folder, step.get("files", {}), delta_ranks(step))
        meta = {**patch_meta(meta, dense["meta"]), ROW_STATE_KEY: dense[ROW_STATE_KEY], **layout}
    return meta


def same_layout(root: nn.Module, store: ModelStore, info: dict[str, Any]) -> bool:
    """Whether ``root``'s per-row optimizer states are split by columns as in the chain of the version ``info``
    describes (another number of ranks may split a table's columns otherwise; a delta must then not go on it), and
    its managed tables (if any) are over as many processes (which process holds an id, and in which row, depends
    on their number)."""
    base = store.versions / chain_of(info)[0]
    meta = ckpt.read_meta(base)
    if saved_world_size(base, root, meta) is not None:
        return False
    live = {s.key: s.columns for s in row_states(root, fused_optimizer_state(root))}
    saved = meta.get(ROW_STATE_KEY) or {}
    def plain(layout: dict[str, Any]) -> dict[str, Any]:
        return {k: None if v is None else [int(c) for c in v] for k, v in layout.items()}

    return plain(live) == plain(saved)


def chain_of(info: dict[str, Any]) -> list[str]:
    """The versions a version is built from: its full base first, itself last."""
    return list(info.get("chain") or [info["version"]])


# -- reading without a process group -----------------------------------------------------------------------------
def read_version(store: ModelStore, version: str, keys: Optional[set[str]] = None) -> tuple[dict[str, Any], dict]:
    """``(nested full tensors, metadata)`` of a published version, base + deltas, in this process (no collective).
    ``keys``: the top-level entries to read (``{"state_dict"}`` for serving). Every file is verified."""
    info = read_json(store.versions / version / INFO_FILE, "point current at an earlier version")
    chain = chain_of(info)
    base = store.versions / chain[0]
    state = ckpt.read_full(base, keys=keys)
    return state, apply_deltas(store, chain[1:], state, ckpt.read_meta(base))


def materialize(model_root: str | os.PathLike, version: str, out: str | os.PathLike) -> Path:
    """Write ``version`` (base + deltas) as one full version folder at ``out`` (atomically), loadable as any full
    version: by the job's warm start and :func:`load_current`-style readers. Returns ``out``."""
    store = ModelStore(model_root)
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass another --out or remove it")
    if not (store.versions / version / INFO_FILE).is_file():
        raise FileNotFoundError(f"no version {version} under {store.versions}; choose one of"
                                f" {', '.join(sorted(p.name for p in store.versions.glob('[0-9]*'))) or 'none'}")
    info = read_json(store.versions / version / INFO_FILE, "point current at an earlier version")
    state, meta = read_version(store, version)
    staging = out.with_name(f".{out.name}.partial")
    with warnings.catch_warnings():  # DCP notes that it saves from one process: what this is for
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        ckpt.save_sharded(staging, state, meta)
    write_json_atomic(staging / INFO_FILE, {**info, "kind": FULL, "chain": [info["version"]],
                                            "materialized_from": chain_of(info)})
    staging.rename(out)
    fsync_dir(out.parent)
    return out


@dataclass
class PublishedModel:
    """What :func:`load_current` read: the version's name, its info.json and the model's state dict (full CPU
    tensors, the keys of ``DeepFM``'s ``state_dict``)."""

    version: str
    info: dict[str, Any]
    state_dict: dict[str, torch.Tensor]


def load_current(model_root: str | os.PathLike, attempts: int = _READ_ATTEMPTS) -> PublishedModel:
    """The model ``MODEL_ROOT/current`` points at, for a serving process: the pointer is read once and the
    version's whole chain assembled and verified, so the result is exactly one published version even while a
    publish swaps the pointer; if a publish prunes a version while it is read, the read starts again from the new
    ``current`` (up to ``attempts`` times)."""
    store = ModelStore(model_root)
    last: Optional[BaseException] = None
    for attempt in range(attempts):
        if not store.pointer.is_symlink():
            raise StoreError(f"{store.pointer} does not exist: nothing is published under {store.root} yet")
        version = Path(os.readlink(store.pointer)).name  # one read of the pointer: the version this call returns
        chain = [version]
        try:
            info = json.loads((store.versions / version / INFO_FILE).read_text())
            chain = chain_of(info)
            state, _ = read_version(store, version, keys={"state_dict"})
            return PublishedModel(version, info, dict(state["state_dict"]))
        except (FileNotFoundError, StoreError, ckpt.CheckpointError) as e:
            if all((store.versions / name).is_dir() for name in chain) and not isinstance(e, FileNotFoundError):
                raise  # damaged, not removed under us (a prune removes a chain's versions oldest first)
            last = e
            time.sleep(0.05 * (attempt + 1))
    raise StoreError(f"{store.root}: current kept moving to versions removed while they were read ({last}); raise"
                     " daily.keep_versions so a reader has time to finish")
