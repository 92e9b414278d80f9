"""``disttrain_auto`` for the Lightning Trainer: the planner's choice among the registered strategies, made from
the devices actually present (see :mod:`disttrain.planner.runtime`)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

from lightning.pytorch.strategies import StrategyRegistry

from disttrain._lightning import choose_strategy
from disttrain.parallel.options import build_options
from disttrain.planner.runtime import AutoOptions
from disttrain.strategies.ddp import DDPStrategy


class AutoStrategy(DDPStrategy):
    """Chooses one of the registered disttrain strategies when the model is known and puts it in its own place:
    from ``trainer.fit`` (``validate``, ...) on, ``trainer.strategy`` is the chosen strategy and its ``plan`` the
    planner's report. Until then it stands in as our DDP strategy.

    Options (:class:`disttrain.planner.runtime.AutoOptions`): ``model`` (default: the LightningModule; one that
    builds its model in ``configure_model`` is built on the meta device to be measured, then put back), or a
    ``planner_model`` attribute on the LightningModule (a recipe YAML or its ``model:`` dict); ``micro_batch``,
    ``seq_len``, ``headroom``, ``hardware``, ``device_memory``.
    """

    strategy_name = "disttrain_auto"

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision_plugin: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        self.auto_options = build_options(AutoOptions, self.strategy_name, options)
        self.plan, self._chosen = None, None
        super().__init__(accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.auto_options.model is not None:  # the devices are known: choose before anything is built
            self._chosen = choose_strategy(self, self.auto_options, self.auto_options.model, StrategyRegistry,
                                           "precision_plugin")
            self.plan = self._chosen.plan

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        with (self._chosen or super()).tensor_init_context(empty_init):
            yield

    def connect(self, model: Any) -> None:
        chosen = self._chosen or choose_strategy(self, self.auto_options, model, StrategyRegistry, "precision_plugin")
        # Lightning calls connect once the model is attached to the Trainer, and from here on reads trainer.strategy
        # from the connector at every use: the chosen strategy takes this one's place there.
        model.trainer._accelerator_connector.strategy = chosen
        chosen.connect(model)
