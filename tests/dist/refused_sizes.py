"""A script whose strategy asks for more ranks than its devices give: tensor_parallel_size=3 on 2 processes.

Usage: refused_sizes.py trainer|fabric   (under a launcher: ``disttrain run``, torchrun)

It must end in ``Trainer(...)`` / ``Fabric(...)`` with one line naming the sizes and the fix, before any process
group or process of Lightning's own starts; the ``reached`` line below must never print."""

import os
import sys

import lightning as L

import disttrain

devices = int(os.environ.get("LOCAL_WORLD_SIZE", 2))
if sys.argv[1] == "trainer":
    L.Trainer(strategy=disttrain.strategies.MegatronStrategy(tensor_parallel_size=3), accelerator="cpu",
              devices=devices, logger=False)
else:
    L.Fabric(strategy=disttrain.fabric.MegatronStrategy(tensor_parallel_size=3), accelerator="cpu", devices=devices)
print("reached: the strategy was accepted", flush=True)
