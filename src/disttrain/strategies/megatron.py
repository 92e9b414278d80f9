"""``disttrain_megatron`` for the Lightning Trainer: tensor x pipeline x data parallelism, an adapter over
MegatronEngine (everything else is the FSDP adapter's)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from disttrain.parallel.megatron import MegatronEngine, MegatronOptions
from disttrain.strategies.fsdp import FSDPStrategy


class MegatronStrategy(FSDPStrategy):
    """Megatron-style 3D parallelism for ``lightning.Trainer``; CUDA (nccl) and CPU (gloo).

    ``MegatronStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="1f1b",
    microbatches=4)``; data parallel (FSDP2) takes the remaining ranks. Options:
    :class:`disttrain.parallel.megatron.MegatronOptions`.

    Under pipeline parallelism ``training_step`` stays as it is: ``self.model(input_ids=..., labels=...)`` on an HF
    causal LM runs the whole schedule and returns the mean loss on every rank. A model whose loss is computed
    outside it (a ViT) needs the module to define ``loss_fn(output, target)`` and compute the loss as
    ``self.loss_fn(self.model(x), y)``; validation runs the pipeline forward-only and returns the outputs on every
    rank. Gradient accumulation under PP is the schedule's microbatches (``accumulate_grad_batches`` must be 1).
    """

    strategy_name = "disttrain_megatron"
    _engine_cls, _options_cls = MegatronEngine, MegatronOptions

    def setup(self, trainer: "pl.Trainer") -> None:
        if self.engine.options.pipeline_parallel_size > 1 and trainer.accumulate_grad_batches > 1:
            raise ValueError(f"accumulate_grad_batches={trainer.accumulate_grad_batches} with pipeline parallelism:"
                             " the schedule already accumulates over microbatches; set accumulate_grad_batches=1"
                             " and raise microbatches (and the batch size) instead")
        super().setup(trainer)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning clears gradients after training_step, right before backward; the pipeline schedule runs its
        # backward inside training_step, so clear them before it instead (the loss's backward puts them back).
        if self.engine.pipeline is not None:
            assert self.model is not None
            for param in self.model.parameters():
                param.grad = None
        return super().training_step(*args, **kwargs)
