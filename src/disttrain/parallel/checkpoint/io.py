"""Checkpoints for sharded models: torch.distributed.checkpoint (DCP) folders, written atomically, plus a full
export to one safetensors file. Used by the Trainer and Fabric adapters alike.

A sharded checkpoint is a folder: DCP's ``.metadata`` and ``__<rank>_0.distcp`` shards hold every tensor
(model and optimizer states), ``meta.pt`` holds the rest (step, loop state, user metadata), and ``manifest.json``,
written last, a checksum of every file (``parallel/checkpoint/integrity.py``: every read path verifies what it reads).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
import shutil
import tempfile
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from disttrain.parallel.checkpoint.frozen import add_base, left_out, pop_record, remember_base
from disttrain.parallel.guards.diskspace import DiskFullError, ensure_free, remove, tensor_bytes, writing
from disttrain.parallel.guards.watchdog import phase
from disttrain.parallel.checkpoint.integrity import (
    MANIFEST_FILE,
    CheckpointError,
    CheckpointReader,
    ChecksumWriter,
    check_bytes,
    unwrap_dcp_error,
    write_manifest,
)

META_FILE = "meta.pt"
FORMAT_KEY = "disttrain_checkpoint"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier(group: Any = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _all_ranks_ok(error: Exception | None, group: Any = None) -> None:
    """Raise the same error on every rank if any rank failed, instead of leaving the others in a collective.
    ``group``: the ranks that agree (default: all; an async save's own group, see ``async_checkpoint.py``)."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)), group=group)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if error is not None:
            raise error
        if first[0] == DiskFullError.__name__:  # the same one line on every rank
            raise DiskFullError(first[1])
        raise CheckpointError(f"another rank failed: {first[0]}: {first[1]}")


def _on_rank0(fn: Any, *args: Any, group: Any = None) -> None:
    """Collective: ``fn`` runs on rank 0 and its error is raised on every rank (no rank is left in a collective
    the failed one never reaches)."""
    error: Exception | None = None
    if _rank() == 0:
        try:
            fn(*args)
        except Exception as e:
            error = e
    _all_ranks_ok(error, group)


KEPT = "the previous checkpoint is kept until a new one is complete"


def check_space(path: str | os.PathLike, state: Any, what: str = "the checkpoint") -> None:
    """Collective: refuse a save of ``state`` (this rank's part of a DCP save, see ``tensor_bytes``) before any
    byte is written when the sum over the ranks does not fit where ``path`` goes (one error on every rank)."""
    mine = tensor_bytes(state, plain=_rank() == 0)
    sizes = [mine]
    if dist.is_available() and dist.is_initialized():
        sizes = [0] * dist.get_world_size()
        dist.all_gather_object(sizes, mine)
    _on_rank0(ensure_free, path, sum(sizes), what, f"free space there ({KEPT})")


def model_state(model: nn.Module, full: bool = False) -> dict[str, Any]:
    """Sharded (DTensor) state dict, or the full one on rank 0 (CPU) when ``full``."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


# Sharded optimizer states are flattened to one key per parameter ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"):
# nested param_groups are one object per rank under one key, and DCP keeps only one copy of it, which breaks as
# soon as ranks hold different parameters (pipeline stages).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def flatten_optimizer(nested: Mapping[str, Any]) -> dict[str, Any]:
    """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn]}]}`` (FQN-keyed, as torch's
    ``get_optimizer_state_dict`` gives by default) -> the flattened form every disttrain checkpoint stores."""
    flat = {f"state.{fqn}.{name}": value for fqn, moments in nested.get("state", {}).items()
            for name, value in moments.items()}
    for group in nested.get("param_groups", []):
        for fqn in group["params"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def unflatten_optimizer(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten_optimizer` (parameters with equal hyperparameters share a group)."""
    if "state" in flat or "param_groups" in flat:
        return dict(flat)  # already nested
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, rest = key.split(".", 1)
        fqn, name = rest.rsplit(".", 1)
        (state if kind == "state" else hyper).setdefault(fqn, {})[name] = value
    groups: list[dict[str, Any]] = []
    for fqn, settings in hyper.items():
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == settings), None)
        if group is None:
            groups.append({**settings, "params": [fqn]})
        else:
            group["params"].append(fqn)
    return {"state": state, "param_groups": groups}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, full: bool = False) -> dict[str, Any]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if full else _FLAT
    return get_optimizer_state_dict(model, optimizer, options=options)


