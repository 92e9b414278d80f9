"""Chat SFT data: JSONL dialogues -> chat-template tokens with assistant-only labels -> packed sequences, and a
distributed sampler whose position can be saved and resumed mid-epoch.

A line of the JSONL is ``{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", ...}, ...]}``.
Several dialogues are packed into one row of ``seq_len`` tokens; ``position_ids`` restart at 0 for each dialogue.
transformers (5.x) reads restarting position ids as packed sequences and builds a block-diagonal causal mask for
eager and SDPA attention, and varlen kernels for flash_attention_2, as long as no ``attention_mask`` is passed:
packed dialogues never attend to each other (``tests/test_dialogue.py`` proves it on the loss).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

IGNORE_INDEX = -100  # labels HF's causal-LM loss skips
ROLES = ("system", "user", "assistant")

# Used when a tokenizer has no chat template. The end-of-sequence token closes every turn, so an assistant turn's
# labels teach the model to stop, and generate() stops at eos.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

Dialogue = list[dict[str, str]]


class DataError(ValueError):
    """A dialogue file or line that cannot be used; the message names the file and line."""


def _check_dialogue(record: Any) -> Dialogue:
    """The messages of one parsed line, or a ``ValueError`` saying what is wrong with it."""
    if not isinstance(record, dict) or "messages" not in record:
        raise ValueError('expected an object {"messages": [...]}')
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'message {i} must be {{"role": str, "content": str}}, got {json.dumps(m)[:80]}')
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message: nothing to learn from this dialogue")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_jsonl(path: str | os.PathLike, skip_bad_lines: bool = False) -> tuple[list[Dialogue], int]:
    """Dialogues of a JSONL file and the number of bad lines skipped. A bad line raises ``DataError`` naming the
    file and line, unless ``skip_bad_lines`` (then it is counted). Blank lines are ignored."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dialogue file {str(path)!r} does not exist; pass a JSONL file with one "
                        '{"messages": [...]} per line')
    dialogues, bad = [], 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                dialogues.append(_check_dialogue(json.loads(line)))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                if not skip_bad_lines:
                    raise DataError(f"{path}:{lineno}: bad dialogue line ({e}); fix the line or pass "
                                    "--skip-bad-lines (skip_bad_lines=True) to skip and count bad lines") from None
                bad += 1
    if not dialogues:
        raise DataError(f"{path} holds no usable dialogue ({bad} bad lines)")
    return dialogues, bad


