"""A kill between the two renames of a same-path save (one process). Usage: crash_swap.py OUT CKPT

Saves CKPT (step 1), then saves CKPT again (step 2) and is killed with SIGKILL at the moment the finished
``.CKPT.tmp`` is about to be renamed to CKPT, after the old CKPT became ``.CKPT.old``: the parent finds only those two.
"""

import os
import signal
import sys
from pathlib import Path

import torch

from disttrain.parallel.checkpoint.io import model_state, optimizer_state, save_sharded

path = Path(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
real_rename = Path.rename


def rename_then_die(self: Path, target):  # the kill lands between path -> .old and .tmp -> path
    if self.name == f".{path.name}.tmp" and Path(target) == path:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(self, target)


for step in (1, 2):
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 2:
        Path.rename = rename_then_die
    save_sharded(path, {"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}, {"step": step})
