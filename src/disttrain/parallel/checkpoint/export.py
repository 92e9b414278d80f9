"""Exports from any disttrain checkpoint folder (every strategy writes the same DCP layout) to what other libraries
load: a Hugging Face model directory (LLM), a timm state dict (ViT), a plain torch state dict (DeepFM and any
``nn.Module``). One process, offline: ``disttrain export CKPT --to hf|timm|torch OUT``. The formats are the model
families' (:mod:`disttrain.parallel.families`: each names the format its library loads).

To give an HF export its config without ``--config``, save it with the checkpoint:
``fabric.save(path, {"model": model, "optimizer": opt, "hf_config": model.config.to_dict()})``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from disttrain.parallel.checkpoint.io import full_model_state, select_prefix
from disttrain.parallel.families import export_formats

FORMATS = tuple(export_formats())


def export_checkpoint(checkpoint: str | os.PathLike, to: str, output: str | os.PathLike, key: Optional[str] = None,
                      prefix: str = "", config: str | os.PathLike | Mapping[str, Any] | None = None) -> Path:
    """Write the model of ``checkpoint`` as ``to``: "hf" (a directory: config.json + model.safetensors), "timm" (a
    state dict file, .safetensors or .pth by its suffix, for ``timm.models.load_checkpoint``), "torch" (a
    ``torch.save`` state dict for ``model.load_state_dict(torch.load(OUT, weights_only=True))``) or "safetensors".

    ``key``/``prefix`` pick the model's entry and submodule (Trainer checkpoints: key="state_dict",
    prefix="model."). ``config`` (hf only): a config.json, a directory holding one, or a dict; by default the
    ``hf_config`` entry saved in the checkpoint.
    """
    formats = export_formats()
    if to not in formats:
        raise ValueError(f"--to {to!r} is not an export format; choose one of {', '.join(formats)}")
    state = select_prefix(full_model_state(checkpoint, key), prefix)
    return formats[to].write(state, Path(output), Path(checkpoint), config)
