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
    """torch's reader of an HF safetensors folder (or of one safetensors file), its tensor ``name`` seen as
    ``prefix + name``."""

    def __init__(self, path: str | os.PathLike, prefix: str) -> None:
        path = check_pretrained(path)
        super().__init__(str(path.parent if path.is_file() else path))
        if path.is_file():  # torch's reader lists every *.safetensors of its folder: this one file only
            self.fs = _OneFile(path)
        self.prefix = prefix

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()
        renamed = {self.prefix + k: v for k, v in metadata.state_dict_metadata.items()}
        storage = {dataclasses.replace(index, fqn=self.prefix + index.fqn): info
                   for index, info in (metadata.storage_data or {}).items()}
        self.storage_data = storage
        return dataclasses.replace(metadata, state_dict_metadata=renamed, storage_data=storage)

    def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
        stored = dataclasses.replace(req.storage_index, fqn=req.storage_index.fqn[len(self.prefix):])
        super()._process_read_request(f, dataclasses.replace(req, storage_index=stored), planner)


__all__ = ["MODEL_KEY", "PretrainedReader", "check_pretrained", "safetensors_files", "stored_names"]
