"""A trained dialogue model as a Hugging Face folder (config + safetensors + tokenizer) that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load, and a greedy reply."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from disttrain.parallel.checkpoint.io import atomic_folder

WEIGHTS_NAME = "model.safetensors"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def export_hf(out: str | os.PathLike, write_weights: Callable[[Path], Any], config: Any, tokenizer: Any) -> Path:
    """Collective (every rank calls it): ``write_weights(path)`` writes the full weights of the HF model as one
    safetensors file (a strategy's ``export_full`` with ``prefix="model."``); rank 0 adds ``config.json``,
    ``generation_config.json`` and the tokenizer. The folder appears at ``out`` only when complete."""
    from transformers import GenerationConfig

    with atomic_folder(out) as tmp:
        write_weights(tmp / WEIGHTS_NAME)
        if _rank() == 0:
            config = config.__class__.from_dict(config.to_dict())  # a copy: training settings stay as they were
            config.architectures = ["LlamaForCausalLM"] if config.model_type == "llama" else config.architectures
            config.use_cache = True  # training turns the KV cache off; generation wants it
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                setattr(config, name, getattr(tokenizer, name))
            config.save_pretrained(str(tmp))
            GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id).save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
    return Path(out)


@torch.no_grad()
def greedy_reply(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 32) -> str:
    """The model's greedy answer to one user message, rendered with the tokenizer's chat template."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def load_export(folder: str | os.PathLike) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of an exported folder, in this process (CPU): an HF model folder, or a LoRA adapter
    folder (``adapter_config.json``: its base model, from the local path the adapter names, with the adapter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if not (folder / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(folder)), tokenizer
    import json

    from peft import PeftModel

    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(f"{folder}/adapter_config.json names base model {base!r}, which is not a local folder;"
                                " set base_model_name_or_path to the pretrained folder the adapter was trained on")
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder)), tokenizer


def reply_from_export(folder: str | os.PathLike, prompt: str, max_new_tokens: int = 32) -> str:
    """Load an exported folder (model or LoRA adapter) in this process (CPU) and answer ``prompt`` greedily."""
    model, tokenizer = load_export(folder)
    return greedy_reply(model, tokenizer, prompt, max_new_tokens)
