"""A Fabric script as users write it for `lightning run model`: no fabric.launch() under the launcher (the
processes already exist); Fabric() takes strategy/devices/precision from the launcher. Usage: cli_fabric.py OUT"""

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fabric_train, tiny_llama, write_result  # noqa: E402

fabric = L.Fabric()
if not os.environ.get("LT_CLI_USED"):
    fabric.launch()
model = tiny_llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)
losses = fabric_train(fabric, model, optimizer, 2)
write_result({"strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
              "world_size": fabric.world_size, "losses": losses, "precision": type(fabric.strategy.precision).__name__,
              "script_args": sys.argv[2:]})
