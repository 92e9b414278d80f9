"""``disttrain_auto`` for Lightning Fabric: the planner's choice among the registered strategies, made from the
devices actually present (see :mod:`disttrain.planner.runtime`). Fabric starts its processes before it sees the
model, so the model to plan for is an option: ``Fabric(strategy=AutoStrategy(model="configs/...yaml"))``."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY

from disttrain._lightning import choose_strategy
from disttrain.fabric.ddp import DDPStrategy
from disttrain.parallel.options import build_options
from disttrain.planner.runtime import AutoOptions


class AutoStrategy(DDPStrategy):
    """Chooses one of the registered disttrain strategies as soon as Fabric knows its devices, and becomes it.

    Options as the Trainer's (:class:`disttrain.planner.runtime.AutoOptions`); ``model`` is required (a recipe
    YAML path, its ``model:`` dict, a ModelSpec, or a module, e.g. built on the meta device).
    ``fabric.strategy.plan`` holds the planner's report.
    """

    strategy_name = "disttrain_auto"

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        self.auto_options = build_options(AutoOptions, self.strategy_name, options)
        self.plan = None
        super().__init__(accelerator, parallel_devices, cluster_environment, precision, process_group_backend)

    def _configure_launcher(self) -> None:
        if self.auto_options.model is None:
            raise ValueError("disttrain_auto under Fabric needs the model to plan for, because Fabric starts its "
                             "processes before it sees the model: pass Fabric(strategy=disttrain.fabric.AutoStrategy("
                             "model='configs/nlp/dialogue_1b.yaml')) (a recipe YAML, its model: dict or a module)")
        super()._configure_launcher()
        chosen = choose_strategy(self, self.auto_options, self.auto_options.model, STRATEGY_REGISTRY, "precision")
        # Fabric reads its connector's strategy right after this call and keeps it, with no later hook to replace
        # it: this object becomes the chosen strategy, its class and (shared with it) its state.
        self.__class__ = type(chosen)
        self.__dict__ = chosen.__dict__