def the_model(state: Mapping[str, Any]) -> nn.Module:
    models = [v for v in state.values() if isinstance(v, nn.Module)]
    if len(models) != 1:
        raise ValueError(f"checkpoint state must hold exactly one model, found {len(models)} in keys {sorted(state)}")
    return models[0]


def restore_rest(state: dict[str, Any], targets: Mapping[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """After the tensors are loaded: give stateful objects of ``state`` their saved state and plain entries their
    saved value (in place); returns what ``state`` did not ask for."""
    for key, value in state.items():
        if key in targets or key not in metadata:
            continue
        if callable(getattr(value, "load_state_dict", None)):
            value.load_state_dict(metadata.pop(key))
        else:
            state[key] = metadata.pop(key)
    return metadata


def _replace_atomically(tmp: Path, path: Path) -> None:
    """Rank 0 swaps a finished temporary file/folder into place; an old checkpoint is removed only afterwards."""
    old = path.with_name(f".{path.name}.old")
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if path.exists():
        path.rename(old)
    try:
        tmp.rename(path)
    except FileNotFoundError:
        if not path.exists():
            raise  # else a reader's recover_interrupted_save finished this swap for us
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _finished(tmp: Path) -> bool:
    """Whether the ``.NAME.tmp`` of a swap that started holds a finished save (the swap starts only after it is
    written; the manifest, written last, or DCP's parts confirm it for checkpoint folders)."""
    if not tmp.exists():
        return False
    if not tmp.is_dir() or (tmp / MANIFEST_FILE).is_file():
        return True
    dcp_like = any((tmp / name).exists() for name in (".metadata", META_FILE))
    return not dcp_like or not _missing_parts(tmp, "dcp")


def recover_interrupted_save(path: str | os.PathLike) -> Path | None:
    """Put a finished checkpoint back under ``path`` when a save was killed before its swap completed: between
    the two renames of ``_replace_atomically`` only ``.NAME.old`` (the previous checkpoint) and ``.NAME.tmp`` (the
    new one) exist. The new one wins when it is finished, else the old one comes back. Returns the folder/file it
    restored from (None: nothing to do). Safe to call from several processes at once: one rename wins, a rename
    never replaces a non-empty folder, and files are linked (never replacing one) before being unlinked."""
    path = Path(path)
    old, tmp = path.with_name(f".{path.name}.old"), path.with_name(f".{path.name}.tmp")
    if path.exists() or not old.exists():  # a lone .NAME.tmp is an unfinished save: the next one clears it
        return None
    source = tmp if _finished(tmp) else old
    try:
        if source.is_dir():
            source.rename(path)
        else:
            os.link(source, path)
            source.unlink()
    except OSError:  # another process restored it first
        return None
    if source is tmp and old.exists():
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    warnings.warn(f"checkpoint {str(path)!r} was missing after an interrupted save; restored it from"
                  f" {source.name!r} ({'the finished new' if source is tmp else 'the previous'} checkpoint)",
                  stacklevel=2)
    return source


def begin_folder(path: str | os.PathLike) -> Path:
    """Collective: the empty temporary folder ``.NAME.tmp`` next to ``path`` that a save writes into (what an
    earlier interrupted save left there is cleared first)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if _rank() == 0:
        recover_interrupted_save(path)  # before the leftovers of that save are cleared away
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def abandon_folder(tmp: Path) -> None:
    """What a failed save wrote goes (a full disk gets its space back); ``path`` keeps the previous checkpoint."""
    if _rank() == 0:
        remove(tmp)


def commit_folder(tmp: Path, path: str | os.PathLike, group: Any = None) -> None:
    """Collective (over ``group``): once every rank has written its part of ``tmp``, rank 0 swaps it in for
    ``path``."""
    _barrier(group)
    if _rank() == 0:
        _replace_atomically(tmp, Path(path))
    _barrier(group)


@contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Collective: every rank writes into the yielded temporary folder; afterwards rank 0 swaps it in for
    ``path``, so readers never see a half-written checkpoint and an old one is replaced only when complete."""
    tmp = begin_folder(path)
    try:
        yield tmp
    except BaseException:
        abandon_folder(tmp)
        raise
    commit_folder(tmp, path)


def save_sharded(path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, Any],
                 saver: Any = None) -> Path:
    """Write a sharded checkpoint folder collectively; readers never see a half-written ``path``. ``saver``: an
    :class:`~disttrain.parallel.checkpoint.async_save.AsyncSaver`, which returns once the tensors are staged in host
    memory and writes the same folder in the background (``async_checkpoint=True``)."""
    meta = {**metadata, FORMAT_KEY: {"version": 1, "tensor_keys": sorted(tensors)}}
    if saver is not None:
        saver.wait()  # at most one save in flight; its error (a full disk) is raised here, as a synchronous save's
    check_space(path, [tensors, meta if _rank() == 0 else None])
    if saver is not None:
        return saver.save(path, tensors, meta)
    with phase(f"saving checkpoint {path}"), atomic_folder(path) as tmp:
        writer = ChecksumWriter(tmp)  # each rank hashes the shard it writes, while writing it
        with writing(path, "the checkpoint's shards", kept=KEPT):  # DCP raises on every rank
            dcp.save(tensors, storage_writer=writer)
        finish_folder(tmp, meta, writer.digests)
    return Path(path)


def finish_folder(tmp: Path, meta: dict[str, Any], digests: dict[str, Any], group: Any = None) -> None:
    """Collective (over ``group``), once the DCP shards are in ``tmp``: rank 0 writes ``meta.pt``, then the manifest
    of every file, which marks the folder finished."""

    def write_meta() -> None:
        with writing(tmp / META_FILE, "the checkpoint's meta.pt", "metadata", KEPT):
            torch.save(meta, tmp / META_FILE)

    _on_rank0(write_meta, group=group)
    with writing(tmp / MANIFEST_FILE, "the checkpoint's manifest", kept=KEPT):
        write_manifest(tmp, digests, group)  # its error reaches every rank (see write_manifest)


def save_full(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """One ``torch.save`` file written by rank 0 (state already gathered there), atomically."""
    path = Path(path)

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover_interrupted_save(path)
        tmp = path.with_name(f".{path.name}.tmp")
        ensure_free(path, tensor_bytes(state), "the checkpoint", f"free space there ({KEPT})")
        with writing(path, "the checkpoint", "checkpoint", KEPT, cleanup=tmp):
            torch.save(state, tmp)
        _replace_atomically(tmp, path)

    _on_rank0(write)
    return path


def _missing_parts(path: Path, layout: str) -> list[str]:
    if layout == "zero":  # DeepSpeed: `latest` names the tag folder that holds every rank's states
        latest = path / "latest"
        if not latest.is_file():
            return ["latest"]
        tag = path / latest.read_text().strip()
        return [] if tag.is_dir() and any(tag.glob("*model_states.pt")) else [f"{tag.name}/*model_states.pt"]
    return [name for name in (".metadata", META_FILE) if not (path / name).is_file()]


def check_checkpoint(path: str | os.PathLike, layout: str = "dcp") -> Path:
    """A clear error for a missing, incomplete or unreadable checkpoint path (raised on every rank).
    ``layout``: "dcp" (our sharded folders) or "zero" (DeepSpeed's)."""
    path = Path(path)
    error: Exception | None = None
    recover_interrupted_save(path)
    if not path.exists():
        error = FileNotFoundError(
            f"checkpoint {str(path)!r} does not exist; pass the folder (sharded) or file (full) that"
            " save_checkpoint wrote, e.g. one listed by `ls` under your checkpoint directory")
    elif path.is_dir():
        missing = _missing_parts(path, layout)
        if missing:
            error = CheckpointError(
                f"checkpoint folder {str(path)!r} is incomplete or not a disttrain checkpoint: missing"
                f" {', '.join(missing)} (was the save interrupted?); resume from an earlier checkpoint")
    _all_ranks_ok(error)
    return path


def _read_meta(path: Path, weights_only: bool = True) -> dict[str, Any]:
    try:
        data = (path / META_FILE).read_bytes()
        check_bytes(path, META_FILE, data)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        refused = [line.strip() for line in str(e).splitlines() if "Unsupported global" in line]
        if not refused:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: cannot read {META_FILE} ({e});"
                                  " resume from an earlier checkpoint") from e
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {META_FILE} holds objects that safe loading refuses ({refused[0]});"
            " if you trust this checkpoint, load it with weights_only=False (trainer.fit(..., weights_only=False))"
            " or store plain types (e.g. str instead of Path) in hyperparameters") from e
    except Exception as e:  # unpickling errors come in many types
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: cannot read {META_FILE} ({e});"
                              " resume from an earlier checkpoint") from e


