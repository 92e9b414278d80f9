"""The Lightning side of the registry (:mod:`disttrain.parallel.registry`): each registered strategy's Trainer and
Fabric adapter, found by its engine class, and the registration of every name in both Lightning registries (with
the row's default options, so ``disttrain_fsdp_offload`` is ``FSDPStrategy(cpu_offload=True)``)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from disttrain import fabric, strategies
from disttrain.parallel.options import OptionError
from disttrain.parallel.registry import STRATEGIES, Registered, closest_names, lookup, names


class Adapters(NamedTuple):
    trainer: type  # a lightning.pytorch Strategy
    fabric: type  # a lightning.fabric Strategy


def adapters(row: Registered) -> Adapters:
    """The Trainer and Fabric classes of a registered strategy: the adapters whose own strategy has its engine
    (``disttrain_fsdp_offload`` is ``FSDPStrategy`` with other defaults; ``disttrain_auto`` has none)."""
    found = []
    for package in (strategies, fabric):
        matches = [cls for cls in package.ADAPTERS if lookup(cls.strategy_name).engine is row.engine]
        if len(matches) != 1:
            raise LookupError(f"{package.__name__} has {len(matches)} adapters for {row.name} (engine"
                              f" {getattr(row.engine, '__name__', None)}); it needs exactly one")
        found.append(matches[0])
    return Adapters(*found)


def register(trainer_registry: Any, fabric_registry: Any) -> list[str]:
    """Register every row in the Trainer's and Fabric's strategy registries (idempotent); returns the names."""
    for row in STRATEGIES:
        for registry, cls in zip((trainer_registry, fabric_registry), adapters(row)):
            if row.name not in registry:
                registry.register(row.name, cls, description=row.description, **row.defaults)
    return [row.name for row in STRATEGIES]


def unknown_strategy_error(name: str, registered: list[str], lightning_message: str) -> Optional[OptionError]:
    """The error for ``Trainer(strategy=name)`` / ``Fabric(strategy=name)`` when no registry holds ``name``:
    Lightning's message and the closest registered names (disttrain's among them), or None when no name is close
    (Lightning's error stands). Installed by :func:`disttrain.patches.suggest_strategy_names`."""
    close = closest_names(name, registered, n=2)
    if not close:
        return None
    ours = f" (disttrain's strategies: {', '.join(names())})" if set(close) & set(names()) else ""
    return OptionError(f"{lightning_message}; did you mean {' or '.join(map(repr, close))}?{ours}")
