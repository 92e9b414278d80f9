"""Replies of a model to the same prompts before and after training, printed side by side.

    before = sample_replies("runs/dialogue_llm/hf_before", prompts, Sampling(seed=0))
    after = sample_replies("runs/dialogue_llm/hf", prompts, Sampling(seed=0))
    print(side_by_side(prompts, before, after, "before training", "after 120 steps"))

Both columns are drawn with the same seed and settings, so the only difference between them is the training.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from typing import Any, Optional

import torch

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens", "seed")


@dataclass(frozen=True)
class Sampling:
    """How a reply is drawn. ``temperature=0`` is greedy decoding (``top_k``/``top_p`` then unused); the repetition
    penalty (> 1) applies either way and keeps a small model from repeating one token."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0
    repetition_penalty: float = 1.3
    max_new_tokens: int = 32
    seed: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "repetition_penalty": self.repetition_penalty}
        if self.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        else:
            kwargs.update(do_sample=False)
        return kwargs


@torch.no_grad()
def sample_reply(model: Any, tokenizer: Any, prompt: str, sampling: Sampling) -> str:
    """One reply of ``model`` to one user message (rendered with the tokenizer's chat template), drawn with
    ``sampling``. The generator is reseeded per prompt: the same prompt gets the same random draws in any model."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    was_training = model.training
    model.eval()
    # fork_rng: the demo's own RNG streams (data order, dropout) stay as they were.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sampling.seed)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **sampling.generate_kwargs())
    model.train(was_training)
    return " ".join(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split())


def sample_replies(folder: str | os.PathLike, prompts: list[str], sampling: Sampling) -> list[str]:
    """Load an exported Hugging Face folder or LoRA adapter folder (CPU, this process) and answer each prompt (see :func:`sample_reply`)."""
    from transformers.utils import logging as hf_logging

    from disttrain.nlp.export import load_export

    hf_logging.disable_progress_bar()
    model, tokenizer = load_export(folder)
    return [sample_reply(model, tokenizer, p, sampling) for p in prompts]


def _cell_width(ch: str) -> int:
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1  # CJK glyphs take two terminal columns


def wrap(text: str, width: int) -> list[str]:
    """``text`` cut into lines of at most ``width`` terminal columns (CJK counts two), at spaces where possible."""
    lines, line, used = [], "", 0
    for word in text.split(" ") if text else []:
        w = sum(_cell_width(c) for c in word)
        if line and used + 1 + w <= width:
            line, used = f"{line} {word}", used + 1 + w
            continue
        if line:
            lines.append(line)
        line, used = "", 0
        for ch in word:  # a word longer than the column (or unspaced CJK) is cut where it reaches the edge
            if used + _cell_width(ch) > width:
                lines.append(line)
                line, used = "", 0
            line, used = line + ch, used + _cell_width(ch)
    if line:
        lines.append(line)
    return lines or ["(empty reply)"]


def _pad(text: str, width: int) -> str:
    return text + " " * (width - sum(_cell_width(c) for c in text))


def side_by_side(prompts: list[str], before: list[str], after: list[str], left: str = "before training",
                 right: str = "after training", width: int = 38,
                 expected: Optional[list[Optional[str]]] = None) -> str:
    """A two-column block per prompt: the ``before`` reply under ``left``, the ``after`` reply under ``right``;
    ``expected``: the reply the training data gives to each prompt (None where it has none), shown above them."""
    rule = "-" * (2 * width + 3)
    out = [f"{_pad(left, width)} | {right}", rule]
    for i, (prompt, b, a) in enumerate(zip(prompts, before, after, strict=True)):
        out.append(f"user: {prompt}")
        if expected is not None and expected[i] is not None:
            out.append(f"(the data's reply: {expected[i]})")
        lb, la = wrap(b, width), wrap(a, width)
        for j in range(max(len(lb), len(la))):
            out.append(f"{_pad(lb[j] if j < len(lb) else '', width)} | {la[j] if j < len(la) else ''}".rstrip())
        out.append(rule)
    return "\n".join(out)
