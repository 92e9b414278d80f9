"""``disttrain_auto`` for Lightning Fabric: the planner's choice among the registered strategies, made from the
devices actually present (see :mod:`disttrain.planner.runtime`). Fabric starts its processes before it sees the
model, so the model to plan for is an option: ``Fabric(strategy=AutoStrategy(model="configs/...yaml"))``."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import DeepSpeedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy

from disttrain._lightning import register_names
from disttrain.fabric.ddp import DDPStrategy
from disttrain.planner.runtime import AutoProxy


class AutoStrategy(AutoProxy):
    """Chooses one of the registered disttrain strategies as soon as Fabric knows its devices, then behaves as it.

    Options as the Trainer's (:class:`disttrain.planner.runtime.AutoOptions`); ``model`` is required (a recipe
    YAML path, its ``model:`` dict, a ModelSpec, or a module, e.g. built on the meta device).
    ``fabric.strategy.plan`` holds the planner's report.
    """

    _stand_in = DDPStrategy
    _registry = STRATEGY_REGISTRY
    _precision_attr = "precision"
    _deepspeed = (DeepSpeedStrategy, DeepSpeedPrecision)
    register_strategies = classmethod(register_names)

    def _configure_launcher(self) -> None:
        if self.auto_options.model is None:
            raise ValueError("disttrain_auto under Fabric needs the model to plan for, because Fabric starts its "
                             "processes before it sees the model: pass Fabric(strategy=disttrain.fabric.AutoStrategy("
                             "model='configs/nlp/dialogue_1b.yaml')) (a recipe YAML, its model: dict or a module)")
        object.__getattribute__(self, "_inner")._configure_launcher()
        self._choose(self.auto_options.model)
