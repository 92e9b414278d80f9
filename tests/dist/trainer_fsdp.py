"""Trainer + disttrain_fsdp on 2 CPU processes: losses, per-rank memory, save at step 3 and resume, export."""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import disttrain
from disttrain.parallel import rank_state_bytes
from disttrain.parallel import unsharded_param_bytes

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, LlamaModule, loader, probe_input, tmpdir, write_result  # noqa: E402


class Memory(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            module.memory = rank_state_bytes(module, trainer.optimizers[0])
            module.unsharded = unsharded_param_bytes(module)


def trainer(max_steps, **kw):
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "trainer"), max_steps=max_steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


spec = sys.argv[2] if len(sys.argv) > 2 else "disttrain_fsdp"
ckpt_dir = os.path.join(tmpdir(), "ckpts")
# Epoch 0 is 3 steps: the epoch-end checkpoint is the state after step 3.
saver = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
full = LlamaModule()
t = trainer(5, callbacks=[Memory(), saver], enable_checkpointing=True)
t.fit(full, loader())
ckpt = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")

resumed = LlamaModule(step_indexed=True)
t2 = trainer(5)
t2.fit(resumed, loader(), ckpt_path=ckpt)

export = os.path.join(tmpdir(), "export.safetensors")
t.strategy.export_full(export, prefix="model.")
with torch.no_grad():
    logits = full(probe_input())
val_loss = t.validate(full, loader(), verbose=False)[0]["val_loss"]

write_result({
    "losses": full.losses, "tokens": full.first_tokens, "resumed_tokens": resumed.first_tokens, "resumed_losses": resumed.losses, "memory": full.memory,
    "unsharded": full.unsharded, "logits": logits.tolist(), "export": export,
    "global_step": t2.global_step, "val_loss": val_loss, "ckpt_dir": ckpt_dir, "checkpoint_files": sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else [],
})
