"""Fabric + a disttrain strategy, many small all_reduces, then a plain exit: the exit status must be 0 on every rank
(gloo workers finishing a collective while Python finalizes used to abort a rank). Usage: clean_exit.py OUT STRATEGY"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import strategy_from_spec, write_result  # noqa: E402


def main() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=strategy_from_spec(sys.argv[2], "fabric"))
    fabric.launch()
    total = sum(fabric.all_reduce(torch.ones(8), reduce_op="sum")[0].item() for _ in range(50))
    write_result({"total": total})
    fabric.all_reduce(torch.ones(8))  # a collective right before the exit: the case that aborted
    # no destroy_process_group here: the library must leave the process cleanly by itself


if __name__ == "__main__":
    main()
