"""Pretrained weights loaded sharded: each rank reads only its own slices of a Hugging Face folder's safetensors
files, straight into the parameters a strategy already sharded (FSDP's DTensor shards, tensor-parallel slices,
pipeline stages, ZeRO-3's partitions), converting the dtype slice by slice.

It is a DCP load whose storage is the HF folder: torch's ``HuggingFaceStorageReader`` describes every tensor of the
safetensors files as one stored chunk and reads each rank's requests with ``safe_open(...).get_slice(name)[slices]``
(memory-mapped: only the requested bytes are read). :class:`PretrainedReader` only renames the folder's tensor names
into the state's (``model.`` + the model's path inside the module) so that every engine's own load path (the storage
layout of fused weights under TP, ZeRO-3's partition boxes) runs unchanged. Per rank, host memory holds its shards
plus the slice being copied; no rank reads the whole file. The model is built empty (meta device / ``zero.Init``),
set up by the strategy, then loaded: ``strategy.load_pretrained(model, folder)``. A single ``*.safetensors`` file
(a timm checkpoint) is read the same way: in place of the folder, only that file is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

# The key a model's tensors sit under in the state a load path fills (as in disttrain's checkpoints).
MODEL_KEY = "model"


def check_pretrained(path: str | os.PathLike) -> Path:
    """The path, if it is a folder holding a model's safetensors weights or one ``*.safetensors`` file; else one line
    naming what is missing and the fix."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise FileNotFoundError(f"pretrained file {str(path)!r} is not a *.safetensors file; pass a safetensors"
                                    " file or a folder of them (save_pretrained writes safetensors by default)")
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"pretrained folder {str(path)!r} does not exist; pass a local Hugging Face model"
                                " folder (config.json + *.safetensors); nothing is downloaded")
    if not any(path.glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise FileNotFoundError(
            f"pretrained folder {str(path)!r} has no *.safetensors weights (it holds {found}); save them with"
            " model.save_pretrained(folder) (safetensors is its default), or convert a pytorch_model.bin once with"
            " transformers")
    return path


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files a pretrained folder (or the one file) holds."""
    path = check_pretrained(path)
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def stored_names(path: str | os.PathLike) -> set[str]:
    """The tensor names of a folder's safetensors files (its index when sharded, else each file's header), or of
    the one file."""
    from safetensors import safe_open

    path = check_pretrained(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


class _OneFile(FileSystem):
    """The file system as the reader sees it when it reads one file: listing the folder yields only that file."""

    def __init__(self, file: Path) -> None:
        super().__init__()
        self.file = file

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [str(self.file)]


class PretrainedReader(HuggingFaceStorageReader):
    """torch's reader of an HF safetensors folder (or of one safetensors file), its tensors seen under the names of
    the state being filled: ``names`` maps each target (``model.`` + the parameter's path) to the folder's tensor
    name. Tensors no target names are not read."""

    def __init__(self, path: str | os.PathLike, names: Mapping[str, str]) -> None:
        path = check_pretrained(path)
        super().__init__(str(path.parent if path.is_file() else path))
        if path.is_file():  # torch's reader lists every *.safetensors of its folder: this one file only
            self.fs = _OneFile(path)
        self.names = dict(names)

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()
        by_stored: dict[str, list[str]] = {}
        for target, stored in self.names.items():
            by_stored.setdefault(stored, []).append(target)
        renamed = {target: metadata.state_dict_metadata[stored] for target, stored in self.names.items()}
        storage = {dataclasses.replace(index, fqn=target): info
                   for index, info in (metadata.storage_data or {}).items() for target in by_stored.get(index.fqn, ())}
        self.storage_data = storage
        return dataclasses.replace(metadata, state_dict_metadata=renamed, storage_data=storage)

    def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
        stored = dataclasses.replace(req.storage_index, fqn=self.names[req.storage_index.fqn])
        super()._process_read_request(f, dataclasses.replace(req, storage_index=stored), planner)


def stored_name(name: str) -> str:
    """The folder's name of a model parameter: LoRA (peft) moves a wrapped layer's own weight to
    ``<layer>.base_layer.weight``; the pretrained folder has it as ``<layer>.weight``."""
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    """A LoRA adapter's parameter (peft's ``lora_A`` / ``lora_B`` / magnitude vectors): not in a base model's folder."""
    return any(f".{part}." in name for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                                                  "lora_magnitude_vector"))


