"""ViTClassifier through the Lightning Trainer + disttrain_fsdp on 2 CPU processes: losses and validation
metrics (against vision_fabric.reference()), a sharded checkpoint, and the export for timm.
Usage: vision_trainer.py OUT [STRATEGY]"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
import disttrain  # noqa: E402,F401
from common import mean_over_ranks, strategy_from_spec, tmpdir, write_result  # noqa: E402
from vision_fabric import GLOBAL_BATCH, MODEL, STEPS, batch, classifier  # noqa: E402

from disttrain.vision import ViTClassifier, export_timm  # noqa: E402
from disttrain.vision.export import PREFIX  # noqa: E402


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(mean_over_ranks(outputs["loss"]))


def loader(steps, shuffled: bool) -> DataLoader:
    """Step s's global batch is the samples at positions 8s..8s+7 of the sampler's order, and rank r takes every
    2nd one: exactly batch(s, r, 2). The Trainer shuffles training data (DistributedSampler, seed 0, epoch 0), so
    the samples are stored where that permutation will fetch them from."""
    parts = [batch(s) for s in steps]
    images, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if shuffled:
        order = torch.randperm(len(target), generator=torch.Generator().manual_seed(0))
        images[order], target[order] = images.clone(), target.clone()
    return DataLoader(TensorDataset(images, target), batch_size=GLOBAL_BATCH // 2, shuffle=shuffled)


class Classifier(ViTClassifier):  # built in configure_model, as the Trainer does, with the reference's weights
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)  # the reference's initial weights
        super().configure_model()


spec = sys.argv[2] if len(sys.argv) > 2 else "disttrain_fsdp"
vit = Classifier(MODEL, classifier(build=False).train_config, total_steps=STEPS)
losses = Losses()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "trainer"), max_steps=STEPS,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, callbacks=[losses])
trainer.fit(vit, loader(range(STEPS), shuffled=True))
metrics = trainer.validate(vit, loader([50, 51], shuffled=False), verbose=False)[0]
ckpt = os.path.join(tmpdir(), "vit-trainer-ckpt")
trainer.save_checkpoint(ckpt)
out = export_timm(os.path.join(tmpdir(), "vit-trainer-export"), MODEL,
                  lambda p: trainer.strategy.export_full(p, prefix=PREFIX))
write_result({"losses": losses.losses, "val_acc": float(metrics["val_acc"]), "val_loss": float(metrics["val_loss"]),
              "checkpoint_files": sorted(os.listdir(ckpt)), "export": str(out),
              "strategy": type(trainer.strategy).__name__})
