"""Checkpoints read outside a disttrain strategy's own save/load pair.

``MyModule.load_from_checkpoint(folder)`` on the checkpoint folders the disttrain strategies write
(``ModelCheckpoint``, ``trainer.save_checkpoint``): in one plain process, without torch.distributed or a GPU. The
folder is consolidated on load: the full ``state_dict`` and ``meta.pt``'s entries (hyperparameters saved by
``save_hyperparameters``, loop and callback state) form the dict a single-file checkpoint holds, and Lightning then
builds and fills the module exactly as it does from a file.

Checkpoints Lightning's own strategies wrote (``ddp``'s file, ``FSDPStrategy``'s and ``ModelParallelStrategy``'s
folders), resumed under a disttrain strategy: :func:`open_lightning_checkpoint` presents one to the engine's load in
the one layout (docs/migrating.md).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from disttrain.parallel.checkpoint.io import (
    FORMAT_KEY,
    META_FILE,
    is_disttrain_folder,
    is_zero_checkpoint,
    read_as_single_file,
    read_full,
    read_meta,
)
from disttrain.parallel.checkpoint.integrity import CheckpointError, CheckpointReader


def is_checkpoint_folder(path: Any) -> bool:
    """A local folder a disttrain strategy wrote (or what an interrupted save left of one)."""
    return isinstance(path, (str, os.PathLike)) and "://" not in str(path) and is_disttrain_folder(path)


def read_checkpoint_folder(path: str | os.PathLike, map_location: Any = None,
                           weights_only: bool | None = None) -> dict[str, Any]:
    """What Lightning's loader returns for a single-file checkpoint, read from a disttrain checkpoint folder.
    Tensors are on the CPU unless ``map_location`` names a device; ``meta.pt`` is read with ``weights_only=True``
    unless the caller passes ``weights_only=False`` (a checkpoint they trust)."""
    checkpoint = read_as_single_file(path, key="state_dict", weights_only=weights_only is not False)
    if isinstance(map_location, (str, torch.device)):
        checkpoint["state_dict"] = {k: v.to(map_location) if isinstance(v, torch.Tensor) else v
                                    for k, v in checkpoint["state_dict"].items()}
    return checkpoint


# -- checkpoints written by Lightning's own strategies, resumed under a disttrain strategy ----------------------------
# Each is presented to the engine's own load path as a DCP storage in the one layout (a reader that renames keys, or
# one over tensors in memory), so every engine reads it as it reads its own checkpoints: resharded to its sizes, each
# rank filling only its shards, partitions or pipeline stage.
WRITER = "Lightning's own strategy"


@dataclass
class LightningCheckpoint:
    """A checkpoint Lightning's own strategies wrote, as an engine's load reads it (``source=`` of its
    ``load_checkpoint``): ``reader`` presents the tensors under the one layout's keys, ``metadata`` is what a
    disttrain ``meta.pt`` would hold (step, loops, hyper-parameters), ``stored`` what the reader describes."""

    path: Path
    reader: StorageReader
    metadata: dict[str, Any]

    @property
    def stored(self) -> dict[str, Any]:
        return dict(self.reader.read_metadata().state_dict_metadata)


def open_lightning_checkpoint(path: str | os.PathLike, model_key: str, optimizer_keys: list[str], trainer: bool,
                              parameter_order: Callable[[str], tuple[list[str], dict[str, tuple[int, ...]]]],
                              strategy: str, weights_only: bool = True) -> Optional[LightningCheckpoint]:
    """``path`` as an engine reads it when Lightning's own strategy wrote it; None for disttrain's own checkpoints
    (and paths that are neither, which the engine's load names).

    Read: a single ``torch.save`` file (``ddp``, single device, ``FSDPStrategy(state_dict_type="full")``,
    ``ModelParallelStrategy(save_distributed_checkpoint=False)``, Fabric's ``fabric.save`` under them) and a
    torch.distributed.checkpoint folder (``FSDPStrategy(state_dict_type="sharded")``, ``ModelParallelStrategy``, and
    their Fabric versions). ``model_key`` / ``optimizer_keys``: the keys the load fills (``"state_dict"`` and
    ``"optimizer_<i>"`` for the Trainer, whose files keep optimizers as a list under ``"optimizer_states"``).
    A file's optimizer state is keyed by each parameter's position in the optimizer: ``parameter_order(key)`` gives
    this run's parameter names in that order and the full shape of each. A DeepSpeed folder is refused with the
    ways to resume it. Every rank calls it and gets the same answer or the same error."""
    path = Path(path)
    if is_zero_checkpoint(path):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a DeepSpeed folder (Lightning's deepspeed strategies write these), which"
            f" {strategy} cannot read: resume it under disttrain_zero3 with the same number of processes (its next"
            " checkpoint resumes under every strategy and size), or start from its weights alone after"
            " lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict")
    if path.is_dir():
        return _lightning_folder(path, model_key, optimizer_keys, trainer, weights_only) \
            if _is_lightning_folder(path) else None
    if not path.is_file():
        return None
    checkpoint = _load_file(path, weights_only)
    if _is_own_file(checkpoint, optimizer_keys, trainer):
        return None
    if trainer:
        saved = checkpoint.pop("optimizer_states", None)
        if optimizer_keys and saved is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds no optimizer state (written with ModelCheckpoint(save_weights_only="
                "True), or by convert_zero_checkpoint_to_fp32_state_dict): it cannot resume training; start a new"
                " run from its weights (MyModule.load_from_checkpoint(path), then trainer.fit without ckpt_path)")
        if optimizer_keys and len(saved) != len(optimizer_keys):
            raise CheckpointError(f"checkpoint {str(path)!r} holds the state of {len(saved)} optimizers and this run"
                                  f" has {len(optimizer_keys)}; resume with the configure_optimizers that wrote it")
        optimizers = dict(zip(optimizer_keys, saved or []))
    else:
        optimizers = {key: checkpoint.pop(key) for key in optimizer_keys if _keyed_by_position(checkpoint.get(key))}
    flat = {f"{model_key}.{name}": value for name, value in checkpoint.pop(model_key, {}).items()}
    for key, saved in optimizers.items():
        names, shapes = parameter_order(key)
        flat.update({f"{key}.{name}": value
                     for name, value in _by_name(saved, names, shapes, path, key).items()})
    return LightningCheckpoint(path, _InMemoryReader(flat), checkpoint)


def parameter_order(optimizer_state: dict[str, Any], model_state: dict[str, Any]
                    ) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """From an engine's flattened optimizer state and its model state (the one layout): the optimizer's parameter
    names in the order the optimizer holds them, and each one's full shape."""
    names = list(dict.fromkeys(key.split(".", 1)[1].rsplit(".", 1)[0]
                               for key in optimizer_state if key.startswith("param_groups.")))
    shapes = {name: tuple(model_state[name].size()) for name in names if hasattr(model_state.get(name), "size")}
    return names, shapes


def _is_lightning_folder(path: Path) -> bool:
    """A DCP folder whose meta.pt lacks disttrain's format entry (Lightning writes meta.pt with the rest). The entry's
    name is looked for in the file's bytes (torch.save stores the pickle uncompressed), so nothing is unpickled to
    decide, and a meta.pt holding what safe loading refuses is told apart as well."""
    if not ((path / ".metadata").is_file() and (path / META_FILE).is_file()):
        return False
    return FORMAT_KEY.encode() not in (path / META_FILE).read_bytes()


def _is_own_file(checkpoint: dict[str, Any], optimizer_keys: list[str], trainer: bool) -> bool:
    """disttrain's own single file (``save_distributed_checkpoint=False``), which its engine loads: the Trainer's
    keeps optimizers under ``optimizer_<i>`` (Lightning's under ``optimizer_states``), and optimizer states are keyed
    by parameter name (a torch optimizer's own ``state_dict()``, which Fabric's strategies save, by position). A
    file without optimizer state loads alike either way."""
    if trainer:
        return any(re.fullmatch(r"optimizer_\d+", key) for key in checkpoint)
    return not any(_keyed_by_position(checkpoint.get(key)) for key in optimizer_keys)


def _load_file(path: Path, weights_only: bool) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        refused = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), None)
        if refused is None:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {_first(e)}; resume from an earlier"
                                  " checkpoint") from e
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds objects that safe loading refuses ({refused}); if you trust this"
            " checkpoint, load it with weights_only=False (trainer.fit(..., weights_only=False))") from e
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {_first(e)}; resume from an earlier"
                              " checkpoint") from e
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not a checkpoint's"
                              " dict; pass the file trainer.save_checkpoint or fabric.save wrote")
    return checkpoint