def shared_names(module: Any) -> list[list[str]]:
    """The module's parameter names grouped by the tensor they name (a group of several: tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return list(by_id.values())


# The attribute of a split model naming its heads that copy a tied weight, {head: embedding}
# (:func:`disttrain.parallel.split.pipeline.untie_head` sets it).
TIED_COPIES = "_disttrain_tied_copies"


def tied_copies(module: Any) -> dict[str, str]:
    """``{parameter name: name of the weight it copies}`` in ``module``: the LM heads that pipeline parallelism gave
    a copy of the tied input embedding. The pretrained loader fills such a head from the embedding's tensor (HF
    leaves tied weights out of its files), and a checkpoint written without pipeline stages gives it the
    embedding's optimizer state."""
    copies = {}
    for path, sub in module.named_modules():
        prefix = f"{path}." if path else ""
        copies.update({prefix + head: prefix + source for head, source in getattr(sub, TIED_COPIES, {}).items()})
    return copies


def pretrained_names(folder: str | os.PathLike, model_names: Iterable[str], prefix: str,
                     tied: Callable[[set[str]], set[str]], partial: bool = False,
                     exclude: Collection[str] = (), copies: Mapping[str, str] | None = None,
                     ) -> tuple[dict[str, str], list[str]]:
    """Which of the model's parameters (``model_names``, with ``prefix``) the folder fills, and from which of its
    tensors: ``({model name: folder tensor name}, tied names)``. Every parameter under ``prefix`` must be in the
    folder, except LoRA adapters, parameters tied to a loaded one (``tied(loaded)`` returns those) and ``exclude``
    (folder names left at their initialisation: a classifier head for a new class count); with ``partial`` only the
    folder's tensors are loaded, and each must be a parameter of the model. ``copies`` (:func:`tied_copies`): a
    head the folder has no tensor for reads the one of the weight it copies. A mismatch is one error naming the
    first names and the fix."""
    from disttrain.parallel.checkpoint.integrity import CheckpointError

    stored = stored_names(folder) - set(exclude)
    mine = [k for k in model_names if k.startswith(prefix) and stored_name(k[len(prefix):]) not in exclude]
    names = {k: stored_name(k[len(prefix):]) for k in mine}
    loaded = {k: s for k, s in names.items() if s in stored}
    for head, source in (copies or {}).items():
        if head in names and head not in loaded and source.startswith(prefix):
            if (copied := stored_name(source[len(prefix):])) in stored:
                loaded[head] = copied
    if partial:
        unknown = sorted(stored - set(loaded.values()))
        if unknown:
            raise CheckpointError(f"{str(folder)!r} holds {unknown[:5]}, which the model has no parameter for; pass"
                                  " weights saved from the same architecture")
        return loaded, []
    tied_names = tied(set(loaded))
    missing = sorted(s for k, s in names.items() if k not in loaded and k not in tied_names and not is_adapter(k))
    if missing or not loaded:
        raise CheckpointError(f"pretrained folder {str(folder)!r} does not match the model: it has no"
                              f" {missing[:5] or sorted(names.values())[:5]}{' ...' if len(missing) > 5 else ''};"
                              " pass the folder of the same architecture (its config.json builds the model)")
    return loaded, sorted(tied_names)


__all__ = ["MODEL_KEY", "PretrainedReader", "check_pretrained", "is_adapter", "pretrained_names", "safetensors_files",
           "shared_names", "stored_name", "stored_names", "tied_copies"]
