"""What ``strategy="disttrain_auto"`` decides at run time, in torch terms: read the model's structure, detect the
devices actually present and choose among the registered strategies. The adapters (``disttrain.strategies.auto``,
``disttrain.fabric.auto``) then build the chosen strategy.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from disttrain.parallel.registry import AutoOptions
from disttrain.planner.choose import Plan, choose, planned_precision
from disttrain.planner.hardware import detect
from disttrain.planner.hardware import hardware as make_hardware
from disttrain.planner.spec import ModelSpec, model_spec

log = logging.getLogger(__name__)


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
             gpus_per_node: int, available: Iterable[str]) -> Plan:
    """The plan on the devices present, limited to the ``available`` (registered) strategy names; every rank
    computes the same one (the inputs are the same on every rank: total, not free, memory)."""
    spec = spec_of(source) if isinstance(source, nn.Module) else model_spec(source)
    if options.hardware is not None:
        hw = make_hardware(options.hardware, options.device_memory, gpus_per_node=gpus_per_node)
    else:
        hw = detect(device, world_size, gpus_per_node)
        if options.device_memory is not None:
            hw = hw.with_memory(options.device_memory)
    # The batch is the user's DataLoader's: 1 unless given or a recipe says (a run cannot take a searched one).
    micro_batch = options.micro_batch or (None if "micro_batch" in spec.extra.get("recipe", {}) else 1)
    plan = choose(spec, world_size, hw, micro_batch=micro_batch, seq_len=options.seq_len,
                  precision=planned_precision(precision), headroom=options.headroom,
                  available=available, activation_checkpointing=options.activation_checkpointing, loader_batch=True)
    if options.trial and plan.choice is not None:
        from disttrain.planner.trial import trial_once

        trial_once(plan, source, options.trial_top, options.trial_steps, device.type)
    if plan.choice is None:
        raise RuntimeError("disttrain_auto: no registered strategy fits this model on these devices:\n"
                           + plan.report())
    return plan