def _first(error: BaseException) -> str:
    return f"{type(error).__name__}: {next((l for l in str(error).splitlines() if l.strip()), '')[:200]}"


def _keyed_by_position(value: Any) -> bool:
    """A torch optimizer's own ``state_dict()``: parameters as positions (ints), not names."""
    groups = value.get("param_groups") if isinstance(value, dict) else None
    return bool(groups) and any(isinstance(p, int) for group in groups for p in group.get("params", []))


def _by_name(saved: dict[str, Any], names: list[str], shapes: dict[str, tuple[int, ...]], path: Path,
             key: str) -> dict[str, Any]:
    """A torch optimizer's ``state_dict()`` (parameters numbered in the order its groups hold them) in the one
    layout's flattened form (``state.<name>.exp_avg``, ``param_groups.<name>.lr``), given this run's parameter
    names in the same order: an optimizer built by the same ``configure_optimizers`` numbers them alike. Counts and
    shapes are checked, so a different order or model is one error, never a silently misplaced moment."""
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    if len(ids) != len(names):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its {key} numbers {len(ids)} parameters, this run's optimizer holds"
            f" {len(names)} (under pipeline parallelism each stage holds only its own layers'); resume it once"
            " where every rank's optimizer holds every parameter (disttrain_fsdp, or disttrain_megatron with"
            " pipeline_parallel_size=1) and save: that checkpoint resumes under every strategy and size")
    position = {i: n for n, i in enumerate(ids)}
    flat: dict[str, Any] = {}
    for group in saved["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for i in group["params"]:
            name = names[position[i]]
            for state_key, value in saved["state"].get(i, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and name in shapes and tuple(value.shape) != shapes[name]:
                    raise CheckpointError(
                        f"checkpoint {str(path)!r}: {key}'s {state_key} of parameter {position[i]} has shape"
                        f" {list(value.shape)}, but this run's parameter {position[i]} ({name}) has shape"
                        f" {list(shapes[name])}: the optimizer lists its parameters in another order or holds"
                        " another model; resume with the module and configure_optimizers that wrote it")
                flat[f"state.{name}.{state_key}"] = value
            flat.update({f"param_groups.{name}.{k}": v for k, v in hyper.items()})
    return flat


def _lightning_folder(path: Path, model_key: str, optimizer_keys: list[str], trainer: bool,
                      weights_only: bool) -> LightningCheckpoint:
    """Lightning's DCP folder in the one layout: the Trainer's ``FSDPStrategy`` keeps the model under ``"model"``
    (lightning/pytorch/strategies/fsdp.py, ``save_checkpoint``: ``{"model": ..., "optimizer_<i>": ...}``), its
    ``ModelParallelStrategy`` under ``"state_dict"`` (model_parallel.py, ``save_checkpoint``); both keep each
    optimizer in torch's nested form (``state.<name>.<key>`` tensors, as here, but ``param_groups.<i>.<key>`` per
    group with a ``params`` list of names) and the rest in ``meta.pt``."""
    inner = CheckpointReader(path, weights_only, written_by=WRITER)  # first: its warning names Lightning
    stored = inner.read_metadata().state_dict_metadata
    tops = {key.split(".", 1)[0] for key in stored}
    renames = {"model": model_key} if trainer and model_key not in tops and "model" in tops else {}
    groups = _param_groups(path, [k for k in optimizer_keys if k in tops], weights_only)
    return LightningCheckpoint(path, _RenamedReader(inner, renames, groups), read_meta(path, weights_only))


def _param_groups(path: Path, keys: list[str], weights_only: bool) -> dict[str, list[dict[str, Any]]]:
    """Each optimizer's ``param_groups`` as saved (small: hyper-parameters and parameter names)."""
    state = read_full(path, keys={f"{key}.param_groups" for key in keys}, weights_only=weights_only) if keys else {}
    return {key: list(state.get(key, {}).get("param_groups", [])) for key in keys}


class _InMemoryReader(StorageReader):
    """DCP storage over full tensors (and plain values) held in memory under flattened keys: each tensor one stored
    chunk, read by the slices each rank asks for."""

    def __init__(self, flat: dict[str, Any]) -> None:
        super().__init__()
        self.flat = flat

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        described: dict[str, Any] = {}
        for key, value in self.flat.items():
            if torch.is_tensor(value):
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.size())
                described[key] = TensorStorageMetadata(TensorProperties.create_from_tensor(value), value.size(),
                                                       [chunk])
            else:
                described[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=described)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for item in plan.items:
            _serve(item, self.flat[item.storage_index.fqn], planner)
        done: Future = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _serve(item: Any, value: Any, planner: LoadPlanner) -> None:
    """One read item from a value in memory: a slice of a full tensor, or a plain value."""
    if item.type == LoadItemType.BYTE_IO:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        planner.load_bytes(item, buffer)
        return
    target = planner.resolve_tensor(item).detach()
    target.copy_(narrow_tensor_by_index(value, item.storage_offsets, item.lengths))
    planner.commit_tensor(item, target)


class _RenamedReader(StorageReader):
    """A Lightning DCP folder seen in the one layout: top-level keys renamed (``renames``: stored -> target) and
    each optimizer's per-group hyper-parameters (``groups``) served per parameter as
    ``<optimizer>.param_groups.<name>.<key>``; tensors are read from the folder by ``inner`` (verified, safely
    unpickled), under their stored names."""

    def __init__(self, inner: StorageReader, renames: dict[str, str], groups: dict[str, list[dict[str, Any]]]) -> None:
        super().__init__()
        self.inner = inner
        self.original = inner.read_metadata()
        self.stored_as: dict[str, str] = {}  # target key -> stored key
        self.values: dict[str, Any] = {}  # target key -> value served from memory
        for key in self.original.state_dict_metadata:
            top, _, rest = key.partition(".")
            if top in groups and rest.startswith("param_groups"):
                continue  # served per parameter below
            self.stored_as[f"{renames.get(top, top)}.{rest}" if rest else renames.get(top, top)] = key
        for top, saved in groups.items():
            for group in saved:
                for name in group.get("params", []):
                    self.values.update({f"{top}.param_groups.{name}.{k}": v for k, v in group.items()
                                        if k != "params"})

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        described = {target: self.original.state_dict_metadata[stored] for target, stored in self.stored_as.items()}
        described.update({key: BytesStorageMetadata() for key in self.values})
        return Metadata(state_dict_metadata=described, storage_meta=self.original.storage_meta)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.inner.set_up_storage_reader(self.original, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        from_folder = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if fqn in self.values:
                _serve(item, self.values[fqn], planner)
            else:  # the planner fills the target (dest_index); the folder is read under its own name
                from_folder.append(dataclasses.replace(
                    item, storage_index=dataclasses.replace(item.storage_index, fqn=self.stored_as[fqn])))
        return self.inner.read_data(dataclasses.replace(plan, items=from_folder), planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
