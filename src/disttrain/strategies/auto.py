"""``disttrain_auto`` for the Lightning Trainer: the planner's choice among the registered strategies, made from
the devices actually present (see :mod:`disttrain.planner.runtime`)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

from disttrain._lightning import register_names
from disttrain.planner.runtime import AutoProxy
from disttrain.strategies.ddp import DDPStrategy


class AutoStrategy(AutoProxy):
    """Chooses one of the registered disttrain strategies when the model is known, then behaves as it (attribute
    access and ``isinstance`` go to the chosen strategy).

    Options (:class:`disttrain.planner.runtime.AutoOptions`): ``model`` (default: the LightningModule; one that
    builds its model in ``configure_model`` is built on the meta device to be measured, then put back), or a
    ``planner_model`` attribute on the LightningModule (a recipe YAML or its ``model:`` dict); ``micro_batch``,
    ``seq_len``, ``headroom``, ``hardware``, ``device_memory``. ``trainer.strategy.plan`` holds the planner's
    report once ``fit`` has started.
    """

    _stand_in = DDPStrategy
    _registry = StrategyRegistry
    _precision_attr = "precision_plugin"
    _deepspeed = (DeepSpeedStrategy, DeepSpeedPrecision)
    register_strategies = classmethod(register_names)

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision_plugin: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
                         **options)

    def _configure_launcher(self) -> None:
        inner = object.__getattribute__(self, "_inner")
        inner._configure_launcher()
        if self.auto_options.model is not None:
            self._choose(self.auto_options.model)  # the devices are known: choose before anything is built

    def connect(self, model: Any) -> None:
        if not self._chosen():
            self._choose(model)
        object.__getattribute__(self, "_inner").connect(model)