class StorageLayout:
    """How a strategy's in-memory tensors differ from the one checkpoint layout (timm's qkv rows under TP): it
    rewrites the state before saving and the load targets around ``dcp.load``. The default changes nothing."""

    def before_save(self, tensors: dict[str, Any]) -> None:
        pass

    def before_load(self, tensors: dict[str, Any]) -> None:
        pass

    def after_load(self, tensors: dict[str, Any]) -> None:
        pass


def load_sharded(path: str | os.PathLike, targets: dict[str, Any], model: nn.Module,
                 strict: bool = True, weights_only: bool = True,
                 layout: StorageLayout | None = None, source: Any = None) -> dict[str, Any]:
    """Load a sharded checkpoint into ``targets`` (``{key: module | optimizer}``); returns the metadata.

    Works at any world size: DCP reshards on load. Every file read is verified against the manifest first
    (:class:`CheckpointReader`); ``weights_only=False`` also admits non-plain objects in ``meta.pt`` and in
    non-tensor items (trusted checkpoints only). ``source``: a checkpoint another library wrote, seen in the one
    layout (``reader``, a DCP storage reader, and ``metadata``, what its ``meta.pt`` would hold): Lightning's own,
    read by ``disttrain.checkpoint_loading``.
    """
    layout = layout or StorageLayout()
    if source is not None:
        metadata, reader = dict(source.metadata), source.reader
    else:
        path, reader = check_checkpoint(path), None
        error, metadata = None, {}
        try:
            metadata = _read_meta(path, weights_only)
        except CheckpointError as e:
            error = e
        _all_ranks_ok(error)
    stored = set(metadata.pop(FORMAT_KEY, {}).get("tensor_keys", []))
    missing = [key for key in targets if stored and key not in stored]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} has no {missing} (it holds {sorted(stored)});"
                              " pass the same state keys that were saved")
    skipped = {key: left_out(path, metadata, key, obj) for key, obj in targets.items() if isinstance(obj, nn.Module)}
    pop_record(metadata)
    tensors = {key: ({k: v for k, v in model_state(obj).items() if k not in skipped[key]}
                     if isinstance(obj, nn.Module) else optimizer_state(model, obj))
               for key, obj in targets.items()}
    layout.before_load(tensors)
    renamed = _read_copies_as_their_sources(path, tensors, targets, model) if source is None else {}
    load_into(path, tensors, strict=strict, weights_only=weights_only, reader=reader)
    for key, names in renamed.items():
        for alias, entry in names.items():
            tensors[key][entry] = tensors[key].pop(alias)
    layout.after_load(tensors)
    for key, obj in targets.items():
        if isinstance(obj, nn.Module):  # what the checkpoint left out is the base already loaded (frozen.py)
            set_model_state_dict(obj, tensors[key], options=StateDictOptions(strict=strict and not skipped[key]))
        else:
            set_optimizer_state_dict(model, obj, tensors[key], options=_FLAT)
    return metadata


