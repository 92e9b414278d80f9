"""disttrain: large-model distributed strategies for PyTorch Lightning (Trainer) and Lightning Fabric.

``import disttrain`` registers every implemented ``disttrain_*`` strategy name in both Lightning registries and lets
``MyModule.load_from_checkpoint`` read the checkpoint folders those strategies write.
"""

from disttrain import fabric, parallel, strategies
from disttrain.names import STRATEGIES
from disttrain.parallel.checkpoint import CheckpointError

__version__ = "0.1.0"


def register_strategies() -> list[str]:
    """Register every name of the name table in the Trainer's and Fabric's registries, and let Lightning's
    ``load_from_checkpoint`` read the checkpoint folders those strategies write (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from disttrain.checkpoint_loading import install_load_from_checkpoint

    install_load_from_checkpoint()

    for module, registry in ((strategies, StrategyRegistry), (fabric, STRATEGY_REGISTRY)):
        for cls in {getattr(module, cls_name) for _, cls_name, _, _ in STRATEGIES}:
            cls.register_strategies(registry)
    return [name for name, *_ in STRATEGIES]


register_strategies()

from disttrain import nlp  # noqa: E402  (domain trainers, after the names are registered)

__all__ = ["CheckpointError", "STRATEGIES", "fabric", "parallel", "register_strategies", "strategies"]
