"""``DialogueLM``: chat SFT of a Llama-family causal LM (transformers) as a LightningModule, for the Trainer and
for Fabric, under every disttrain strategy.

The pipeline-parallel contract (DESIGN.md): the HF model lives in ``self.model`` and the steps call
``self.model(input_ids=..., labels=..., position_ids=...)`` and use its ``.loss`` (labels are -100 outside the
assistant turns); the loss is never computed outside the model.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from pathlib import Path
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import nn

from disttrain.config import Recipe, Schema
from disttrain.nlp.data import loss_tokens
from disttrain.parallel.families.llama import LLAMA
from disttrain.parallel.split.lora import LORA_KEYS, LoraSettings, add_lora, init_adapters

ConfigSource = Union[str, os.PathLike, dict, None]


# The keys of the data: and train: sections, as the dialogue recipe and DialogueData read them.
DATA_KEYS = ("train", "tokenizer", "seq_len", "val_fraction", "seed", "demo_topics")
TRAIN_KEYS = ("micro_batch_size", "global_batch_size", "lr", "weight_decay", "warmup_steps", "steps", "eval_every",
              "precision", "prompt", "prompts", "sampling", "async_checkpoint", "activation_checkpointing")


def recipe_schema() -> Schema:
    """What a dialogue recipe YAML may hold (see :mod:`disttrain.config`)."""
    from disttrain.nlp.replies import SAMPLING_KEYS

    train = {**dict.fromkeys(TRAIN_KEYS), "sampling": dict.fromkeys(SAMPLING_KEYS)}
    return {"model": LLAMA.config_schema({}), "data": dict.fromkeys(DATA_KEYS), "train": train,
            "lora": dict.fromkeys(LORA_KEYS)}


# model: holds the arguments of the HF config class its model_type names (LlamaConfig without one), e.g.
# model_type: qwen2_moe with num_experts (configs/nlp/dialogue_moe_tiny.yaml).
DIALOGUE_RECIPE = Recipe("dialogue", "configs/nlp/dialogue_tiny.yaml", recipe_schema, model_schema=LLAMA.config_schema)


def read_recipe_config(path: str | os.PathLike) -> dict[str, Any]:
    """A recipe YAML (``model:``, ``data:``, ``train:`` sections) as a dict; one clear error if it is not one or
    holds an unknown key (with the closest valid key)."""
    return DIALOGUE_RECIPE.read(path)


def llama_config(source: ConfigSource, **overrides: Any) -> Any:
    """The HF config of a recipe YAML path or its ``model:`` dict (a ``LlamaConfig``, or the class its
    ``model_type`` names, e.g. ``qwen2_moe``), or of a local pretrained folder."""
    from transformers import AutoConfig

    if source is None:
        raise ValueError("pass config= (a YAML path or a dict of LlamaConfig arguments) or pretrained= (a folder)")
    if not isinstance(source, dict) and Path(source).is_dir():
        return AutoConfig.from_pretrained(str(source), **overrides)
    settings = {**DIALOGUE_RECIPE.model(source), **overrides}
    return AutoConfig.for_model(settings.pop("model_type", None) or "llama", **settings)


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    """A causal LM of ``config`` with random weights, created on the current device context (``torch.device
    ("meta")`` for a big config: nothing is allocated until a strategy shards and initialises it)."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def count_parameters(config: Any) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (allocates nothing)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config, "eager").parameters())


