"""Fine-tuning a ViT from a timm checkpoint (``--pretrained PATH`` of ``recipes/vision/vit2b.py``).

PATH is a folder as timm saves one for the Hugging Face hub (``config.json`` + ``model.safetensors``, written by
``timm.models.push_to_hf_hub`` or ``save_for_hf(..., safe_serialization=True)``), or one file: ``*.safetensors``, or a
``torch.save`` state dict (``*.pth``, ``*.pt``, ``*.bin``, also ``pytorch_model.bin`` in such a folder).

Safetensors are read sharded: the model is built empty, set up by the strategy, and each rank reads only its own
slices into its FSDP shards, ZeRO-3 partitions or tensor-parallel slices (``strategy.load_pretrained``, see
:mod:`disttrain.parallel.checkpoint.pretrained`). A torch file cannot be read in slices: it is read whole (``weights_only=True``)
once per machine and written as a temporary safetensors file, which the sharded load then reads.

The architecture is the recipe config's ``model:`` section and the checkpoint must match it tensor for tensor, with
one exception: a checkpoint trained for another class count (or saved without a head) leaves ``head.weight`` and
``head.bias`` at their fresh initialisation, which :attr:`TimmCheckpoint.note` says in one line. Any other
difference is one error naming the file, the tensors and the fix, found from the safetensors headers alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from disttrain.parallel.checkpoint.pretrained import check_pretrained, safetensors_files
from disttrain.vision.config import build_vit

HEAD = ("head.weight", "head.bias")
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
TORCH_IN_FOLDER = "pytorch_model.bin"  # what save_for_hf writes unless safe_serialization is set


@dataclass(frozen=True)
class TimmCheckpoint:
    """What ``--pretrained`` loads, checked against the model: ``path`` (a safetensors folder or file, read sharded;
    or a torch file, read whole), ``exclude`` (tensors left at their initialisation: the head for a new class count)
    and ``note`` (the one line saying so, else None)."""

    path: Path
    exclude: tuple[str, ...] = ()
    note: Optional[str] = None

    @property
    def is_torch_file(self) -> bool:
        return self.path.is_file() and self.path.suffix != ".safetensors"


def weights_path(path: Union[str, os.PathLike]) -> Path:
    """The safetensors folder or file, or the torch file, that a timm checkpoint path names; else one line saying
    what to pass."""
    path = Path(path)
    what = ("pass a local timm checkpoint: a folder with model.safetensors (and config.json), or a .safetensors, .pth"
            " or .bin file; nothing is downloaded")
    if path.is_file():
        if path.suffix == ".safetensors" or path.suffix in TORCH_SUFFIXES:
            return path
        raise FileNotFoundError(f"pretrained checkpoint {str(path)!r} is neither safetensors nor a torch file; {what}")
    if not path.is_dir():
        raise FileNotFoundError(f"pretrained checkpoint {str(path)!r} does not exist; {what}")
    if any(path.glob("*.safetensors")):
        return check_pretrained(path)
    if (path / TORCH_IN_FOLDER).is_file():
        return path / TORCH_IN_FOLDER
    found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
    raise FileNotFoundError(f"pretrained folder {str(path)!r} holds no weights ({found}); {what}")


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors headers (no tensor is read) or, for a torch file, from the state
    dict (memory-mapped where torch can)."""
    if path.is_file() and path.suffix != ".safetensors":
        return {name: tuple(t.shape) for name, t in read_torch_file(path).items()}
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def read_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A timm state dict saved with torch.save, unpickled with ``weights_only=True`` and memory-mapped (a tensor's
    bytes are read when it is used); a training checkpoint's ``state_dict``/``model`` entry and DDP's ``module.``
    prefix are unwrapped as timm does."""
    import argparse

    from timm.models import clean_state_dict

    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # timm training checkpoints hold their args
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a legacy (not zip) torch.save file cannot be memory-mapped
                saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"pretrained checkpoint {str(path)!r} cannot be read with torch.load(weights_only=True):"
                         f" {(str(e).splitlines() or [type(e).__name__])[0]}; save the model's state_dict() with"
                         " safetensors.torch.save_file instead") from e
    if isinstance(saved, dict):
        saved = next((saved[k] for k in ("state_dict", "model") if isinstance(saved.get(k), dict)), saved)
    if not isinstance(saved, dict):
        raise ValueError(f"pretrained checkpoint {str(path)!r} holds a {type(saved).__name__}, not a state dict; save"
                         " the model's state_dict()")
    return {name: t for name, t in clean_state_dict(saved).items() if isinstance(t, torch.Tensor)}


def timm_checkpoint(path: Union[str, os.PathLike], model_args: dict[str, Any],
                    config: str = "the config") -> TimmCheckpoint:
    """``path`` checked against the ViT that ``model_args`` (a ``model:`` section, from ``config``) builds: the head
    is excluded when its class count differs (or the checkpoint has none); any other missing, extra or differently
    shaped tensor is one error. Reads only the safetensors headers; every rank may call it."""
    weights = weights_path(path)
    stored = stored_shapes(weights)
    model = {name: tuple(t.shape) for name, t in build_vit(model_args, device="meta").state_dict().items()}
    exclude, note = _new_head(stored, model)
    differs = [f"{name} is {list(stored[name])} there, {list(model[name])} here"
               for name in sorted(stored.keys() & model.keys()) if name not in exclude and stored[name] != model[name]]
    missing = sorted(model.keys() - stored.keys() - set(exclude))
    extra = sorted(stored.keys() - model.keys() - set(exclude))
    if differs or missing or extra:
        problems = [f"{what} {_some(names)}" for what, names in (("it lacks", missing), ("it has extra", extra))
                    if names] + differs[:3] + ([f"{len(differs) - 3} more differ"] if len(differs) > 3 else [])
        if [d.split()[0] for d in differs] == ["pos_embed"] and not (missing or extra):
            fix = ("its position embedding is for another image size: set model.img_size (and patch_size) to the"
                   " checkpoint's, or resample it once with timm.layers.resample_abs_pos_embed and save it again")
        else:
            fix = (f"set model: in {config} to the checkpoint's architecture{_saved_args(weights)} (only num_classes"
                   " may differ)")
        raise ValueError(f"pretrained checkpoint {str(weights)!r} does not match the model: section of {config}:"
                         f" {'; '.join(problems)}; {fix}")
    return TimmCheckpoint(weights, exclude, note)


def _some(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _new_head(stored: dict[str, tuple[int, ...]],
              model: dict[str, tuple[int, ...]]) -> tuple[tuple[str, ...], Optional[str]]:
    """The head tensors to leave at their initialisation, and the line that says so."""
    if "head.weight" not in model:  # num_classes: 0, no head to fill
        return (), None
    classes = model["head.weight"][0]
    if "head.weight" not in stored:
        return HEAD, f"pretrained: head.weight/head.bias initialised for {classes} classes (checkpoint has no head)"
    had = stored["head.weight"]
    if had[0] != classes and had[1:] == model["head.weight"][1:]:
        return HEAD, (f"pretrained: head.weight/head.bias re-initialised for {classes} classes (checkpoint has"
                      f" {had[0]})")
    return (), None


def _saved_args(weights: Path) -> str:
    """`` (its config.json: {...})`` when timm saved the checkpoint's model arguments next to it, else empty."""
    config = (weights if weights.is_dir() else weights.parent) / "config.json"
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError):
        return ""
    args = saved.get("model_args") or {k: saved[k] for k in ("architecture", "num_classes") if k in saved}
    return f" (its config.json: {json.dumps(args)})" if args else ""


