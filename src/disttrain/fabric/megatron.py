"""``disttrain_megatron`` for Lightning Fabric: tensor x pipeline x data parallelism."""

from __future__ import annotations

from disttrain.fabric.base import EngineStrategy
from disttrain.parallel.engines.megatron import MegatronEngine


class MegatronStrategy(EngineStrategy):
    """Megatron-style 3D parallelism for ``lightning.Fabric``; options as on the Trainer strategy
    (:class:`disttrain.parallel.engines.megatron.MegatronOptions`).

    Under pipeline parallelism an HF causal LM is called as usual, ``model(input_ids=..., labels=...).loss``;
    other models are called as ``model(x, target=y)`` and return the loss (pass ``loss_fn=`` through the model's
    ``pipeline.loss_fn`` or give the strategy a module with ``loss_fn``). ``fabric.backward(loss)`` is then a
    no-op: the schedule already ran backward. Create optimizers after ``fabric.setup`` or before it: parameters
    of other stages are dropped from them.
    """

    strategy_name = "disttrain_megatron"
    engine_cls = MegatronEngine
