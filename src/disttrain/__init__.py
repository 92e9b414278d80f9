"""disttrain: large-model distributed strategies for PyTorch Lightning (Trainer) and Lightning Fabric.

``import disttrain`` makes every ``disttrain_*`` strategy name of the registry (:mod:`disttrain.parallel.registry`)
available to ``Trainer(strategy=...)`` and ``Fabric(strategy=...)``, and lets ``MyModule.load_from_checkpoint`` read
the checkpoint folders those strategies write. Everything else is imported on first use (``disttrain.strategies``,
``disttrain.nlp``, ...), so the torch-only layers (``disttrain.parallel``, ``disttrain.planner``,
``disttrain.simulate``) import without Lightning.

How, in two narrow steps (Lightning has no plugin hook for strategy names, and importing it here would triple the
start-up of everything that does not need it, ``disttrain plan`` among them):

- once Lightning is imported (now, or later: a finder in ``sys.meta_path`` that answers for the one module name
  ``lightning``, then removes itself), its two strategy registries are marked to register disttrain's names the
  first time anything reads them, and ``load_from_checkpoint`` learns the folders;
- the first read of either registry (``Trainer(strategy="disttrain_fsdp")``, ``lightning run model --strategy``)
  registers every name in both (:func:`register_strategies`, which a program may also call itself).

Registration waits for that first read because Lightning is often first imported by one of disttrain's own adapter
modules, whose import is not finished at that moment; registering needs those adapters.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = ("callbacks", "fabric", "names", "nlp", "parallel", "planner", "recsys", "simulate", "strategies",
                "vision")
_NAMES = {"CheckpointError": "disttrain.parallel.checkpoint", "STRATEGIES": "disttrain.parallel.registry"}
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

    from disttrain.checkpoint_loading import install_load_from_checkpoint

    install_load_from_checkpoint()
    for registry in (StrategyRegistry, STRATEGY_REGISTRY):
        _register_on_first_read(registry)


# Every way Lightning and its users read a strategy registry (a dict subclass).
_READS = ("__contains__", "__getitem__", "__iter__", "__len__", "__repr__", "__str__", "available_strategies", "get",
          "items", "keys", "register", "remove", "values")


def _register_on_first_read(registry: dict) -> None:
    """Until it is first read, ``registry`` is of a subclass of its own class whose reads register the names, put
    the registry's class back, then read it as usual."""
    own = type(registry)
    if getattr(own, "_disttrain_pending", False):
        return

    def first(method: str) -> Any:
        def read(self: dict, *args: Any, **kwargs: Any) -> Any:
            self.__class__ = own
            register_strategies()
            return getattr(own, method)(self, *args, **kwargs)

        return read

    registry.__class__ = type(own.__name__, (own,), {"_disttrain_pending": True, **{m: first(m) for m in _READS}})


class _WhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds no module itself: for ``lightning`` alone it returns the spec the other finders give, with a loader
    that calls :func:`_lightning_loaded` once Lightning's package has run; then this finder leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader)
        return spec


class _ThenCall:
    """Lightning's own loader (every other attribute is its), whose ``exec_module`` calls :func:`_lightning_loaded`
    after the package ran."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # the package's own loader from here on
        self.loader.exec_module(module)
        _lightning_loaded()


if "lightning" in sys.modules:
    _lightning_loaded()
elif not any(type(finder).__name__ == "_WhenLightningLoads" for finder in sys.meta_path):
    sys.meta_path.insert(0, _WhenLightningLoads())
