"""DialogueLM + DialogueData under lightning.Trainer with disttrain_fsdp (meta-device init) on the tiny config:
held-out loss before and after a short fit, the HF export and a greedy reply from it, then a mid-epoch resume
from a checkpoint in a fresh Trainer that must train on the next unseen batches of the epoch.
Usage: dialogue_trainer.py OUT DEMO_ROOT"""

import os
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

import disttrain  # noqa: E402
from disttrain.nlp import DialogueData, DialogueLM, ResumableSampler, export_hf, reply_from_export  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
out = Path(sys.argv[1]).parent
STEPS, MORE, MICRO = 12, 3, 8  # an epoch is 23 batches per rank: both runs stay inside epoch 0


class Recorder(DialogueLM):
    """Keeps the first tokens of every trained batch, to see which rows a resumed run trains on."""

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.seen = getattr(self, "seen", []) + [batch["input_ids"][:, :8].tolist()]


def trainer(max_steps: int, checkpoint_every: int = 0) -> L.Trainer:
    # A checkpoint taken during training (a trainer.save_checkpoint after fit() records the epoch as finished).
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpts", filename="step{step}", save_top_k=-1,
                                                     every_n_train_steps=checkpoint_every)] if checkpoint_every else []
    return L.Trainer(strategy=disttrain.strategies.FSDPStrategy(empty_init=True), accelerator="cpu", devices=2,
                     max_steps=max_steps, use_distributed_sampler=False, logger=False,
                     enable_checkpointing=bool(checkpoint_every), callbacks=callbacks, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, check_val_every_n_epoch=None,
                     val_check_interval=1000)


def parts():
    data = DialogueData(demo_root=sys.argv[2], seq_len=128, micro_batch_size=MICRO)
    module = Recorder(config=str(ROOT / "configs/nlp/dialogue_tiny.yaml"), lr=3e-3, weight_decay=0.0,
                      warmup_steps=2, max_steps=STEPS + MORE)
    return data, module


data, module = parts()
first = trainer(STEPS, checkpoint_every=STEPS)
first.validate(module, datamodule=data, verbose=False)
before = module.last_validation["val/loss"]
first.fit(module, datamodule=data)
first.validate(module, datamodule=data, verbose=False)
after = module.last_validation["val/loss"]
(ckpt,) = sorted((out / "ckpts").glob("*.ckpt"))  # the one checkpoint, at step STEPS
folder = export_hf(out / "hf", lambda p: first.strategy.export_full(p, prefix="model."), module.config,
                   data.tokenizer)
reply = reply_from_export(folder, "Hello") if first.is_global_zero else ""

# The rows an uninterrupted epoch would give this rank after STEPS batches.
rank_kwargs = first.strategy.distributed_sampler_kwargs
order = list(ResumableSampler(data.train_set, seed=data.seed, **rank_kwargs))
expected = [data.train_set.packed.input_ids[order[i:i + MICRO], :8].tolist()
            for i in range(STEPS * MICRO, (STEPS + MORE) * MICRO, MICRO)]

data2, module2 = parts()
second = trainer(STEPS + MORE)
second.fit(module2, datamodule=data2, ckpt_path=str(ckpt))
write_result({"before": before, "after": after, "reply_is_text": isinstance(reply, str),
              "sampler_position": data.train_sampler.position, "resumed_position": data2.train_sampler.position,
              "resumed_batches": module2.seen, "expected_batches": expected,
              "first_batches_differ": module.seen[0] != expected[0]})