def _read_copies_as_their_sources(path: Path, tensors: dict[str, Any], targets: dict[str, Any],
                                  model: nn.Module | None) -> dict[str, dict[str, str]]:
    """A pipeline's last stage keeps a tied LM head as a copy of the embedding, with optimizer state of its own; a
    checkpoint written without pipeline stages holds one state for the tied weight, under the embedding's name.
    Such entries of ``tensors`` are renamed in place to read the embedding's; returns ``{key: {read name: own
    name}}`` to rename them back after the load."""
    from disttrain.parallel.checkpoint.pretrained import tied_copies

    if model is None or all(isinstance(obj, nn.Module) for obj in targets.values()):
        return {}  # no optimizer to read
    copies = tied_copies(model)
    if not copies:
        return {}
    stored = stored_entries(path)
    renamed: dict[str, dict[str, str]] = {}
    for key, obj in targets.items():
        if isinstance(obj, nn.Module):
            continue
        for entry in list(tensors[key]):
            for head, source in copies.items():
                kind, _, rest = entry.partition(f"{head}.")  # "state." + "exp_avg", "param_groups." + "lr"
                if kind in ("state.", "param_groups.") and f"{key}.{entry}" not in stored \
                        and f"{key}.{kind}{source}.{rest}" in stored:
                    tensors[key][f"{kind}{source}.{rest}"] = tensors[key].pop(entry)
                    renamed.setdefault(key, {})[f"{kind}{source}.{rest}"] = entry
    return renamed