# -- loading, after the strategy set the model up ----------------------------------------------------------------

def load_timm_checkpoint(fabric: Any, model: nn.Module, checkpoint: TimmCheckpoint, prefix: str = "model.") -> None:
    """Collective: ``checkpoint`` into the timm model at ``prefix`` of the module ``fabric.setup`` returned. Under a
    disttrain strategy each rank reads only its own slices (``strategy.load_pretrained``); under Lightning's own
    single-device and DDP strategies every rank loads the whole model, which each of them holds; other strategies
    are refused."""
    with _as_safetensors(fabric, checkpoint) as path:
        if hasattr(fabric.strategy, "load_pretrained"):
            fabric.strategy.load_pretrained(model, path, prefix=prefix, exclude=checkpoint.exclude)
            return
        from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy

        if not isinstance(fabric.strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise ValueError(f"--pretrained needs a disttrain strategy (disttrain_fsdp, disttrain_zero3, ...) or"
                             f" Lightning's ddp or single-device one, not {type(fabric.strategy).__name__}")
        from safetensors.torch import load_file

        state = {}
        for file in safetensors_files(path):
            state.update(load_file(str(file)))
        inner = _submodule(getattr(model, "module", model), prefix)
        inner.load_state_dict({k: v for k, v in state.items() if k not in checkpoint.exclude}, strict=False)


def _submodule(module: nn.Module, prefix: str) -> nn.Module:
    return module.get_submodule(prefix.rstrip(".")) if prefix else module


@contextmanager
def _as_safetensors(fabric: Any, checkpoint: TimmCheckpoint) -> Iterator[Path]:
    """The checkpoint's safetensors path; a torch file is first written as one on each machine (by its first
    process, to a temporary folder removed after the load)."""
    if not checkpoint.is_torch_file:
        yield checkpoint.path
        return
    stat = checkpoint.path.stat()
    key = f"{checkpoint.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    folder = Path(tempfile.gettempdir()) / f"disttrain-pretrained-{hashlib.sha256(key).hexdigest()[:16]}"
    file = folder / "model.safetensors"
    with fabric.rank_zero_first(local=True):
        if not file.is_file():
            from safetensors.torch import save_file

            folder.mkdir(parents=True, exist_ok=True)
            state = {k: v.contiguous() for k, v in read_torch_file(checkpoint.path).items()}
            save_file(state, str(folder / f".{os.getpid()}.tmp"))
            os.replace(folder / f".{os.getpid()}.tmp", file)  # whole or absent: the other processes read it
    try:
        yield file
    finally:
        fabric.barrier()  # every process of this machine has read it
        if fabric.local_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


__all__ = ["TimmCheckpoint", "load_timm_checkpoint", "stored_shapes", "timm_checkpoint", "weights_path"]
