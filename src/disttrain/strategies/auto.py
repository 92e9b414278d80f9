"""``disttrain_auto`` for the Lightning Trainer: the planner's choice among the registered strategies, made from
the devices actually present (see :mod:`disttrain.planner.runtime` and ``_lightning.AutoResolution``)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from disttrain._lightning import AutoResolution
from disttrain.strategies.ddp import DDPStrategy


class AutoStrategy(AutoResolution, DDPStrategy):
    """Chooses one of the registered disttrain strategies when the model is known and becomes it: from
    ``trainer.fit`` (``validate``, ...) on, ``trainer.strategy`` is the chosen strategy and its ``plan`` the
    planner's report. Until then it stands in as our DDP strategy.

    Options (:class:`disttrain.parallel.registry.AutoOptions`): ``model`` (default: the LightningModule; one that
    builds its model in ``configure_model`` is built on the meta device to be measured, then put back), or a
    ``planner_model`` attribute on the LightningModule (a recipe YAML or its ``model:`` dict); ``micro_batch``,
    ``seq_len``, ``headroom``, ``hardware``, ``device_memory``.
    """

    _lightning_registry, _precision_attr = StrategyRegistry, "precision_plugin"

    @override
    def connect(self, model: Any) -> None:
        # Reached only when no model= resolved it in _configure_launcher: the LightningModule decides.
        self._resolve(model)
        self.connect(model)  # the chosen strategy's own
