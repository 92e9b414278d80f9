"""What ``strategy="disttrain_auto"`` does at run time, written once for the Trainer and Fabric adapters: read the
model's structure, detect the devices actually present, choose among the registered strategies, and turn the
auto strategy object into the chosen one.

Lightning needs a Strategy object when the Trainer/Fabric is built, before the model exists. The auto adapter is a
proxy: every attribute read and write goes to the strategy it holds, first our DDP strategy, then the chosen one,
built with what Lightning had set (accelerator, devices, cluster environment, precision, launcher). ``__class__``
is forwarded too, so Lightning's ``isinstance`` checks see the chosen class. (Assigning ``__class__`` instead is
not possible: Lightning's strategy classes have different C layouts.) The choice is made at ``connect(model)`` for
the Trainer, or as soon as the devices are known when a model (config path, dict or module) was passed as
``model=`` (always the case with Fabric, which sees the model only after it has started the processes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.planner.choose import Plan, choose
from disttrain.planner.hardware import detect
from disttrain.planner.hardware import hardware as make_hardware
from disttrain.planner.spec import ModelSpec, model_spec

log = logging.getLogger(__name__)


@dataclass
class AutoOptions:
    """Options of ``disttrain_auto`` (the same on the Trainer and Fabric).

    model: the model to plan for: a recipe YAML path, its ``model:`` dict, a ModelSpec or a module. Trainer: by
        default the LightningModule (its ``configure_model`` is run on the meta device if it builds the model
        there). Fabric: required.
    micro_batch, seq_len: samples per device per step and tokens per sample (default: the model's length).
    headroom: fraction of device memory kept free. hardware: a preset name for bandwidths ("A100-40GB");
    device_memory: overrides the detected memory per device ("40GiB").
    """

    model: Any = None
    micro_batch: int = 1
    seq_len: int | None = None
    headroom: float = 0.1
    hardware: str | None = None
    device_memory: str | None = None


def registered_choices() -> list[str]:
    from disttrain.names import STRATEGIES

    return [name for name, *_ in STRATEGIES if name != "disttrain_auto"]


def spec_of(module: nn.Module) -> ModelSpec:
    """The structure of a (Lightning) module; a module that builds its model in ``configure_model`` builds it on
    the meta device here, and the attributes it set are put back as they were, so the real build still happens."""
    hook = getattr(module, "planner_model", None)
    if hook is not None:
        return model_spec(hook)
    if any(True for _ in module.parameters()) or not callable(getattr(module, "configure_model", None)):
        return model_spec(module)
    before = dict(module._modules)
    with torch.device("meta"):
        module.configure_model()
    try:
        return model_spec(module)
    finally:
        for name in list(module._modules):
            if name not in before:
                delattr(module, name)
                setattr(module, name, None)  # what `if self.model is None` style guards expect
            elif module._modules[name] is not before[name]:
                setattr(module, name, before[name])


def plan_for(source: Any, options: AutoOptions, world_size: int, device: torch.device, precision: str,
             gpus_per_node: int) -> Plan:
    """The plan on the devices present, limited to the registered strategies; every rank computes the same one
    (the inputs are the same on every rank: total, not free, memory)."""
    spec = spec_of(source) if isinstance(source, nn.Module) else model_spec(source)
    if options.hardware is not None:
        hw = make_hardware(options.hardware, options.device_memory, gpus_per_node=gpus_per_node)
    else:
        hw = detect(device, world_size, gpus_per_node)
        if options.device_memory is not None:
            hw = hw.with_memory(options.device_memory)
    plan = choose(spec, world_size, hw, micro_batch=options.micro_batch, seq_len=options.seq_len,
                  precision=_planned_precision(precision), headroom=options.headroom,
                  available=registered_choices())
    if plan.choice is None:
        raise RuntimeError("disttrain_auto: no registered strategy fits this model on these devices:\n"
                           + plan.report())
    return plan


def _planned_precision(precision: str) -> str:
    p = str(precision)
    return {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(p, p)


class AutoProxy:
    """The shared part of both ``AutoStrategy`` adapters; each sets the class attributes below and calls
    :meth:`_choose` at its trigger."""

    strategy_name = "disttrain_auto"
    _stand_in: type  # our DDP strategy for this entry point
    _registry: Any  # the entry point's strategy registry
    _precision_attr: str  # "precision_plugin" (Trainer) or "precision" (Fabric)
    _deepspeed: tuple[type, type]  # (Lightning's DeepSpeedStrategy, DeepSpeedPrecision) for this entry point
    _OWN = frozenset(("_inner", "auto_options", "plan", "_choose", "_chosen", "strategy_name", "_stand_in", "_registry",
                      "_precision_attr", "_deepspeed", "register_strategies", "_OWN"))

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        from disttrain.parallel.options import build_options

        object.__setattr__(self, "auto_options", build_options(AutoOptions, self.strategy_name, options))
        object.__setattr__(self, "plan", None)
        stand_in = self._stand_in(accelerator=accelerator, parallel_devices=parallel_devices,
                                  cluster_environment=cluster_environment, process_group_backend=process_group_backend,
                                  **{self._precision_attr: precision})
        object.__setattr__(self, "_inner", stand_in)

    def __getattribute__(self, name: str) -> Any:
        own = object.__getattribute__(self, "__dict__")
        if name in AutoProxy._OWN or (name.startswith("__") and name != "__class__"):
            return object.__getattribute__(self, name)
        if name in ("connect", "_configure_launcher") and own.get("plan") is None:
            return object.__getattribute__(self, name)
        return getattr(own["_inner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_inner"), name, value)

    def _chosen(self) -> bool:
        return object.__getattribute__(self, "__dict__").get("plan") is not None

    def _choose(self, source: Any) -> None:
        inner = object.__getattribute__(self, "_inner")
        devices = inner.parallel_devices
        precision = getattr(inner, self._precision_attr).precision
        plan = plan_for(source, self.auto_options, inner.num_nodes * len(devices), inner.root_device, precision,
                        gpus_per_node=len(devices))
        if inner.global_rank == 0:
            print(f"disttrain_auto:\n{plan.report()}", flush=True)
        row = self._registry[plan.strategy]
        new = row["strategy"](**{**row["init_params"], **plan.choice.strategy_options()})
        new.accelerator = inner.accelerator
        new.parallel_devices = devices
        new.cluster_environment = inner.cluster_environment
        new.num_nodes = inner.num_nodes
        if hasattr(new, "_layer_sync"):
            new._layer_sync = getattr(inner, "_layer_sync", None)  # the Trainer's sync_batchnorm=True
        plugin = getattr(inner, self._precision_attr)
        base, deepspeed_precision = self._deepspeed
        if isinstance(new, base) and not isinstance(plugin, deepspeed_precision):
            plugin = deepspeed_precision(plugin.precision)  # DeepSpeed strategies need their own precision plugin
        setattr(new, self._precision_attr, plugin)
        ranks = getattr(new, "set_world_ranks", None) or getattr(new, "_set_world_ranks", None)
        if ranks is not None:
            ranks()
        new._configure_launcher()
        if inner._launcher is not None and new._launcher is not None:
            new._launcher = inner._launcher  # the processes may already have been started by this one
        object.__setattr__(self, "_inner", new)
        object.__setattr__(self, "plan", plan)
