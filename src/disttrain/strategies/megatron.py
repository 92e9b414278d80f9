"""``disttrain_megatron`` for the Lightning Trainer: tensor x pipeline x data parallelism."""

from __future__ import annotations

from disttrain.parallel.engines.megatron import MegatronEngine
from disttrain.strategies.base import EngineStrategy


class MegatronStrategy(EngineStrategy):
    """Megatron-style 3D parallelism for ``lightning.Trainer``; CUDA (nccl) and CPU (gloo).

    ``MegatronStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="1f1b",
    microbatches=4)``; data parallel (FSDP2) takes the remaining ranks. Options:
    :class:`disttrain.parallel.engines.megatron.MegatronOptions`.

    Under pipeline parallelism ``training_step`` stays as it is: ``self.model(input_ids=..., labels=...)`` on an HF
    causal LM runs the whole schedule and returns the mean loss on every rank. A model whose loss is computed
    outside it (a ViT) needs the module to define ``loss_fn(output, target)`` and compute the loss as
    ``self.loss_fn(self.model(x), y)``; validation runs the pipeline forward-only and returns the outputs on every
    rank. Gradient accumulation under PP is the schedule's microbatches (``accumulate_grad_batches`` must be 1).
    """

    strategy_name = "disttrain_megatron"
    engine_cls = MegatronEngine
