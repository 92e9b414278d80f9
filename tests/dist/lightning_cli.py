"""LightningCLI on 2 CPU processes, the strategy and its options given in a YAML file as a user writes it.

Usage: lightning_cli.py OUT CONFIG [--trainer.strategy.init_args.NAME=VALUE ...]

The YAML names a disttrain strategy class (``class_path``) and its options (``init_args``); jsonargparse reads them
from the class's signature. Records what reached the strategy (its class, the engine's options and degrees, the
checkpoint wrappers activation checkpointing put in) and the losses of the run, which the test compares with one
process.
"""

import dataclasses
import os
import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, loader, write_result  # noqa: E402


class Data(L.LightningDataModule):
    def train_dataloader(self):
        return loader()


config, overrides = sys.argv[2], sys.argv[3:]
cli = LightningCLI(LlamaModule, Data, args=["fit", "--config", config, *overrides], save_config_callback=None)
strategy = cli.trainer.strategy
write_result({
    "strategy": f"{type(strategy).__module__}.{type(strategy).__name__}",
    "options": {k: v for k, v in dataclasses.asdict(strategy.engine.options).items() if k != "tp_plan"},
    "degrees": strategy.engine.dims.degrees(),
    "wrapped_blocks": sum(isinstance(m, CheckpointWrapper) for m in cli.model.modules()),
    "losses": cli.model.losses,
})
