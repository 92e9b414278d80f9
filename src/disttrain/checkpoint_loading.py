"""``MyModule.load_from_checkpoint(folder)`` on the checkpoint folders the disttrain strategies write
(``ModelCheckpoint``, ``trainer.save_checkpoint``): in one plain process, without torch.distributed or a GPU.

The folder is consolidated on load: the full ``state_dict`` and ``meta.pt``'s entries (hyperparameters saved by
``save_hyperparameters``, loop and callback state) form the dict a single-file checkpoint holds, and Lightning then
builds and fills the module exactly as it does from a file.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

from disttrain.parallel.checkpoint import is_disttrain_folder, read_as_single_file


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


def install_load_from_checkpoint() -> None:
    """Let ``LightningModule.load_from_checkpoint`` / ``LightningDataModule.load_from_checkpoint`` read disttrain
    checkpoint folders (idempotent).

    Both read the path with the name ``pl_load`` in ``lightning.pytorch.core.saving`` (Fabric's ``_load``), which
    opens it as one file: a folder fails with IsADirectoryError. No Trainer or strategy exists at that point, so
    Lightning offers no hook; that one module-level name is rebound instead. Every path that is not a disttrain
    checkpoint folder (files, URLs, streams, other folders) goes to Lightning's function unchanged, and nothing
    else in Lightning (the Trainer's resume, Fabric's load, other modules importing ``_load``) is touched.
    """
    from lightning.pytorch.core import saving

    if getattr(saving.pl_load, "_reads_disttrain_folders", False):
        return
    saving.pl_load = _reading_folders(saving.pl_load)


def _reading_folders(lightning_load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(lightning_load)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if is_checkpoint_folder(path_or_url):
            return read_checkpoint_folder(path_or_url, map_location, weights_only)
        return lightning_load(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._reads_disttrain_folders = True  # type: ignore[attr-defined]
    return pl_load
