"""ZeRO-3 specifics on 2 CPU processes: zero.Init partitioning, an fp16 overflow step, CPU offload.
Usage: zero3_checks.py OUT"""

import math
import os
import sys

import lightning as L
import torch
from deepspeed.comm import comm as deepspeed_comm

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, loader, write_result  # noqa: E402

from disttrain.parallel.engines.deepspeed import zero_partition_numel  # noqa: E402


def trainer(strategy, precision="32-true", **kw):
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=5,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     **kw)


class BuiltUnderZeroInit(LlamaModule):
    def configure_model(self):
        super().configure_model()
        self.at_build = zero_partition_numel(self.model)  # right after construction, inside zero.Init


class Overflow(LlamaModule):
    """Step 2's loss is multiplied by inf: its fp16 gradients overflow and DeepSpeed must skip that step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 1:
            self.scale_before = self.trainer.strategy.deepspeed_engine.optimizer.loss_scale
            self.params_before = [p.ds_tensor.detach().clone() for p in self.model.parameters()]
            return loss * math.inf
        if self.global_step == 2:
            self.params_after = [p.ds_tensor.detach().clone() for p in self.model.parameters()]
            self.scale_after = self.trainer.strategy.deepspeed_engine.optimizer.loss_scale
        return loss


partitioned = BuiltUnderZeroInit(build_in_configure=True)
trainer("disttrain_zero3").fit(partitioned, loader())

overflow = Overflow()
t16 = trainer("disttrain_zero3", precision="16-mixed")
t16.fit(overflow, loader())
engine = t16.strategy.deepspeed_engine

offloaded = LlamaModule()
t_off = trainer("disttrain_zero3_offload")
t_off.fit(offloaded, loader())
zero_cfg = t_off.strategy.config["zero_optimization"]

write_result({
    "at_build": partitioned.at_build, "after_fit": zero_partition_numel(partitioned.model),
    "fp16_losses": overflow.losses, "skipped_steps": engine.skipped_steps, "global_step": t16.global_step,
    "scale_before": overflow.scale_before, "scale_after": overflow.scale_after,
    "unchanged_by_overflow": all(torch.equal(a, b) for a, b in zip(overflow.params_before, overflow.params_after)),
    "fp16_enabled": t16.strategy.config["fp16"]["enabled"],
    "offload_losses": offloaded.losses, "offload": [zero_cfg["offload_optimizer"]["device"],
                                                    zero_cfg["offload_param"]["device"]],
    "offload_param_device": str(next(offloaded.model.parameters()).ds_tensor.device),
    "shm_comm_op": deepspeed_comm.cdb.shm_comm_op is not None,
})
