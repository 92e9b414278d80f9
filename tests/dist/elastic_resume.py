"""Fault tolerance: run under `disttrain run --max-restarts 1`. Usage: elastic_resume.py OUT CKPT_DIR STEPS KILL_AT
[PAUSE]

Checkpoints after every step into CKPT_DIR/step-NNNNNN. On the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1
kills itself with SIGKILL before step KILL_AT (0: never; the test kills what it wants); torchrun restarts every
process, and each resumes from the newest complete checkpoint. PAUSE: seconds to wait after each step (time for a
test to strike mid-run). The last attempt writes its start step and losses.
"""

import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fabric_train, tiny_llama, write_result  # noqa: E402

from disttrain.parallel.checkpoint.io import latest_checkpoint  # noqa: E402

ckpt_dir, steps, kill_at = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

fabric = L.Fabric()
if not os.environ.get("LT_CLI_USED"):
    fabric.launch()
model = tiny_llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}
latest = fabric.broadcast(latest_checkpoint(ckpt_dir))  # every rank resumes from the same folder
if latest is not None:
    fabric.load(latest, state)
start = state["step"]


def on_step(step: int) -> None:
    state["step"] = step + 1
    fabric.save(ckpt_dir / f"step-{step + 1:06d}", state)
    if attempt == 0 and step + 1 == kill_at and fabric.global_rank == 1:
        Path(f"{sys.argv[1]}.killed").touch()  # the test's proof: which rank's failure torchrun reports first is a race
        os.kill(os.getpid(), signal.SIGKILL)  # a hard crash: no exception, no cleanup
    time.sleep(pause)


losses = fabric_train(fabric, model, optimizer, steps, start=start, on_step=on_step)
write_result({"attempt": attempt, "start": start, "resumed_from": str(latest), "losses": losses})
