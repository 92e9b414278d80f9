"""``disttrain_auto`` for Lightning Fabric: the planner's choice among the registered strategies, made from the
devices actually present (see :mod:`disttrain.planner.runtime` and ``_lightning.AutoResolution``). Fabric starts its
processes before it sees the model, so the model to plan for is an option:
``Fabric(strategy=AutoStrategy(model="configs/...yaml"))``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY

from disttrain._lightning import AutoResolution, checked_options
from disttrain.fabric.ddp import DDPStrategy
from disttrain.parallel.options import OptionError


class AutoStrategy(AutoResolution, DDPStrategy):
    """Chooses one of the registered disttrain strategies as soon as Fabric knows its devices, and becomes it.

    Options as the Trainer's (:class:`disttrain.parallel.registry.AutoOptions`); ``model`` is required (a recipe
    YAML path, its ``model:`` dict, a ModelSpec, or a module, e.g. built on the meta device).
    ``fabric.strategy.plan`` holds the planner's report.
    """

    _lightning_registry, _precision_attr = STRATEGY_REGISTRY, "precision"

    # BEGIN generated options: tools/strategy_signatures.py --write, from AutoOptions (edit the dataclass)
    @checked_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
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
        arguments Fabric sets.

        Args:
            accelerator: set by Fabric from its ``accelerator``.
            parallel_devices: set by Fabric from its ``devices``.
            cluster_environment: set by Fabric (torchrun, SLURM, ...).
            precision: set by Fabric from its ``precision``.
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
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision, process_group_backend,
                           timeout, options)
    # END generated options

    def _configure_launcher(self) -> None:
        if self.auto_options.model is None:
            raise OptionError("disttrain_auto under Fabric needs the model to plan for, because Fabric starts its "
                             "processes before it sees the model: pass Fabric(strategy=disttrain.fabric.AutoStrategy("
                             "model='configs/nlp/dialogue_1b.yaml')) (a recipe YAML, its model: dict or a module)")
        super()._configure_launcher()
