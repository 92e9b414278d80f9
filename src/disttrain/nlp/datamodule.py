"""``DialogueData``: the chat data pipeline as a LightningDataModule for the Trainer (Fabric recipes use the
functions of ``disttrain.nlp.data`` directly)."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
from torch.utils.data import DataLoader

from disttrain.nlp.data import HeldOutRows, ResumableSampler, build_datasets, collate, load_tokenizer, read_jsonl

class DialogueData(L.LightningDataModule):
    """Chat JSONL -> packed, assistant-masked rows; a resumable distributed sampler for training.

    Pass ``train=`` (JSONL) and ``tokenizer=`` (a local HF tokenizer folder); ``None`` for both uses the demo
    corpus and tokenizer (built under ``demo_root`` on first use). Use with ``Trainer(use_distributed_sampler=
    False)``: the module builds its own sampler, whose position is saved in checkpoints (``state_dict``), so a
    resumed run continues with the next unseen batch.
    """

    def __init__(self, train: Optional[str] = None, tokenizer: Optional[str] = None, seq_len: int = 256,
                 micro_batch_size: int = 8, val_fraction: float = 0.05, seed: int = 0,
                 skip_bad_lines: bool = False, demo_root: Optional[str] = None) -> None:
        super().__init__()
        self.paths = (train, tokenizer)
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.val_fraction, self.seed, self.skip_bad_lines = val_fraction, seed, skip_bad_lines
        self.demo_root = demo_root
        self.train_sampler: Optional[ResumableSampler] = None
        self._pending_state: Optional[dict] = None

    def prepare_data(self) -> None:
        self._resolve_paths()  # rank 0 of each node builds the demo data; setup() on every rank reads it

    def _resolve_paths(self) -> tuple[str, str]:
        train, tokenizer = self.paths
        if train is None or tokenizer is None:
            from disttrain.nlp.corpus import DEFAULT_DEMO_ROOT, demo_data

            demo_jsonl, demo_tok = demo_data(self.demo_root or DEFAULT_DEMO_ROOT)
            train, tokenizer = train or str(demo_jsonl), tokenizer or str(demo_tok)
        return str(train), str(tokenizer)

    def setup(self, stage: str) -> None:
        if hasattr(self, "train_set"):
            return
        train, tokenizer = self._resolve_paths()
        self.tokenizer = load_tokenizer(tokenizer)
        dialogues, self.bad_lines = read_jsonl(train, self.skip_bad_lines)
        self.train_set, self.val_set, self.stats = build_datasets(self.tokenizer, dialogues, self.seq_len,
                                                                  self.val_fraction, self.seed)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.trainer is not None else None
        kwargs = kwargs or {"num_replicas": 1, "rank": 0}
        self.train_sampler = ResumableSampler(self.train_set, seed=self.seed, **kwargs)
        self.val_rows = HeldOutRows(self.val_set, kwargs["num_replicas"])
        self.val_sampler = ResumableSampler(self.val_rows, shuffle=False, **kwargs)
        if self._pending_state is not None:
            self.train_sampler.load_state_dict(self._pending_state)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.micro_batch_size, sampler=self.train_sampler,
                          collate_fn=collate, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_rows, batch_size=self.micro_batch_size, sampler=self.val_sampler,
                          collate_fn=collate)

    def state_dict(self) -> dict[str, Any]:
        return {"train_sampler": self.train_sampler.state_dict()} if self.train_sampler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "train_sampler" in state:
            if self.train_sampler is None:
                self._pending_state = state["train_sampler"]
            else:
                self.train_sampler.load_state_dict(state["train_sampler"])

