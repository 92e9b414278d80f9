"""DialogueLM + DialogueData under lightning.Trainer with disttrain_fsdp (meta-device init) on the tiny config:
held-out loss before and after a short fit, the HF export and a greedy reply from it.
Usage: dialogue_trainer.py OUT DEMO_ROOT"""

import os
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

import disttrain  # noqa: E402
from disttrain.nlp import DialogueData, DialogueLM, export_hf, reply_from_export  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
out = Path(sys.argv[1]).parent
data = DialogueData(demo_root=sys.argv[2], seq_len=128, micro_batch_size=8)
module = DialogueLM(config=str(ROOT / "configs/nlp/dialogue_tiny.yaml"), lr=3e-3, weight_decay=0.0,
                    warmup_steps=2, max_steps=16)
trainer = L.Trainer(strategy=disttrain.strategies.FSDPStrategy(empty_init=True), accelerator="cpu", devices=2,
                    max_steps=16, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    check_val_every_n_epoch=None, val_check_interval=1000)
trainer.validate(module, datamodule=data, verbose=False)
before = module.last_validation["val/loss"]
trainer.fit(module, datamodule=data)
trainer.validate(module, datamodule=data, verbose=False)
after = module.last_validation["val/loss"]
folder = export_hf(out / "hf", lambda p: trainer.strategy.export_full(p, prefix="model."), module.config,
                   data.tokenizer)
reply = reply_from_export(folder, "Hello") if trainer.is_global_zero else ""
write_result({"before": before, "after": after, "reply_is_text": isinstance(reply, str),
              "sampler_position": data.train_sampler.position})