class DialogueLM(L.LightningModule):
    """Chat supervised fine-tuning of a causal LM (Llama by default; any HF family).

    Pass ``config=`` (a recipe YAML such as ``configs/nlp/dialogue_1b.yaml``, or a dict of ``LlamaConfig``
    arguments, or of the HF config class its ``model_type`` names) for a model with fresh weights, or ``pretrained=``
    (a local Hugging Face folder of any causal-LM family) to fine-tune one (or ``config=`` that folder's config,
    and ``load_pretrained`` after set-up, as the dialogue recipe does). The model is built in
    ``configure_model``, so under ``disttrain_fsdp(empty_init=True)``, ``disttrain_zero3`` or
    ``fabric.init_module(empty_init=True)`` it is created on the meta device / partitioned and no rank ever holds it
    whole. Under a disttrain strategy a pretrained folder is then read sharded at the start of fitting (each rank
    reads only its own slices of the safetensors files: ``strategy.load_pretrained``); under another strategy it is
    loaded whole on every rank, then sharded. ``lora=`` (a recipe's ``lora:`` section, e.g. ``{"rank": 8}``) trains
    LoRA adapters (peft) on the frozen pretrained model: only they are in the optimizer
    (:mod:`disttrain.parallel.split.lora`).

    Batches are ``{"input_ids", "labels", "position_ids"}`` of packed dialogues (``disttrain.nlp.data``).
    Logs ``train/loss`` per step and, after each validation, ``val/loss`` and ``val/ppl`` (token-weighted over
    every rank). ``lr``, ``weight_decay``, ``warmup_steps`` and ``max_steps`` set AdamW with linear warm-up and
    cosine decay (to 10% of ``lr``; constant after warm-up when ``max_steps`` is None).
    """

    def __init__(self, config: ConfigSource = None, pretrained: Optional[str] = None, lr: float = 3e-4,
                 weight_decay: float = 0.1, warmup_steps: int = 0, max_steps: Optional[int] = None,
                 attn_implementation: str = "sdpa", lora: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        if (config is None) == (pretrained is None):
            raise ValueError("pass exactly one of config= (YAML path or dict) and pretrained= (a local folder)")
        if pretrained is not None and not Path(pretrained).is_dir():
            raise FileNotFoundError(f"pretrained={pretrained!r} is not a folder; pass a local Hugging Face model"
                                    " folder (config.json + weights); nothing is downloaded")
        if isinstance(config, os.PathLike):
            config = str(config)  # checkpoints are read with weights_only=True: plain types only
        self.save_hyperparameters()
        self.config = llama_config(pretrained if pretrained is not None else config)
        self.pretrained = pretrained
        self.lora = LoraSettings.from_dict(lora) if lora else None
        self._pretrained_loaded = False
        self.model: Optional[nn.Module] = None
        self._val_loss_sum = torch.zeros(())
        self._val_tokens = torch.zeros(())

    # -- model ----------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        attn = self.hparams.attn_implementation
        if self.pretrained is None or self._loads_sharded():
            # A pretrained folder's weights follow in on_fit_start and fill every parameter: none is initialised
            # before (under deepspeed.zero.Init that would gather each module whole in turn).
            from transformers.initialization import no_init_weights

            with no_init_weights() if self.pretrained is not None else nullcontext():
                self.model = build_model(self.config, attn)
            self.model.tie_weights()  # as post_init does when it initialises (skipped above for a folder)
        else:
            from transformers import AutoModelForCausalLM

            # Real weights: leave any meta-device context the strategy opened, load, then let it shard.
            with torch.device("cpu"):
                self.model = AutoModelForCausalLM.from_pretrained(self.pretrained, attn_implementation=attn)
        if self.lora is not None and self.lora.enabled:
            self.model = add_lora(self.model, self.lora)  # sharded with the model; first values after set-up

    def _loads_sharded(self) -> bool:
        """Whether the Trainer's strategy reads a pretrained folder into its shards (the disttrain strategies)."""
        trainer = self._trainer
        return trainer is not None and hasattr(trainer.strategy, "load_pretrained")

    def on_fit_start(self) -> None:
        if self.pretrained is not None and self._loads_sharded() and not self._pretrained_loaded:
            strategy = self.trainer.strategy
            self.load_pretrained(self.pretrained,
                                 lambda folder, partial: strategy.load_pretrained(folder, "model.", partial))

    def load_pretrained(self, folder: str | os.PathLike, load: Callable[[str, bool], Any]) -> None:
        """Collective, after set-up: a pretrained folder read sharded into the model, then the LoRA adapters' first
        values (:mod:`disttrain.parallel.split.lora`). ``load(folder, partial)``: the strategy's ``load_pretrained`` at this
        module's ``model.`` prefix."""
        load(str(folder), False)
        if self.lora is not None and self.lora.enabled:
            init_adapters(self.model, self.lora.seed, lambda folder: load(folder, True))
        self._pretrained_loaded = True

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # No attention_mask: transformers then reads the restarting position_ids as packed dialogues and keeps
        # them from attending to each other (block-diagonal causal mask; varlen kernels with flash-attn).
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                          use_cache=False).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._forward(batch)
        if self._fabric is None:
            self.log("train/loss", loss, prog_bar=True, sync_dist=False)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._forward(batch)
        tokens = loss_tokens(batch)
        # The model's loss is a mean over this batch's loss tokens; weigh it back to a sum so that held-out loss
        # is the mean over all held-out tokens, however they fall into batches and ranks. A batch of padding rows
        # only (HeldOutRows) has no loss token, and the model's mean over none is NaN: it adds nothing.
        weighted = torch.where(tokens > 0, loss.detach().float() * tokens, torch.zeros((), device=loss.device))
        self._val_loss_sum = self._val_loss_sum.to(loss.device) + weighted
        self._val_tokens = self._val_tokens.to(loss.device) + tokens
        return loss

    def on_validation_epoch_start(self) -> None:
        self.reset_validation()

    def reset_validation(self) -> None:
        self._val_loss_sum, self._val_tokens = torch.zeros(()), torch.zeros(())

    def validation_metrics(self) -> dict[str, float]:
        """Held-out loss and perplexity over every rank's validation batches so far (collective)."""
        both = torch.stack([self._val_loss_sum.float().cpu(), self._val_tokens.float().cpu()]).to(self.device)
        if self._fabric is not None:
            both = self._fabric.all_reduce(both, reduce_op="sum")
        else:
            both = self.trainer.strategy.reduce(both, reduce_op="sum")
        loss = (both[0] / both[1].clamp(min=1)).item()
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}

    def on_validation_epoch_end(self) -> None:
        metrics = self.validation_metrics()
        self.last_validation = metrics
        self.log_dict(metrics, prog_bar=True, sync_dist=True)  # equal on every rank already; no warning

    # -- optimizer ------------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                # Norm weights and biases are not decayed (the usual LLM recipe).
                (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        # An empty group (LoRA adapters are all matrices: nothing undecayed) is left out: torch's loader of a
        # flattened optimizer state (a checkpoint's) fails on one.
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, hp.warmup_steps,
                                                                                        hp.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- data position (resumable mid-epoch under the Trainer) ----------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Counted at the start: Lightning's ModelCheckpoint saves in on_train_batch_end *before* the module's own
        # on_train_batch_end runs, and its checkpoint must already count the batch it was taken after.
        sampler = getattr(self.trainer.datamodule, "train_sampler", None) if self._fabric is None else None
        if sampler is not None:
            sampler.advance(batch["input_ids"].shape[0])


def lr_factor(step: int, warmup_steps: int, max_steps: Optional[int]) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to 0.1 at ``max_steps`` (constant if None)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not max_steps or max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