def ensure_chat_template(tokenizer: Any) -> Any:
    """Give ``tokenizer`` the default chat template (and a pad token) if it has none; returns it."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_dialogue(tokenizer: Any, messages: Dialogue) -> tuple[list[int], list[int]]:
    """Token ids of the rendered dialogue and labels that keep only the assistant turns (content and the
    end-of-turn tokens the template adds); every other label is ``IGNORE_INDEX``. One dialogue of
    :func:`encode_dialogues`."""
    return encode_dialogues(tokenizer, [messages])[0]


def encode_dialogues(tokenizer: Any, dialogues: Sequence[Dialogue]) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of each dialogue, as :func:`encode_dialogue` gives them.

    Assistant spans are found in characters: the text of ``messages[:i]`` with the generation prompt is a prefix of
    the text of ``messages[:i+1]``, and what the latter adds is assistant turn i. Tokens starting inside such a
    span are labelled. This works for any template that renders a dialogue as a growing prefix.

    The texts are rendered and tokenized in batches, and a turn that ends its dialogue takes the dialogue's own
    text as its end: half the time of one call per text (a corpus is encoded by every rank at each start).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"{type(tokenizer).__name__} is a slow tokenizer; assistant masks need character offsets:"
                        " load the tokenizer with AutoTokenizer.from_pretrained(path, use_fast=True)")

    def render(conversations: list[Dialogue], prompt: bool) -> list[str]:
        if not conversations:
            return []
        return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=prompt)

    texts = render(list(dialogues), False)
    turns = [(d, i) for d, messages in enumerate(dialogues) for i, m in enumerate(messages) if m["role"] == "assistant"]
    befores = render([dialogues[d][:i] for d, i in turns], True)
    inner = [(d, i) for d, i in turns if i + 1 < len(dialogues[d])]
    afters = dict(zip(inner, render([dialogues[d][:i + 1] for d, i in inner], False)))
    spans: list[list[tuple[int, int]]] = [[] for _ in dialogues]
    for (d, i), before in zip(turns, befores):
        after = afters.get((d, i), texts[d])
        if not (after.startswith(before) and texts[d].startswith(after)):
            raise ValueError("the chat template does not render a dialogue as a growing prefix (turn "
                             f"{i} changes earlier text); use a template without look-ahead, or the default one")
        spans[d].append((len(before), len(after)))
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    encoded = []
    for ids, offsets, assistant in zip(enc["input_ids"], enc["offset_mapping"], spans):
        labels = [t if any(a <= start < b for a, b in assistant) else IGNORE_INDEX
                  for t, (start, _) in zip(ids, offsets)]
        encoded.append((list(ids), labels))
    return encoded


@dataclass
class Packed:
    """Packed rows, each ``(N, seq_len)``: ``input_ids``, ``labels`` (assistant tokens or -100) and
    ``position_ids`` (restarting at 0 for each dialogue and for the padding at a row's end)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def pack(examples: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Packed:
    """Greedy packing, in order: dialogues are appended to a row while they fit; a dialogue longer than
    ``seq_len`` is cut to ``seq_len``. The first label of every dialogue is -100, so no dialogue learns to predict
    the start of the next one (HF shifts labels by one inside the loss)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be at least 2")
    rows: list[tuple[list[int], list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def flush() -> None:
        pad = seq_len - len(ids)
        rows.append((ids + [pad_id] * pad, labels + [IGNORE_INDEX] * pad, positions + list(range(pad))))

    for example_ids, example_labels in examples:
        example_ids, example_labels = example_ids[:seq_len], example_labels[:seq_len]
        if len(ids) + len(example_ids) > seq_len:
            flush()
            ids, labels, positions = [], [], []
        ids += example_ids
        labels += [IGNORE_INDEX] + example_labels[1:]
        positions += list(range(len(example_ids)))
    if ids:
        flush()
    t = torch.tensor(rows, dtype=torch.long)  # (N, 3, seq_len)
    return Packed(t[:, 0].contiguous(), t[:, 1].contiguous(), t[:, 2].contiguous())


class PackedDialogues(Dataset):
    """A map-style dataset of packed rows; an item is ``{"input_ids", "labels", "position_ids"}``."""

    def __init__(self, packed: Packed) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        p = self.packed
        return {"input_ids": p.input_ids[i], "labels": p.labels[i], "position_ids": p.position_ids[i]}


def split_dialogues(dialogues: list[Dialogue], val_fraction: float, seed: int) -> tuple[list[Dialogue],
                                                                                    list[Dialogue]]:
    """A seeded shuffle, then the first ``val_fraction`` (at least one dialogue) held out."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if len(dialogues) < 2:
        raise ValueError(f"{len(dialogues)} dialogue(s): need at least 2 to hold one out")
    order = list(range(len(dialogues)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(val_fraction * len(dialogues)))
    return [dialogues[i] for i in order[n_val:]], [dialogues[i] for i in order[:n_val]]


def build_datasets(tokenizer: Any, dialogues: list[Dialogue], seq_len: int, val_fraction: float = 0.05,
                   seed: int = 0) -> tuple[PackedDialogues, PackedDialogues, dict[str, int]]:
    """Split, encode and pack: (train, held-out, stats). Dialogues whose assistant tokens all fall beyond
    ``seq_len`` are dropped and counted."""
    ensure_chat_template(tokenizer)
    train, val = split_dialogues(dialogues, val_fraction, seed)
    stats = {"dialogues": len(dialogues), "too_long": 0}
    out = []
    for part in (train, val):
        examples = []
        for ids, labels in encode_dialogues(tokenizer, part):
            if all(label == IGNORE_INDEX for label in labels[1:seq_len]):
                stats["too_long"] += 1
                continue
            examples.append((ids, labels))
        out.append(PackedDialogues(pack(examples, seq_len, tokenizer.pad_token_id)))
    if len(out[0]) == 0 or len(out[1]) == 0:
        raise DataError(f"no dialogue fits in seq_len={seq_len}; raise seq_len")
    stats.update(train_rows=len(out[0]), val_rows=len(out[1]),
                 train_tokens=int((out[0].packed.labels != IGNORE_INDEX).sum()))
    return out[0], out[1], stats


class HeldOutRows(Dataset):
    """Held-out rows for ``num_replicas`` data-parallel ranks, each row evaluated once over all of them: the rows
    are padded to a multiple of ``num_replicas`` with copies whose labels are all ignored, so every rank runs the same
    number of forward passes (sharded models need every rank in each one) and a padding row adds no loss token.
    (``DistributedSampler`` pads with repeated real rows instead: held-out loss would count them twice, and differ
    with the number of ranks.) Shares: ``ResumableSampler(rows, shuffle=False, ...)``."""

    def __init__(self, rows: Dataset, num_replicas: int = 1) -> None:
        self.rows = rows
        self.size = -(-len(rows) // num_replicas) * num_replicas

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < len(self.rows):
            return self.rows[i]
        row = dict(self.rows[i % len(self.rows)])
        row["labels"] = torch.full_like(row["labels"], IGNORE_INDEX)
        return row


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (seeded shuffle per epoch, one share per data-parallel rank) that can resume
    mid-epoch: ``state_dict()`` holds the epoch and how many samples of it this rank has consumed, and a resumed
    sampler starts at the next unseen sample.

    The training loop calls ``advance(n)`` after each batch it trains on (a DataLoader prefetches, so counting
    what the sampler handed out would count batches that were never trained on). ``set_epoch`` with a new epoch
    starts it from the beginning; with the current epoch (as Lightning calls it on resume) it keeps the position; an
    earlier epoch is ignored (Fabric's DataLoader wrapper counts its own epochs from 0 after a resume).
    ``len()`` is the full epoch, which Lightning's epoch loop expects.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.position:])

    def set_epoch(self, epoch: int) -> None:
        if epoch < self.epoch:
            # Fabric's DataLoader wrapper sets epochs 0, 1, ... by how often it was iterated, not by the epoch a
            # resumed run is in: going back would restart a resumed run at epoch 0 (and repeat its data).
            return
        if epoch != self.epoch:
            self.position = 0
        super().set_epoch(epoch)

    def advance(self, n: int) -> None:
        self.position += n

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_replicas": self.num_replicas,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the saved position, also with another number of data-parallel ranks: the ranks take turns
        through one seeded order of the epoch (rank r its samples r, r + N, ...), so the samples all ranks consumed
        are its first ``position x N``, whatever N was, and with the same global batch the next steps see the
        batches an unchanged run would have."""
        if state["seed"] != self.seed:
            raise ValueError(f"the data position was saved with seed {state['seed']}, this run has seed {self.seed};"
                             f" resume with data.seed {state['seed']}")
        consumed = int(state["position"]) * int(state["num_replicas"])
        if consumed % self.num_replicas:
            raise ValueError(f"the data position was saved after {consumed} samples of epoch {state['epoch']} on"
                             f" {state['num_replicas']} data-parallel rank(s), which {self.num_replicas} ranks cannot"
                             f" split evenly; resume with a number of data-parallel ranks that divides {consumed}"
                             " (the same global batch size keeps every later step's samples)")
        self.epoch, self.position = int(state["epoch"]), consumed // self.num_replicas


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A fast tokenizer from a local directory, with a chat template (the default one if it has none)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"tokenizer directory {str(path)!r} does not exist; pass a local Hugging Face tokenizer"
                        " folder (tokenizer.json ...), or leave it unset to train the demo tokenizer")
    return ensure_chat_template(AutoTokenizer.from_pretrained(str(path), use_fast=True))


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def loss_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens that carry a loss after HF's one-token shift."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


__all__ = ["DEFAULT_CHAT_TEMPLATE", "DataError", "HeldOutRows", "IGNORE_INDEX", "Packed", "PackedDialogues",
           "ResumableSampler", "build_datasets", "collate", "encode_dialogue", "encode_dialogues",
           "ensure_chat_template", "load_tokenizer", "loss_tokens", "pack", "read_jsonl", "split_dialogues"]
