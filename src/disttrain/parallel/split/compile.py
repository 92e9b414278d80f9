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

from typing import Optional

from torch import nn


def compile_blocks(blocks: list[nn.Module], dynamic: Optional[bool] = None) -> list[nn.Module]:
    """Compile each of ``blocks`` in place (the wrappers of activation checkpointing when it is on); returns them.
    A block compiled before (a model set up again) is left as it is. ``dynamic``: torch.compile's (None: static
    shapes first, symbolic ones after a shape changes; False: a static graph per shape)."""
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(dynamic=dynamic)
    return blocks


def is_compiled(model: nn.Module) -> bool:
    """Whether a module of ``model`` was compiled by :func:`compile_blocks` (or ``nn.Module.compile``)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


__all__ = ["compile_blocks", "is_compiled"]
