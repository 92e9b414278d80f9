"""Trainer runs resumed from checkpoints other strategies wrote (2 CPU processes, one launch).
Usage: trainer_resume.py OUT SPEC CKPT [SPEC CKPT ...]

For each pair a fresh LlamaModule (step-indexed data, so the steps after the resume see the same batches as the
run that saved) resumes from CKPT under SPEC and trains to step 5; rank 0 writes each run's losses."""

import os
import sys

import lightning as L

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, loader, strategy_from_spec, write_result  # noqa: E402

runs = []
for spec, ckpt in zip(sys.argv[2::2], sys.argv[3::2]):
    module = LlamaModule(step_indexed=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "trainer"), max_steps=5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader(), ckpt_path=ckpt)
    runs.append({"spec": spec, "losses": module.losses, "global_step": trainer.global_step})
write_result({"runs": runs})
