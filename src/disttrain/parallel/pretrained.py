"""Pretrained weights loaded sharded: each rank reads only its own slices of a Hugging Face folder's safetensors
files, straight into the parameters a strategy already sharded (FSDP's DTensor shards, tensor-parallel slices,
pipeline stages, ZeRO-3's partitions), converting the dtype slice by slice.

It is a DCP load whose storage is the HF folder: torch's ``HuggingFaceStorageReader`` describes every tensor of the
safetensors files as one stored chunk and reads each rank's requests with ``safe_open(...).get_slice(name)[slices]``
(memory-mapped: only the requested bytes are read). :class:`PretrainedReader` only renames the folder's tensor names
into the state's (``model.`` + the model's path inside the module) so that every engine's own load path (the storage
layout of fused weights under TP, ZeRO-3's partition boxes) runs unchanged. Per rank, host memory holds its shards
plus the slice being copied; no rank reads the whole file. The model is built empty (meta device / ``zero.Init``),
set up by the strategy, then loaded: ``strategy.load_pretrained(model, folder)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata

# The key a model's tensors sit under in the state a load path fills (as in disttrain's checkpoints).
MODEL_KEY = "model"


def check_pretrained(folder: str | os.PathLike) -> Path:
    """The folder, if it holds a model's safetensors weights; else one line naming what is missing and the fix."""
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"pretrained folder {str(folder)!r} does not exist; pass a local Hugging Face model"
                                " folder (config.json + *.safetensors); nothing is downloaded")
    if not any(path.glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise FileNotFoundError(
            f"pretrained folder {str(folder)!r} has no *.safetensors weights (it holds {found}); save them with"
            " model.save_pretrained(folder) (safetensors is its default), or convert a pytorch_model.bin once with"
            " transformers")
    return path


def stored_names(folder: str | os.PathLike) -> set[str]:
    """The tensor names of a folder's safetensors files (its index when sharded, else each file's header)."""
    from safetensors import safe_open

    path = check_pretrained(folder)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


class PretrainedReader(HuggingFaceStorageReader):
    """torch's reader of an HF safetensors folder, its tensor ``name`` seen as ``prefix + name``."""

    def __init__(self, folder: str | os.PathLike, prefix: str) -> None:
        super().__init__(str(check_pretrained(folder)))
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


__all__ = ["MODEL_KEY", "PretrainedReader", "check_pretrained", "stored_names"]
