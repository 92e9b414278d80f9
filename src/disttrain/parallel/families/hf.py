"""What the Hugging Face families share: recognising a model by its config's ``model_type``, the causal-LM output
the pipeline returns, and the export format ``from_pretrained`` loads (a folder: config.json + model.safetensors).

To give an HF export its config without ``--config``, save it with the checkpoint:
``fabric.save(path, {"model": model, "optimizer": opt, "hf_config": model.config.to_dict()})``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from disttrain.parallel.families.base import ExportFormat, Family

HF_CONFIG_KEY = "hf_config"


def hf_config_dict(checkpoint: str | os.PathLike, config: str | os.PathLike | Mapping[str, Any] | None) -> dict:
    """The HF config of an export: ``config`` (a config.json, a directory holding one, or a dict), else the
    ``hf_config`` entry saved with the checkpoint."""
    from disttrain.parallel.checkpoint.io import CheckpointError, read_meta

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


def write_hf(state: Mapping[str, torch.Tensor], output: Path, checkpoint: Path, config: Any) -> Path:
    """config.json + model.safetensors, written into a temporary folder and swapped in whole."""
    from transformers import AutoConfig

    from disttrain.parallel.checkpoint.io import atomic_folder, write_safetensors

    config = hf_config_dict(checkpoint, config)
    if "model_type" not in config:
        raise ValueError("the HF config has no 'model_type'; pass the config.json that the model was built from")
    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **settings)  # validates the config against its class
    with atomic_folder(output) as tmp:
        hf_config.save_pretrained(tmp)
        write_safetensors(state, tmp / "model.safetensors")
    return output


# Any HF model (of a family here or not) exports this way: ``--to hf``.
HF_EXPORT = ExportFormat("hf", write_hf)


class HFFamily(Family):
    """An HF family: its models are ``PreTrainedModel``s whose ``config.model_type`` is in ``model_types``; causal
    LMs compute their loss from ``labels``."""

    model_types: tuple[str, ...] = ()
    hf_loss = True
    export_format = HF_EXPORT

    def matches(self, model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        return self.reads_model_type(getattr(config, "model_type", None)) and self.is_whole_model(model)

    def is_whole_model(self, model: nn.Module) -> bool:
        """True for the family's models themselves (an HF ``PreTrainedModel``, base or with a head), not for their
        submodules (HF attention modules keep the config too)."""
        return hasattr(model, "base_model_prefix")

    def reads_model_type(self, model_type: Optional[str]) -> bool:
        return model_type in self.model_types

    def loss(self, model: nn.Module, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """HF's own causal-LM loss: shift by one, mean over the tokens whose label is not -100."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return model.loss_function(logits=output, labels=labels, vocab_size=config.vocab_size)

    def wrap_output(self, loss: Optional[torch.Tensor], output: Optional[torch.Tensor]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=output)