def load_pretrained(folder: str | os.PathLike, module: nn.Module, prefix: str = "",
                    layout: StorageLayout | None = None, partial: bool = False,
                    exclude: Collection[str] = ()) -> list[str]:
    """Collective: the weights of an HF folder into ``module``'s (sharded) parameters, each rank reading only its own
    slices (:mod:`disttrain.parallel.checkpoint.pretrained`); ``prefix``: the model's path inside ``module`` (``"model."`` for
    a LightningModule's ``self.model``); ``partial``: load only the tensors the folder has (LoRA adapters' first
    values); ``exclude``: tensor names (as the folder names them) left as they are, e.g. a classifier head
    fine-tuned for another class count. ``folder`` may also be one safetensors file. Returns the parameters the
    folder has no tensor for that are tied to one it has (an LM head sharing the embedding); any other missing
    tensor is one error naming them."""
    from disttrain.parallel.checkpoint.pretrained import MODEL_KEY, PretrainedReader, pretrained_names, tied_copies

    layout = layout or StorageLayout()
    state = model_state(module)
    names, tied = pretrained_names(folder, state, prefix, lambda loaded: _tied_aliases(module, loaded), partial,
                                   exclude, copies=tied_copies(module))
    tensors = {MODEL_KEY: {k: state[k] for k in names}}
    layout.before_load(tensors)
    load_into(folder, tensors, reader=PretrainedReader(folder, {f"{MODEL_KEY}.{k}": s for k, s in names.items()}))
    layout.after_load(tensors)
    set_model_state_dict(module, tensors[MODEL_KEY], options=StateDictOptions(strict=False))
    if not partial:
        remember_base(module, folder, names, tied)
    return tied


def _tied_aliases(module: nn.Module, loaded: set[str]) -> set[str]:
    """Names of parameters that share their tensor with a loaded one under another name (tied weights)."""
    from disttrain.parallel.checkpoint.pretrained import shared_names

    return {name for names in shared_names(module) if loaded & set(names) for name in names if name not in loaded}


