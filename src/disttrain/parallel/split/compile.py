"""Compiled blocks: ``torch.compile`` on each repeated block (``compile=True`` of disttrain_ddp, fsdp, megatron).

Each block is compiled on its own, as torchtitan does: the blocks share one graph (the same code on the same shapes),
so the compile time is that of one block whatever the depth, and nothing outside the blocks (embeddings, the loss, a
user's ``training_step``) is traced. Order: tensor parallel -> activation checkpointing -> compile -> FSDP / DDP.
The block's own ``compile()`` (``nn.Module.compile``, torch's regional compilation) keeps the module and its
parameter names, so checkpoints, exports and pretrained loading see the same model. FSDP2's gather and reshard hooks
are ``torch._dynamo``-disabled by torch: they run eagerly around the graph, never inside it; DDP's gradient hooks
fire on the parameters after the compiled backward, as they do eagerly.

The compiled code is cached on disk (inductor's FX graph cache and AOTAutograd's cache, both on by default) under
``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``): a second run of the same model compiles from the
cache. Point it at a persistent folder on machines whose ``/tmp`` is cleared.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn


def compile_blocks(blocks: list[nn.Module], dynamic: Optional[bool] = None) -> list[nn.Module]:
    """Compile each of ``blocks`` in place (the wrappers of activation checkpointing when it is on); returns them.
    A block compiled before (a model set up again) is left as it is. ``dynamic``: torch.compile's (None: static
    shapes first, symbolic ones after a shape changes; False: a static graph per shape)."""
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(dynamic=dynamic)
            block._compiled_call_impl = _tracing_checkpointed(block._compiled_call_impl)
    return blocks


def _tracing_checkpointed(compiled: Callable) -> Callable:
    """``compiled`` traced with Python side effects of a checkpointed forward allowed, not replayed when the
    backward recomputes it. Without this, one context-variable write in the block (transformers >= 5.25 wraps
    Llama's attention in ``kernels``' forward, which sets and resets one) breaks the checkpointed graph and the whole
    block falls back to eager. The flag is read while tracing, so it is set around each call (a no-op once traced);
    a block's tensor work is recomputed exactly as eagerly."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return compiled(*args, **kwargs)

    return call


def is_compiled(model: nn.Module) -> bool:
    """Whether a module of ``model`` was compiled by :func:`compile_blocks` (or ``nn.Module.compile``)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


__all__ = ["compile_blocks", "is_compiled"]
