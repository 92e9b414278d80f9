"""Trainer + FSDP (or DDP) options on 2 CPU processes. Usage: trainer_options.py OUT SPEC PRECISION

Builds the model in configure_model (on the meta device when the spec sets empty_init) and records what the
strategy did: meta at build time, shard sizes, checkpoint wrappers, offload, losses."""

import os
import sys

import lightning as L
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, loader, strategy_from_spec, write_result  # noqa: E402


class Inspect(LlamaModule):
    def configure_model(self):
        super().configure_model()
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())


spec, precision = sys.argv[2], sys.argv[3]
module = Inspect(build_in_configure=True)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "trainer"), max_steps=5,
                    precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(module, loader())
params = [getattr(p, "to_local", lambda p=p: p)() for p in module.parameters()]  # DTensor shards, or DDP's own
write_result({
    "losses": module.losses,
    "built_on_meta": module.built_on_meta,
    "local_numel": sum(p.numel() for p in params),
    "numel": sum(p.numel() for p in module.parameters()),
    "wrapped_blocks": sum(isinstance(m, CheckpointWrapper) for m in module.modules()),
    "param_devices": sorted({str(p.device) for p in params}),
    "param_dtype": str(params[0].dtype),
    "precision_plugin": type(trainer.strategy.precision_plugin).__name__,
    "use_cache": module.model.config.use_cache,
})
