"""``disttrain_auto`` for Lightning Fabric: the planner's choice among the registered strategies, made from the
devices actually present (see :mod:`disttrain.planner.runtime` and ``_lightning.AutoResolution``). Fabric starts its
processes before it sees the model, so the model to plan for is an option:
``Fabric(strategy=AutoStrategy(model="configs/...yaml"))``."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY

from disttrain._lightning import AutoResolution
from disttrain.fabric.ddp import DDPStrategy


class AutoStrategy(AutoResolution, DDPStrategy):
    """Chooses one of the registered disttrain strategies as soon as Fabric knows its devices, and becomes it.

    Options as the Trainer's (:class:`disttrain.parallel.registry.AutoOptions`); ``model`` is required (a recipe
    YAML path, its ``model:`` dict, a ModelSpec, or a module, e.g. built on the meta device).
    ``fabric.strategy.plan`` holds the planner's report.
    """

    _lightning_registry, _precision_attr = STRATEGY_REGISTRY, "precision"

    def _configure_launcher(self) -> None:
        if self.auto_options.model is None:
            raise ValueError("disttrain_auto under Fabric needs the model to plan for, because Fabric starts its "
                             "processes before it sees the model: pass Fabric(strategy=disttrain.fabric.AutoStrategy("
                             "model='configs/nlp/dialogue_1b.yaml')) (a recipe YAML, its model: dict or a module)")
        super()._configure_launcher()
