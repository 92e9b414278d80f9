"""Trainer + GradientAccumulation(global_batch_size=G) on WORLD processes (micro batch 2): per-step losses.
Usage: accumulation_run.py OUT STRATEGY G [tokens]

With "tokens": the loss is the sum over loss tokens (labels masked by a per-sample prefix) and the callback
normalises by the step's token count; the per-step value is (sum of token losses) / (loss tokens)."""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, loader, masked_labels, mean_over_ranks, strategy_from_spec, write_result  # noqa: E402

from disttrain.callbacks import GradientAccumulation  # noqa: E402

TOKENS = len(sys.argv) > 4 and sys.argv[4] == "tokens"


class Recorder(LlamaModule):
    def __init__(self):
        super().__init__()
        self.per_step: dict[int, list[float]] = {}

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if not TOKENS:
            loss = self.model(input_ids=ids, labels=ids).loss
            self.per_step.setdefault(self.global_step, []).append(mean_over_ranks(loss))
            return loss
        labels = masked_labels(ids)
        logits = self.model(input_ids=ids).logits[:, :-1]
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                   ignore_index=-100, reduction="sum")
        tokens = (labels[:, 1:] != -100).sum()
        both = torch.stack([loss_sum.detach(), tokens.float()])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(both)
        self.per_step.setdefault(self.global_step, []).append(both.tolist())
        return loss_sum


def tokens_fn(batch):
    (ids,) = batch
    return int((masked_labels(ids)[:, 1:] != -100).sum())


module = Recorder()
callback = GradientAccumulation(global_batch_size=int(sys.argv[3]), normalize_by_tokens=TOKENS, tokens_fn=tokens_fn)
world = int(os.environ.get("WORLD_SIZE", "1"))
trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy_from_spec(sys.argv[2], "trainer"),
                    max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[callback])
trainer.fit(module, loader())
if TOKENS:
    losses = [sum(s for s, _ in v) / sum(t for _, t in v) for _, v in sorted(module.per_step.items())]
else:
    losses = [sum(v) / len(v) for _, v in sorted(module.per_step.items())]
write_result({"losses": losses, "accumulate_grad_batches": trainer.accumulate_grad_batches,
              "micro_steps": [len(v) for _, v in sorted(module.per_step.items())]})
