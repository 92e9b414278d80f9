"""``disttrain_auto`` for the Lightning Trainer: the planner's choice among the registered strategies, made from
the devices actually present (see :mod:`disttrain.planner.runtime` and ``_lightning.AutoResolution``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from disttrain._lightning import AutoResolution, checked_options
from disttrain.strategies.ddp import DDPStrategy


class AutoStrategy(AutoResolution, DDPStrategy):
    """Chooses one of the registered disttrain strategies when the model is known and becomes it: from
    ``trainer.fit`` (``validate``, ...) on, ``trainer.strategy`` is the chosen strategy and its ``plan`` the
    planner's report. Until then it stands in as our DDP strategy.

    The model planned for is the ``model`` option, else a ``planner_model`` attribute on the LightningModule (a recipe
    YAML or its ``model:`` dict), else the LightningModule itself (one that builds its model in ``configure_model``
    is built on the meta device to be measured, then put back).
    """

    _lightning_registry, _precision_attr = StrategyRegistry, "precision_plugin"

    # BEGIN generated options: tools/strategy_signatures.py --write, from AutoOptions (edit the dataclass)
    @checked_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = None,
        *,
        model: Any = None,
        micro_batch: Optional[int] = None,
        seq_len: Optional[int] = None,
        headroom: float = 0.1,
        hardware: Optional[str] = None,
        device_memory: Optional[str] = None,
        activation_checkpointing: Optional[bool] = None,
        trial: bool = False,
        trial_top: int = 3,
        trial_steps: int = 3,
    ) -> None:
        """The options of ``disttrain_auto`` as keywords (:class:`~disttrain.parallel.registry.AutoOptions`), after the
        arguments the Trainer sets.

        Args:
            accelerator: set by the Trainer from its ``accelerator``.
            parallel_devices: set by the Trainer from its ``devices``.
            cluster_environment: set by the Trainer (torchrun, SLURM, ...).
            precision_plugin: set by the Trainer from its ``precision``.
            process_group_backend: "gloo" or "nccl"; default: the devices' own.
            timeout: seconds (or a ``timedelta``) a process may stay silent before every process ends the run; a
                collective waits a few seconds longer. Default: ``$DISTTRAIN_TIMEOUT``, else 600.
            model: the model to plan for: a recipe YAML path, its ``model:`` dict, a ModelSpec or a module. Trainer: by
                default the LightningModule (its ``configure_model`` is run on the meta device if it builds the model
                there). Fabric: required.
            micro_batch: samples per device per step (default: the recipe's when ``model`` is a recipe YAML, else 1).
            seq_len: tokens per sample (default: the recipe's, else the model's length).
            headroom: fraction of device memory kept free.
            hardware: a preset name for bandwidths ("A100-40GB"); None: the devices present, with this machine's
                calibration (``disttrain calibrate``) when it has one.
            device_memory: overrides the detected memory per device ("40GiB").
            activation_checkpointing: None: the recipe's, else searched (the plan may turn it on); True or False fixes
                it.
            trial: run the best plans for a few steps on the devices present and choose the fastest measured (needs
                ``model`` as a recipe YAML or its ``model:`` dict).
            trial_top: plans to try.
            trial_steps: timed steps per plan (after one warm-up).
        """
        options = {"model": model, "micro_batch": micro_batch, "seq_len": seq_len, "headroom": headroom,
                   "hardware": hardware, "device_memory": device_memory,
                   "activation_checkpointing": activation_checkpointing, "trial": trial, "trial_top": trial_top,
                   "trial_steps": trial_steps}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
                           timeout, options)
    # END generated options

    @override
    def connect(self, model: Any) -> None:
        # Reached only when no model= resolved it in _configure_launcher: the LightningModule decides.
        self._resolve(model)
        self.connect(model)  # the chosen strategy's own
