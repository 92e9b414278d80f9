"""disttrain: large-model distributed strategies for PyTorch Lightning (Trainer) and Lightning Fabric.

``import disttrain`` makes every ``disttrain_*`` strategy name of the registry (:mod:`disttrain.parallel.registry`)
available to ``Trainer(strategy=...)`` and ``Fabric(strategy=...)``, and lets ``MyModule.load_from_checkpoint`` read
the checkpoint folders those strategies write. Everything else is imported on first use (``disttrain.strategies``,
``disttrain.nlp``, ...), so the torch-only layers (``disttrain.parallel``, ``disttrain.planner``,
``disttrain.simulate``) import without Lightning.

How, in two narrow steps (Lightning has no plugin hook for strategy names, and importing it here would triple the
start-up of everything that does not need it, ``disttrain plan`` among them; both are in :mod:`disttrain.patches`):

- once Lightning is imported (now, or later: a finder in ``sys.meta_path`` that answers for the one module name
  ``lightning``, then removes itself), its two strategy registries are marked to register disttrain's names the
  first time anything reads them, ``load_from_checkpoint`` learns the folders, a misspelt strategy name given
  to the Trainer or Fabric is answered with the closest registered one, and a machine without NVIDIA's management
  library is looked at for it once (Lightning's NVML-based CUDA check would load it at every check);
- the first read of either registry (``Trainer(strategy="disttrain_fsdp")``, ``lightning run model --strategy``)
  registers every name in both (:func:`register_strategies`, which a program may also call itself).

Registration waits for that first read because Lightning is often first imported by one of disttrain's own adapter
modules, whose import is not finished at that moment; registering needs those adapters.
"""

from __future__ import annotations

import importlib
from typing import Any

from disttrain import patches

__version__ = "0.1.0"

_SUBPACKAGES = ("callbacks", "fabric", "names", "nlp", "parallel", "planner", "recsys", "simulate", "strategies",
                "vision")
_NAMES = {"CheckpointError": "disttrain.parallel.checkpoint.io", "STRATEGIES": "disttrain.parallel.registry"}
__all__ = ["CheckpointError", "STRATEGIES", "fabric", "parallel", "register_strategies", "strategies"]


def register_strategies() -> list[str]:
    """Register every registered name in the Trainer's and Fabric's strategy registries (idempotent); returns the
    names."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from disttrain.names import register

    return register(StrategyRegistry, STRATEGY_REGISTRY)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"disttrain.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'disttrain' has no attribute {name!r}")


def _lightning_loaded() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from disttrain.checkpoint_loading import is_checkpoint_folder, read_checkpoint_folder

    patches.read_checkpoint_folders(is_checkpoint_folder, read_checkpoint_folder)
    patches.suggest_strategy_names(_unknown_strategy_error)
    patches.remember_missing_nvml()  # Lightning has just set PYTORCH_NVML_BASED_CUDA_CHECK=1
    for registry in (StrategyRegistry, STRATEGY_REGISTRY):
        patches.register_on_first_read(registry, register_strategies)


def _unknown_strategy_error(name: str, registered: list[str], lightning_message: str) -> Any:
    from disttrain.names import unknown_strategy_error  # on use: it imports every adapter

    return unknown_strategy_error(name, registered, lightning_message)


patches.when_lightning_loads(_lightning_loaded)
