"""Activation checkpointing per block: recompute each block's activations in backward instead of storing them."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper


def apply_ac(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Wrap every block in torch's checkpoint_wrapper, in place; returns the wrappers (the new FSDP units).

    The wrapper adds ``_checkpoint_wrapped_module`` to parameter names; torch.distributed.checkpoint's state-dict
    functions strip it, so checkpoints and exports keep the plain names.
    """
    wanted = {id(b) for b in blocks}
    wrapped: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in wanted:
                wrapper = checkpoint_wrapper(child)
                setattr(parent, name, wrapper)  # works for ModuleList/Sequential indices too ("0", "1", ...)
                wrapped[id(child)] = wrapper
    # HF models append to their KV cache again during recompute; training never needs the cache. (The model may
    # be inside a container, a LightningModule: every HF config in it.)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False
    return [wrapped[id(b)] for b in blocks]


def has_ac(model: nn.Module) -> bool:
    """Whether blocks of ``model`` are wrapped for activation checkpointing already (a model set up before)."""
    return any(isinstance(m, CheckpointWrapper) for m in model.modules())
