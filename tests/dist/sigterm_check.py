"""How often the ranks of a Trainer fit check whether rank 0 received SIGTERM. Usage: sigterm_check.py OUT

1. Lightning's ``ddp`` and ``disttrain_ddp`` each fit BoringModel for STEPS steps; every ``torch.distributed.broadcast``
   is counted by the function that called it (Lightning's per-step check, or disttrain's SigtermCheck).
2. SigtermCheck itself over simulated 10 ms steps: rank 0's flag is set before step FLAG_STEP; the step at which
   each rank ends (SIGTERMException) and the broadcasts made.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from types import SimpleNamespace

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

import disttrain  # noqa: E402,F401
from disttrain.strategies.base import SigtermCheck  # noqa: E402

STEPS = 40
FLAG_STEP = 120

callers: collections.Counter = collections.Counter()
broadcast = dist.broadcast


def counted_broadcast(*args, **kwargs):
    callers[sys._getframe(1).f_code.co_name] += 1
    return broadcast(*args, **kwargs)


def main() -> None:
    dist.broadcast = counted_broadcast
    fits = {}
    for strategy in ("ddp", "disttrain_ddp"):
        callers.clear()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(BoringModel())
        fits[strategy] = dict(callers)

    stub = SimpleNamespace(received_sigterm=False, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    check, callers_before = SigtermCheck(stub), callers["__call__"]
    ended_at, flagged_at = None, None
    for step in range(1, 1000):
        if dist.get_rank() == 0 and step == FLAG_STEP:
            stub.received_sigterm, flagged_at = True, time.monotonic()
        try:
            check()
        except SIGTERMException:
            ended_at = step
            break
        time.sleep(0.01)
    write_result({"fits": fits, "ended_at": ended_at, "checks": callers["__call__"] - callers_before,
                  "seconds_after_flag": time.monotonic() - flagged_at if flagged_at else None})


if __name__ == "__main__":
    main()