def load_full(path: str | os.PathLike, targets: dict[str, Any], model: nn.Module,
              strict: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """Load a single-file checkpoint (``save_distributed_checkpoint=False``) on every rank."""
    path = check_checkpoint(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {e}; resume from an earlier checkpoint") from e
    full = StateDictOptions(full_state_dict=True, strict=strict)
    for key, obj in targets.items():
        if isinstance(obj, nn.Module):
            partial = bool(left_out(path, state, key, obj))  # the frozen base, loaded already (frozen.py)
            set_model_state_dict(obj, state.pop(key), options=replace(full, strict=strict and not partial))
        else:
            set_optimizer_state_dict(model, obj, state.pop(key), options=full)
    pop_record(state)
    return state


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


def export_safetensors(model: nn.Module, path: str | os.PathLike, prefix: str = "") -> Path:
    """Gather the full model to rank 0 and write it as one safetensors file that loads into the unwrapped model
    (``model.load_state_dict(safetensors.torch.load_file(path))``). Collective: call on every rank.

    ``prefix`` (e.g. ``"model."``) keeps only the keys of that submodule, with the prefix removed.
    """
    return write_from_rank0(model_state(model, full=True), path, prefix)


def select_prefix(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under ``prefix``, with the prefix removed (all of them for ""); an error if none is."""
    if not prefix:
        return dict(state)
    kept = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not kept:
        first = next(iter(state), None)
        raise ValueError(f"prefix={prefix!r} matches no parameter (keys start like {first!r}); pass the"
                         " submodule's attribute path with a trailing dot, e.g. prefix='model.'")
    return kept


def write_from_rank0(state: Mapping[str, Any], path: str | os.PathLike, prefix: str = "") -> Path:
    """Collective: rank 0 (which holds the gathered ``state``) writes it as safetensors; a bad prefix is raised
    on every rank instead of leaving the others waiting."""
    path = Path(path)
    error: Exception | None = None
    if _rank() == 0:
        try:
            write_safetensors(select_prefix(state, prefix), path)
        except (ValueError, DiskFullError) as e:
            error = e
    _all_ranks_ok(error)
    return path


def write_safetensors(state: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share storage (tied embeddings): store each one on its own.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    ensure_free(path, tensor_bytes(tensors), "the exported weights")
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        tmp = Path(f.name)
    try:
        with writing(path, "the exported weights", "export"):
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def consolidate(checkpoint: str | os.PathLike, output: str | os.PathLike, key: str | None = None,
                prefix: str = "") -> Path:
    """Offline, one process: a sharded checkpoint folder (DCP, or DeepSpeed ZeRO: its fp32 master weights) ->
    the model's full weights in one safetensors file.

    ``key`` picks the model's entry ("state_dict" for Trainer checkpoints); by default the one entry that is
    not an optimizer state. ``prefix`` keeps only the keys under it, stripped (``"model."``).
    """
    path = Path(checkpoint)
    output = Path(output)
    write_safetensors(select_prefix(full_model_state(path, key), prefix), output)
    return output


def full_model_state(checkpoint: str | os.PathLike, key: str | None = None) -> dict[str, torch.Tensor]:
    """Offline, one process: the model's full state dict (FQN -> tensor) from a checkpoint folder of any
    strategy (our DCP layout, or a DeepSpeed ZeRO folder: its fp32 master weights). ``key`` as in consolidate."""
    path = Path(checkpoint)
    path = check_checkpoint(path, layout="zero" if is_zero_checkpoint(path) else "dcp")
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a single-file checkpoint, not a sharded folder; load it with"
                              " torch.load(weights_only=True) instead")
    if is_zero_checkpoint(path):  # DeepSpeed ZeRO folder: the weights are the model entry itself
        try:
            state = {"model": zero_fp32_state_dict(path)}
        except Exception as e:
            raise CheckpointError(f"ZeRO checkpoint {str(path)!r} is corrupt: {e}") from e
        key = "model"
    else:
        state = read_full(path)
    if key is None:
        models = [k for k, v in state.items() if isinstance(v, Mapping) and not _is_optimizer_state(v)]
        if len(models) != 1:
            raise CheckpointError(f"checkpoint {str(path)!r} holds {sorted(state)}; pass key= to pick the model")
        key = models[0]
    if key not in state:
        raise CheckpointError(f"checkpoint {str(path)!r} has no entry {key!r}; it holds {sorted(state)}")
    model = dict(state[key])
    if not is_zero_checkpoint(path):
        add_base(path, read_meta(path), key, model)  # a LoRA run's frozen base, from its folder (frozen.py)
    return model


def is_zero_checkpoint(path: Path) -> bool:
    """A DeepSpeed checkpoint folder (``latest`` names its tag folder)."""
    return path.is_dir() and (path / "latest").is_file()


def zero_fp32_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a ZeRO checkpoint folder, merged from every rank's shards (DeepSpeed's
    zero_to_fp32; it unpickles DeepSpeed's own checkpoint files, so load only checkpoints you wrote)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path))


def _is_optimizer_state(state: Mapping[str, Any]) -> bool:
    """Nested ({"state", "param_groups"}) or flattened ("state.<fqn>.<name>", "param_groups.<fqn>.<name>")."""
    return any(k in ("state", "param_groups") or k.startswith(("state.", "param_groups.")) for k in state)


def read_full(path: str | os.PathLike, keys: set[str] | None = None, weights_only: bool = True) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint folder (or only the top-level ``keys``), full size, in this process, in
    the nested form it was saved in (``{"model": {fqn: tensor}, "optimizer": {"state": ..., ...}}``). No
    collective: each rank reads for itself (for strategies that keep full tensors while loading, like ZeRO-3).
    Every file read is verified against the manifest (:class:`CheckpointReader`)."""
    # dcp.load only fills keys the caller already has; the empty-dict planner (what dcp_to_torch_save uses) builds
    # the nested dict from the checkpoint's own metadata.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=CheckpointReader(path, weights_only),
                         planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise unwrap_dcp_error(e) or CheckpointError(f"checkpoint {str(path)!r} is corrupt: {e}") from e
    return state


def read_meta(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """The non-tensor part of a complete DCP checkpoint folder (step, loop state, user metadata)."""
    path = check_checkpoint(path)
    metadata = _read_meta(path, weights_only)
    metadata.pop(FORMAT_KEY, None)
    return metadata


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished checkpoint folder (DCP metadata and our meta.pt, which is written last)."""
    path = Path(path)
    return path.is_dir() and not _missing_parts(path, "dcp")


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder under ``folder`` (by its name's trailing number, e.g. step-000012,
    then modification time), skipping the hidden ``.NAME.tmp`` folders an interrupted save leaves behind and any
    incomplete folder. None when there is none (a fresh start)."""
    import re

    folder = Path(folder)
    if not folder.is_dir():
        return None
    for leftover in folder.glob(".*.old"):  # a save killed between its two renames
        recover_interrupted_save(folder / leftover.name[1:-len(".old")])

    def order(p: Path) -> tuple[int, float]:
        number = re.search(r"(\d+)$", p.name)
        return (int(number.group(1)) if number else -1, p.stat().st_mtime)

    done = [p for p in folder.iterdir() if not p.name.startswith(".") and is_complete(p)]
    return max(done, key=order) if done else None


# -- reading a DCP folder into prepared targets (strategies that build their own load targets, like ZeRO-3) ------
def storage_reader(path: str | os.PathLike, weights_only: bool = True) -> CheckpointReader:
    """The reader every load reads a checkpoint folder through: ``.metadata`` and shards verified against the
    manifest, ``.metadata`` unpickled restrictively (see :class:`CheckpointReader`)."""
    return CheckpointReader(Path(path), weights_only)


def stored_entries(path: str | os.PathLike) -> dict[str, Any]:
    """What a DCP checkpoint folder holds, without reading any tensor: flattened key (``"model.<fqn>"``,
    ``"optimizer.state.<fqn>.exp_avg"``) -> DCP's ``TensorStorageMetadata`` (full size, dtype, stored chunks) or
    ``BytesStorageMetadata``."""
    try:
        return dict(storage_reader(path).read_metadata().state_dict_metadata)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: cannot read its .metadata ({e}); resume from"
                              " an earlier checkpoint") from e


def load_into(path: str | os.PathLike, targets: dict[str, Any], strict: bool = True,
              weights_only: bool = True, reader: Any = None) -> None:
    """Collective ``dcp.load`` of a checkpoint folder into ``targets`` (nested dicts of tensors, DTensors or
    ShardedTensors, filled in place; other values are replaced by the stored ones): each rank reads only the
    stored chunks that overlap its targets, each verified before it is used. ``reader``: another storage (a
    pretrained folder's :class:`~disttrain.parallel.checkpoint.pretrained.PretrainedReader`)."""
    try:
        dcp.load(targets, storage_reader=reader or storage_reader(path, weights_only),
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException derives from BaseException
        raise unwrap_dcp_error(e) or CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or does not match the model: {e}") from e


def read_as_single_file(path: str | os.PathLike, key: str = "state_dict", weights_only: bool = True) -> dict[str, Any]:
    """One process, no collective, no GPU: a checkpoint folder as the one dict its single-file form would hold
    (``save_distributed_checkpoint=False``): ``meta.pt``'s entries plus the tensor entry ``key`` read whole
    (``{fqn: full tensor}`` on the CPU). Optimizer states stay on disk. ``meta.pt`` is unpickled with
    ``weights_only`` (only an explicit False lifts it). Every failure is one line naming the folder."""
    path = check_checkpoint(path)
    try:
        metadata = _read_meta(path, weights_only)
    except CheckpointError as e:
        if "\n" not in str(e):
            raise
        # torch's weights-only error text suggests weights_only=False, which a corrupt file does not need.
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: cannot read {META_FILE}"
                              f" ({type(e.__cause__ or e).__name__}); load an earlier checkpoint") from e
    stored = metadata.pop(FORMAT_KEY, {}).get("tensor_keys", [])
    if key not in stored:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds {stored}, no {key!r} (fabric.save writes the keys it is given): load it"
            f" with fabric.load, or write the model out with `disttrain export {path} model.safetensors --key KEY`")
    try:
        tensors = read_full(path, keys={key})
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: its tensors cannot be read"
                              f" ({_first_line(e.__cause__ or e)}); load an earlier checkpoint") from e
    add_base(path, metadata, key, tensors[key])  # a LoRA run's frozen base, from its folder (frozen.py)
    pop_record(metadata)
    return {**metadata, key: tensors[key]}


def _first_line(error: BaseException) -> str:
    """The first sentence of an error, for one-line messages: DCP wraps each rank's error (with its traceback) in
    a CheckpointException whose own text names only the ranks; torch.load's errors span many lines."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first.split('. ')[0][:200]}"


def is_disttrain_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder a disttrain strategy wrote, or what an interrupted or damaged save left of one:
    its ``meta.pt`` names the format, or cannot be read, or is missing next to DCP files. False for files and other
    folders (Lightning's own FSDP checkpoints have a ``meta.pt`` without the format entry)."""
    path = Path(path)
    if not path.is_dir():
        return False
    if not (path / META_FILE).is_file():
        return (path / ".metadata").exists() or any(path.glob("*.distcp"))
    try:
        return FORMAT_KEY in torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    except Exception:  # damaged, or holding what safe loading refuses: reading it names the problem
        return True
