"""Exports from any disttrain checkpoint folder (every strategy writes the same DCP layout) to what other libraries
load: a Hugging Face model directory (LLM), a timm state dict (ViT), a plain torch state dict (DeepFM and any
``nn.Module``). One process, offline: ``disttrain export CKPT --to hf|timm|torch OUT``.

To give an HF export its config without ``--config``, save it with the checkpoint:
``fabric.save(path, {"model": model, "optimizer": opt, "hf_config": model.config.to_dict()})``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from disttrain.parallel.checkpoint import (
    CheckpointError,
    atomic_folder,
    full_model_state,
    read_meta,
    save_full,
    select_prefix,
    write_safetensors,
)

FORMATS = ("safetensors", "hf", "timm", "torch")
HF_CONFIG_KEY = "hf_config"


def export_checkpoint(checkpoint: str | os.PathLike, to: str, output: str | os.PathLike, key: Optional[str] = None,
                      prefix: str = "", config: str | os.PathLike | Mapping[str, Any] | None = None) -> Path:
    """Write the model of ``checkpoint`` as ``to``: "hf" (a directory: config.json + model.safetensors), "timm" (a
    state dict file, .safetensors or .pth by its suffix, for ``timm.models.load_checkpoint``), "torch" (a
    ``torch.save`` state dict for ``model.load_state_dict(torch.load(OUT, weights_only=True))``) or "safetensors".

    ``key``/``prefix`` pick the model's entry and submodule (Trainer checkpoints: key="state_dict",
    prefix="model."). ``config`` (hf only): a config.json, a directory holding one, or a dict; by default the
    ``hf_config`` entry saved in the checkpoint.
    """
    if to not in FORMATS:
        raise ValueError(f"--to {to!r} is not an export format; choose one of {', '.join(FORMATS)}")
    state = select_prefix(full_model_state(checkpoint, key), prefix)
    output = Path(output)
    if to == "hf":
        return _write_hf(state, output, _hf_config(checkpoint, config))
    if to == "torch" or (to == "timm" and output.suffix != ".safetensors"):
        return save_full(output, {k: v.contiguous() for k, v in state.items()})
    write_safetensors(state, output)
    return output


def _hf_config(checkpoint: str | os.PathLike, config: str | os.PathLike | Mapping[str, Any] | None) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if config is not None:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"--config {str(config)!r} is neither a config.json nor a directory holding one;"
                                    " pass the HF config the model was built from")
        return json.loads(path.read_text())
    saved = read_meta(checkpoint).get(HF_CONFIG_KEY)
    if saved is None:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} holds no {HF_CONFIG_KEY!r}; pass --config CONFIG.json (or the model's"
            " directory), or save it with the checkpoint: fabric.save(path, {..., 'hf_config':"
            " model.config.to_dict()})")
    return dict(saved)


def _write_hf(state: Mapping[str, torch.Tensor], output: Path, config: dict) -> Path:
    """config.json + model.safetensors, written into a temporary folder and swapped in whole."""
    from transformers import AutoConfig

    if "model_type" not in config:
        raise ValueError("the HF config has no 'model_type'; pass the config.json that the model was built from")
    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **settings)  # validates the config against its class
    with atomic_folder(output) as tmp:
        hf_config.save_pretrained(tmp)
        write_safetensors(state, tmp / "model.safetensors")
    return output
