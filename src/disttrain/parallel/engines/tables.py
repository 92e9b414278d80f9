"""torchrec embedding tables inside a model: found, refused by the strategies that cannot shard them, and left out
of the dense optimizer (torch only; torchrec is imported only when a model can hold its tables)."""

from __future__ import annotations

import sys

from torch import nn


def is_embedding_module(module: nn.Module) -> bool:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
        return True
    try:
        from torchrec.distributed.types import ShardedModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, ShardedModule)


def has_torchrec_tables(module: nn.Module) -> bool:
    """Whether ``module`` holds torchrec embedding tables (plain or already sharded)."""
    if "torchrec" not in sys.modules:
        # No table can exist without torchrec imported. Importing it here would also be wrong: under DeepSpeed it
        # can run after zero.Init patched nn.Module subclassing, and torchrec's Generic modules then fail to build.
        return False
    try:
        return any(is_embedding_module(m) for m in module.modules())
    except ImportError:  # torchrec not installed: no module can hold its tables
        return False


def refuse_torchrec_tables(module: nn.Module, strategy_name: str) -> None:
    """Raise a clear error when a non-recsys strategy is given a model with torchrec tables: DDP/FSDP/ZeRO would
    replicate or flatten the tables (and wrap a DistributedModelParallel a second time)."""
    if has_torchrec_tables(module):
        raise TypeError(
            f"strategy {strategy_name!r} cannot train a model with torchrec embedding tables"
            f" ({type(module).__name__}); use strategy='disttrain_recsys', which shards the tables with"
            " DistributedModelParallel and keeps the dense part data-parallel")


def dense_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters outside torchrec's embedding modules: what the dense optimizer (Adam) updates. The tables
    are updated by the fused optimizer inside backward."""
    skip: set[int] = set()
    for m in module.modules():
        if is_embedding_module(m):
            skip.update(id(p) for p in m.parameters())
    return [p for p in module.parameters() if id(p) not in skip and p.requires_grad]
