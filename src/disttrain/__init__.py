"""disttrain: large-model distributed strategies for PyTorch Lightning (Trainer) and Lightning Fabric.

``import disttrain`` registers every ``disttrain_*`` strategy name of the name table (:mod:`disttrain.names`) in
both Lightning registries and lets ``MyModule.load_from_checkpoint`` read the checkpoint folders those strategies
write: at once when Lightning is already imported, else the moment it is. Everything else is imported on first use
(``disttrain.strategies``, ``disttrain.nlp``, ...), so the torch-only layers (``disttrain.parallel``,
``disttrain.planner``) import without Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = ("callbacks", "fabric", "names", "nlp", "parallel", "planner", "recsys", "strategies", "vision")
_NAMES = {"CheckpointError": "disttrain.parallel.checkpoint", "STRATEGIES": "disttrain.names"}
__all__ = ["CheckpointError", "STRATEGIES", "fabric", "parallel", "register_strategies", "strategies"]


def register_strategies() -> list[str]:
    """Register every name of the name table in the Trainer's and Fabric's registries, and let Lightning's
    ``load_from_checkpoint`` read the checkpoint folders those strategies write (idempotent). Returns the names."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from disttrain.checkpoint_loading import install_load_from_checkpoint
    from disttrain.names import register

    install_load_from_checkpoint()
    return register(StrategyRegistry, STRATEGY_REGISTRY)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"disttrain.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'disttrain' has no attribute {name!r}")


class _RegisterWithLightning(importlib.abc.MetaPathFinder):
    """Registers the names once Lightning is imported, when disttrain was imported first. Lightning is often first
    imported by a disttrain module itself (the adapters import it), whose import chain registration must not
    re-enter: so the loaders of Lightning and of every disttrain module are wrapped, and the names are registered
    when the last of them finishes while Lightning is loaded; then this finder leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "lightning" and not fullname.startswith("disttrain."):
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if finder is not self and hasattr(
                finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


class _ThenRegister:
    """A module's own loader (every other attribute is its: ``get_code`` for ``python -m``, resources...) whose
    ``exec_module`` registers the names afterwards when the time has come."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # the module's own loader from here on
        self.loader.exec_module(module)
        if "lightning" in sys.modules and not any(
                getattr(getattr(other, "__spec__", None), "_initializing", False)
                for name, other in list(sys.modules.items())
                if other is not module and (name == "lightning" or name.startswith(("lightning.", "disttrain.")))):
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterWithLightning)]
            register_strategies()


if "lightning" in sys.modules:
    register_strategies()
elif not any(type(finder).__name__ == "_RegisterWithLightning" for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithLightning())
