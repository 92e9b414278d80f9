"""Checkpoints without the frozen pretrained weights: what LoRA (or any partial fine-tuning) trains is saved, the
frozen base is not.

A model that ``load_pretrained`` filled from a folder remembers it (:func:`remember_base`: the folder, a fingerprint
of its files and the state-dict keys it filled). A checkpoint of that model leaves out every filled parameter that
is frozen (``requires_grad=False``) and records the folder, the fingerprint and the keys it left out under
``FROZEN_KEY`` in its ``meta.pt``; a 7B LoRA run's checkpoints then hold the adapters and their optimizer state, not
14 GB of base each. Loading one needs the same base in the model first (resume re-reads the folder, as a fresh start
does): :func:`left_out` checks that the model's base was read from files with the same fingerprint and returns the
keys the load must skip, or stops with one line naming the folder.

The fingerprint covers each safetensors file's name, size, header (tensor names, dtypes, shapes, offsets) and 16
blocks of 64 KiB spread over its data: a folder replaced by another model or another fine-tune of the same
architecture differs there, and reading it costs milliseconds where hashing a 15 GB folder would take minutes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Optional

from torch import nn

from disttrain.parallel.checkpoint.integrity import CheckpointError

# In meta.pt: {state key: {"folder", "fingerprint", "left_out": {model key: the folder's tensor name}}}.
FROZEN_KEY = "disttrain_frozen_base"
_RECORD = "_disttrain_pretrained_base"  # the attribute load_pretrained leaves on the module it filled
_BLOCKS, _BLOCK = 16, 1 << 16


@dataclasses.dataclass(frozen=True)
class Base:
    folder: str
    fingerprint: str
    names: Mapping[str, str]  # state-dict key (as the module's checkpoints name it) -> the folder's tensor it holds

    @property
    def keys(self) -> set[str]:
        return set(self.names)


def fingerprint(folder: str | os.PathLike) -> str:
    """A digest of the folder's (or the one file's) safetensors files: names, sizes, headers and sampled data."""
    from disttrain.parallel.checkpoint.pretrained import safetensors_files

    digest = hashlib.sha256()
    for file in safetensors_files(folder):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(header_len))
            start = 8 + header_len
            span = max(size - start - _BLOCK, 0)
            for i in range(_BLOCKS):
                f.seek(start + span * i // max(_BLOCKS - 1, 1))
                digest.update(f.read(_BLOCK))
    return digest.hexdigest()


def remember_base(module: nn.Module, folder: str | os.PathLike, names: Mapping[str, str],
                  tied: Collection[str] = ()) -> None:
    """After ``load_pretrained`` filled ``module``'s state keys ``names`` (key -> the folder's tensor name) from
    ``folder`` (a whole load, not a partial one), and ``tied`` parameters share a filled one's tensor: checkpoints of
    ``module`` may leave those keys out while they stay frozen."""
    from disttrain.parallel.checkpoint.pretrained import shared_names

    filled = dict(names)
    for group in shared_names(module):
        source = next((names[n] for n in group if n in names), None)
        filled.update({n: source for n in group if n in tied and source is not None})
    object.__setattr__(module, _RECORD, Base(str(Path(folder).resolve()), fingerprint(folder), filled))


def base_of(module: nn.Module) -> Optional[tuple[nn.Module, Base]]:
    """The pretrained base ``module`` was filled from, and the module that holds it (``module`` itself, or what a
    strategy's wrapper wraps: ZeRO fills the unwrapped model, whose names its checkpoints use)."""
    for candidate in (module, getattr(module, "_forward_module", None), getattr(module, "module", None)):
        # The instance's own attribute: DeepSpeed's engine forwards unknown attributes to the model it wraps.
        base = vars(candidate).get(_RECORD) if candidate is not None else None
        if base is not None:
            return candidate, base
    return None


def frozen_keys(module: nn.Module) -> set[str]:
    """The state-dict keys (with the wrappers' parts removed, as checkpoints name them) of frozen parameters."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # what get_model_state_dict names a parameter

    return {fqn for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad
            for fqn in _get_fqns(module, name)}


def leave_out_frozen_base(tensors: dict[str, Any], metadata: dict[str, Any], modules: Mapping[str, nn.Module]) -> None:
    """Before a save: drop from each module's state in ``tensors`` the frozen parameters its pretrained folder
    filled, and record them in ``metadata``."""
    entries = {}
    for key, module in modules.items():
        found, state = base_of(module), tensors.get(key)
        if found is None or not isinstance(state, dict):
            continue
        owner, base = found
        dropped = sorted(base.keys & frozen_keys(owner) & set(state))
        for name in dropped:
            del state[name]
        if dropped:
            entries[key] = {"folder": base.folder, "fingerprint": base.fingerprint,
                            "left_out": {name: base.names[name] for name in dropped}}
    if entries:
        metadata[FROZEN_KEY] = entries


def left_out(path: Any, metadata: dict[str, Any], key: str, module: nn.Module) -> set[str]:
    """Before a load of ``module`` under ``key``: the keys the checkpoint left out (empty for a whole one), once
    the module's own base is known to be the one the checkpoint was trained on; else one line naming the folder."""
    entry = metadata.get(FROZEN_KEY, {}).get(key)
    if not entry:
        return set()
    dropped, folder = set(entry["left_out"]), entry["folder"]
    found = base_of(module)
    if found is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds only the parameters that trained: its {len(dropped)} frozen ones are"
            f" the pretrained weights of {folder!r}; load that folder into the model first"
            f" (strategy.load_pretrained, or the recipe's --pretrained {folder}), then the checkpoint")
    base = found[1]
    if base.fingerprint != entry["fingerprint"]:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was trained on the frozen weights of {folder!r}, but the model's were read from"
            f" {base.folder!r}, whose files differ; load {folder!r} (or an unchanged copy) before the checkpoint")
    unfilled = sorted(dropped - base.keys)
    if unfilled:
        raise CheckpointError(
            f"checkpoint {str(path)!r} left out {unfilled[:3]} as pretrained weights of {folder!r}, but the model's"
            " load of that folder did not fill them; build the model as it was when the checkpoint was saved")
    return dropped


