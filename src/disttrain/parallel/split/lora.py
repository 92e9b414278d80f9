"""LoRA adapters (peft) trained under every disttrain strategy: the base model frozen, only the adapters in the
optimizer, checkpoints and resumes as usual (the adapters are parameters like any other), export as peft's own
adapter folder or as the merged model.

peft injects its LoRA layers into the Hugging Face model in place (``inject_adapter_in_model``): the model keeps
its class, so every strategy's blocks, TP plans and pipeline stages find it as before, and a wrapped layer's weight
moves to ``<layer>.base_layer.weight`` (:func:`disttrain.parallel.checkpoint.pretrained.stored_name` maps it back when a
pretrained folder is loaded). Adapters are added where the model is built (inside the strategy's init context, so
they are sharded with it) and given their first values after set-up, through the same sharded load as a pretrained
folder (:func:`initial_adapters`: A as peft draws it, from a seed every rank shares; B zero): under FSDP's meta-
device init or ZeRO-3's partitioned init the model's own initialisation reaches the adapters too, and would give B
random values.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from disttrain.parallel.checkpoint.pretrained import is_adapter

ADAPTER = "default"  # peft's adapter name: parameters are <layer>.lora_A.default.weight
LORA_KEYS = ("rank", "alpha", "dropout", "target_modules", "seed")  # a recipe's lora: section


@dataclass(frozen=True)
class LoraSettings:
    """A recipe's ``lora:`` section (or ``--lora-rank``).

    rank: the adapters' rank r (0: no adapters, the whole model trains).
    alpha: the scale numerator (the update is ``alpha / rank * B @ A``); default ``2 * rank``.
    dropout: dropout on the adapters' input.
    target_modules: the layers that get adapters: ``"all-linear"`` (every Linear but the output head) or a list of
        layer names (``["q_proj", "v_proj"]``), as peft's ``LoraConfig`` takes them.
    seed: the adapters' first values (A) are drawn from it, the same on every rank and under every strategy.
    """

    rank: int = 0
    alpha: Optional[float] = None
    dropout: float = 0.0
    target_modules: Any = "all-linear"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora rank={self.rank!r} is not a rank; pass a positive integer such as 8 (0: no LoRA)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout={self.dropout!r} is not a probability in [0, 1)")
        if not (isinstance(self.target_modules, str) or (isinstance(self.target_modules, (list, tuple))
                                                         and all(isinstance(m, str) for m in self.target_modules))):
            raise ValueError(f"lora target_modules={self.target_modules!r}: pass 'all-linear' or a list of layer"
                             " names such as [q_proj, v_proj]")

    @classmethod
    def from_dict(cls, section: Optional[Mapping[str, Any]], where: str = "lora") -> "LoraSettings":
        """From a YAML section; an unknown key is one error listing the known ones."""
        section = dict(section or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
        if isinstance(section.get("target_modules"), list):
            section["target_modules"] = tuple(section["target_modules"])
        return cls(**section)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def lora_alpha(self) -> float:
        """``alpha``, or its default ``2 * rank``."""
        return self.alpha if self.alpha is not None else 2 * self.rank

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.rank

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.lora_alpha,
                          lora_dropout=self.dropout, target_modules=targets, bias="none")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target_modules"] = (self.target_modules if isinstance(self.target_modules, str)
                                 else list(self.target_modules))
        return out


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """peft's LoRA layers injected into ``model`` (a Hugging Face model) in place; every other parameter frozen.
    Call where the model is built (``configure_model`` / ``fabric.init_module``), before the strategy sets it up."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if not any(is_adapter(name) for name, _ in model.named_parameters()):
        raise ValueError(f"lora target_modules={settings.target_modules!r} matches no layer of"
                         f" {type(model).__name__}; name its Linear layers (e.g. [q_proj, v_proj])")
    return model


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape, also when ZeRO-3 partitioned it (``ds_shape``) or it is a DTensor shard."""
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' first values by parameter name, as peft draws them (A: Kaiming-uniform with a = sqrt(5), as
    ``nn.Linear``; B: zero), from ``seed`` in name order: the same on every rank whatever the sharding."""
    generator = torch.Generator().manual_seed(seed)
    values: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if not is_adapter(name):
            continue
        value = torch.zeros(_full_shape(param), dtype=torch.float32)
        if ".lora_A." in name or ".lora_embedding_B." in name:
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        values[name] = value
    return values


