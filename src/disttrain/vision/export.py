"""Export a trained ViTClassifier as a folder timm loads: ``model.safetensors`` (the plain timm state dict) and
timm's ``config.json`` (architecture, model arguments, preprocessing, class names).

    model = timm.create_model("local-dir:runs/vit/export", pretrained=True)     # timm builds and loads it
    model = timm.create_model("vit_base_patch16_224", **model_args)              # or by hand:
    model.load_state_dict(safetensors.torch.load_file("runs/vit/export/model.safetensors"))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

from disttrain.parallel.checkpoint.io import _rank, atomic_folder
from disttrain.vision.config import build_vit
from disttrain.vision.data import DataConfig

WEIGHTS = "model.safetensors"
# The key prefix of the timm model inside a ViTClassifier's state dict (its attribute ``model``).
PREFIX = "model."


def export_timm(out: Union[str, os.PathLike], model_args: dict[str, Any], write_weights: Callable[[Path], Any],
                data: Optional[DataConfig] = None, class_names: Optional[list[str]] = None) -> Path:
    """Collective (every rank calls it): ``write_weights(path)`` writes the timm state dict as safetensors (a
    strategy's ``export_full(..., prefix="model.")``), rank 0 adds config.json; the folder appears atomically."""
    with atomic_folder(out) as tmp:
        write_weights(tmp / WEIGHTS)
        if _rank() == 0:
            write_timm_config(tmp / "config.json", model_args, data, class_names)
    return Path(out)


def write_timm_config(path: Path, model_args: dict[str, Any], data: Optional[DataConfig] = None,
                      class_names: Optional[list[str]] = None) -> None:
    """timm's own config.json writer, fed a meta-device model (free even at 2B). timm releases before
    ``save_config_for_hf(..., data_config=)`` read the preprocessing from the model's ``pretrained_cfg`` (and those
    before ``model_args=`` write ``model_config``'s keys at the top level, where timm's loader reads ``model_args``):
    the same config.json from either."""
    import inspect

    from timm.models._hub import save_config_for_hf

    data_config = {"crop_pct": 1.0, "interpolation": "bilinear"}
    if data is not None:
        data_config.update(mean=tuple(data.mean), std=tuple(data.std))
    model_config = {"label_names": list(class_names)} if class_names else {}
    model = build_vit(model_args, device="meta")
    accepted = inspect.signature(save_config_for_hf).parameters
    kwargs: dict[str, Any] = {}
    if "model_args" in accepted:
        kwargs["model_args"] = dict(model_args)
    else:
        model_config["model_args"] = dict(model_args)
    if "data_config" in accepted:
        kwargs["data_config"] = data_config
    else:
        model.pretrained_cfg = {**getattr(model, "pretrained_cfg", {}), **data_config}
    save_config_for_hf(model, str(path), model_config=model_config or None, **kwargs)
