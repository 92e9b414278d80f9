"""Crash during a checkpoint write (one process). Usage: crash_save.py OUT CKPT_DIR

Saves CKPT_DIR/step-000001 completely, then starts CKPT_DIR/step-000002 and is killed with SIGKILL right after the
tensor shards are written (before the folder is complete and swapped in): the parent checks what is left.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from common import tiny_llama  # noqa: E402

from disttrain.parallel.checkpoint.io import model_state, optimizer_state, save_sharded  # noqa: E402

ckpt_dir = Path(sys.argv[2])
model = tiny_llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ids = torch.arange(16).unsqueeze(0)
for step in (1, 2):
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 2:
        real_save = dcp.save

        def save_then_die(*args, **kwargs):  # the shards are on disk, meta.pt and the rename are not
            real_save(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.save = save_then_die
    save_sharded(ckpt_dir / f"step-{step:06d}", {"model": model_state(model),
                                                 "optimizer": optimizer_state(model, optimizer)}, {"step": step})