def init_adapters(model: nn.Module, seed: int, load: Callable[[str], Any]) -> int:
    """Collective, after set-up: the adapters' first values (:func:`initial_adapters`) into their shards.
    ``load(folder)`` is the strategy's partial sharded load (``strategy.load_pretrained(..., partial=True)``): each
    rank writes the (small) adapter values to its own temporary folder and reads its slices back. Returns the number
    of adapter parameters set."""
    from safetensors.torch import save_file

    values = initial_adapters(model, seed)
    with tempfile.TemporaryDirectory(prefix="disttrain-lora-") as folder:
        save_file(values, os.path.join(folder, "model.safetensors"))
        load(folder)
    return len(values)


def trainable_summary(model: nn.Module) -> str:
    """``"LoRA: 1.2M trainable of 271M parameters (0.45%)"`` (counted on whole shapes, whatever the sharding)."""
    total = trained = 0
    for param in model.parameters():
        n = math.prod(_full_shape(param))
        total += n
        trained += n if param.requires_grad else 0
    return f"LoRA: {trained / 1e6:.2f}M trainable of {total / 1e6:.1f}M parameters ({100 * trained / max(total, 1):.2f}%)"


# -- export -----------------------------------------------------------------------------------------------------
def adapter_layers(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per LoRA-wrapped layer (its path in ``model``): the scale and whether its weight is stored transposed
    (GPT-2's Conv1D: ``fan_in_fan_out``), what merging needs."""
    from peft.tuners.lora import LoraLayer

    return {name: {"scaling": float(layer.scaling[ADAPTER]), "fan_in_fan_out": bool(getattr(layer, "fan_in_fan_out", False))}
            for name, layer in model.named_modules() if isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A}


def split_export(full: Mapping[str, torch.Tensor], layers: Mapping[str, Mapping[str, Any]],
                 merge: bool) -> dict[str, torch.Tensor]:
    """From a LoRA model's full state (``<layer>.base_layer.weight``, ``<layer>.lora_A.default.weight``, ...):
    the merged model's state under the base model's names (``W + scaling * B @ A``) when ``merge``, else the
    adapters under the names of peft's ``adapter_model.safetensors`` (``base_model.model.<layer>.lora_A.weight``)."""
    if not merge:
        return {f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": v for k, v in full.items() if is_adapter(k)}
    merged = {k.replace(".base_layer.", "."): v for k, v in full.items() if not is_adapter(k)}
    for layer, info in layers.items():
        a, b = full[f"{layer}.lora_A.{ADAPTER}.weight"], full[f"{layer}.lora_B.{ADAPTER}.weight"]
        delta = (b.float() @ a.float()) * info["scaling"]
        weight = merged[f"{layer}.weight"]
        merged[f"{layer}.weight"] = (weight.float() + (delta.T if info["fan_in_fan_out"] else delta)).to(weight.dtype)
    return merged


def write_adapter(path: str | os.PathLike, adapters: Mapping[str, torch.Tensor], settings: LoraSettings,
                  base_model: str | None = None, tokenizer: Any = None) -> Path:
    """peft's adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``, and the ``tokenizer`` when
    given) that ``PeftModel.from_pretrained(base, path)`` loads; written into a temporary folder and swapped in as
    checkpoints are (an older folder is removed only after the new one is in place). One process writes it."""
    from safetensors.torch import save_file

    from disttrain.parallel.checkpoint.io import _replace_atomically, recover_interrupted_save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(path)  # a swap killed half-way: the older folder comes back first
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.exists():  # an unfinished earlier write
        shutil.rmtree(tmp)
    tmp.mkdir()
    config = settings.peft_config()
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(tmp))
    save_file({k: v.detach().cpu().contiguous() for k, v in adapters.items()}, str(tmp / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    _replace_atomically(tmp, path)
    return path


__all__ = ["ADAPTER", "LORA_KEYS", "LoraSettings", "add_lora", "adapter_layers", "init_adapters", "initial_adapters",
           "split_export", "trainable_summary", "write_adapter"]
