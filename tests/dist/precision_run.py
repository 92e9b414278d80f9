"""Precision callbacks on 2 CPU processes: real fp16 with an overflow step (FSDP and DDP), bf16, FP8 under FSDP.
Usage: precision_run.py OUT"""

import math
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, loader, write_result  # noqa: E402

from disttrain.callbacks import FP8, MixedPrecision  # noqa: E402


def local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


class Overflow(LlamaModule):
    """Step 2's loss is multiplied by inf: its fp16 gradients overflow and the scaler must skip that step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 1:
            self.params_before = [local(p) for p in self.parameters()]
            return loss * math.inf
        if self.global_step == 2 and not hasattr(self, "params_after"):
            self.params_after = [local(p) for p in self.parameters()]
        return loss


def fit(module, strategy, callbacks):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(module, loader())
    return trainer


result = {}
for strategy in ("disttrain_fsdp", "disttrain_ddp"):
    module, mp = Overflow(), MixedPrecision("fp16")
    trainer = fit(module, strategy, [mp])
    result[strategy] = {
        "plugin": type(trainer.strategy.precision_plugin).__name__,
        "scaler": type(trainer.strategy.precision_plugin.scaler).__name__,
        "skipped_steps": mp.skipped_steps, "loss_scale": mp.loss_scale, "losses": module.losses,
        "unchanged_by_overflow": all(torch.equal(a, b) for a, b in zip(module.params_before, module.params_after)),
        "param_dtype": str(next(module.parameters()).dtype),
    }

zero_module, zero_mp = Overflow(), MixedPrecision("fp16")
zero_trainer = fit(zero_module, "disttrain_zero3", [zero_mp])
result["disttrain_zero3"] = {"fp16": zero_trainer.strategy.config["fp16"]["enabled"],
                             "plugin": type(zero_trainer.strategy.precision_plugin).__name__,
                             "skipped_steps": zero_mp.skipped_steps, "losses": zero_module.losses}

bf16 = LlamaModule()
fit(bf16, "disttrain_fsdp", [MixedPrecision("bf16")])
fp8_module, fp8 = LlamaModule(), FP8()
fit(fp8_module, "disttrain_fsdp", [fp8])
result.update(bf16_losses=bf16.losses, fp8_losses=fp8_module.losses, fp8_converted=fp8.report.converted,
              fp8_skipped=fp8.report.skipped,
              fp8_layers=sorted({type(m).__name__ for m in fp8_module.modules() if "Linear" in type(m).__name__}))
write_result(result)