def add_base(path: Any, metadata: Mapping[str, Any], key: str, state: dict[str, Any]) -> None:
    """Offline, one process (exports, ``load_from_checkpoint``): put the frozen base a checkpoint left out back into
    its model ``state`` (``key``'s full state dict), read from the folder it records once its files are checked to be
    the ones it was trained on."""
    from safetensors import safe_open

    from disttrain.parallel.checkpoint.pretrained import safetensors_files

    entry = metadata.get(FROZEN_KEY, {}).get(key)
    if not entry:
        return
    folder = entry["folder"]
    if not Path(folder).exists():
        raise CheckpointError(f"checkpoint {str(path)!r} holds only the parameters that trained; its frozen base is"
                              f" {folder!r}, which does not exist here: put the pretrained folder back at that path")
    if fingerprint(folder) != entry["fingerprint"]:
        raise CheckpointError(f"checkpoint {str(path)!r} was trained on the frozen weights of {folder!r}, whose files"
                              " have changed since; restore that folder as it was")
    wanted = dict(entry["left_out"])
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            present = set(f.keys())
            for name, stored in wanted.items():
                if stored in present:
                    state[name] = f.get_tensor(stored)


def pop_record(metadata: dict[str, Any]) -> None:
    """What a load returns to the caller (Fabric's remainder, Lightning's checkpoint dict) without the record."""
    metadata.pop(FROZEN_KEY, None)


__all__ = ["FROZEN_KEY", "Base", "add_base", "base_of", "fingerprint", "frozen_keys", "leave_out_frozen_base",
           "left_out", "pop_record", "remember_base"]
