"""Gradient accumulation at a fixed global batch: the number of micro-steps follows the world size."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

from disttrain.parallel.engines.layout import Accumulation, Layout


def accumulation_steps(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Micro-steps per optimizer step so that micro x data-parallel ranks x steps = the global batch."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size < 1 or micro_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} and micro_batch_size={micro_batch_size} must be"
                         " positive")
    if global_batch_size % per_step:
        lower, upper = global_batch_size // per_step * per_step, (global_batch_size // per_step + 1) * per_step
        nearby = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by micro_batch_size x data-parallel ranks ="
            f" {micro_batch_size} x {data_parallel_size} = {per_step}; choose a multiple of {per_step}"
            f" (e.g. {nearby}) or another micro batch size")
    return global_batch_size // per_step


def data_parallel_ranks(strategy: Any, world_size: int) -> int:
    """Ranks that see different data (context/tensor/pipeline ranks of one replica share a batch): a disttrain
    strategy's degrees once its processes exist, else its (or Lightning's) sampler arguments, else the world."""
    dims = getattr(getattr(strategy, "engine", None), "dims", None)
    if dims is not None:
        return dims.dp
    try:
        return int(strategy.distributed_sampler_kwargs["num_replicas"])
    except (AttributeError, KeyError, TypeError, RuntimeError, AssertionError):
        return world_size


def layout_of(strategy: Any) -> Optional[Layout]:
    """How a disttrain strategy's engine holds the model (:mod:`disttrain.parallel.engines.layout`: what it can do
    with precision, accumulation and gradients), or None for a strategy without an engine (Lightning's own)."""
    engine = getattr(strategy, "engine", None)
    return engine.layout(engine.options) if engine is not None else None


def accumulates_itself(strategy: Any) -> bool:
    """Whether the strategy's engine accumulates gradients inside itself from its batch settings (DeepSpeed): it
    divides the loss by them and decides the step boundary."""
    layout = layout_of(strategy)
    return layout is not None and layout.can.accumulation is Accumulation.ENGINE


def count_loss_tokens(batch: Any) -> int:
    """Tokens that carry a loss in a batch: ``labels != -100`` if the batch has labels, else every input id."""
    if isinstance(batch, dict):
        if "labels" in batch:
            return int((batch["labels"] != -100).sum())
        batch = batch.get("input_ids", next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return int(batch.numel())


class GradientAccumulation(L.Callback):
    """Keep the global batch at ``global_batch_size`` whatever the number of devices.

    Trainer: ``Trainer(callbacks=[GradientAccumulation(global_batch_size=512)])`` sets ``accumulate_grad_batches`` =
    global / (micro batch x data-parallel ranks) before the model is set up (so ``disttrain_zero3`` builds its
    DeepSpeed config with it). Gradients are not synchronised on non-final micro-steps (the strategy's
    ``block_backward_sync``: DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``). The micro batch is
    the train DataLoader's ``batch_size`` unless given.

    Fabric (a plain object): call ``steps = acc.attach(fabric, micro_batch_size)`` before ``fabric.launch()`` (it
    also feeds ``disttrain_zero3``'s config), then per micro-step ``with acc.micro_step(fabric, model, i):
    fabric.backward(acc.scale(fabric, loss))`` and step the optimizer when ``acc.is_last(i)``.

    ``normalize_by_tokens=True`` (LLM training): ``training_step`` returns the *sum* of its token losses (e.g.
    ``cross_entropy(..., reduction="sum")``); the accumulated gradients are divided by the number of loss tokens
    of the whole step (all micro-steps, all ranks), so every token weighs the same however the tokens fall into
    micro-batches. ``tokens_fn(batch)`` counts them (default: ``labels != -100``). Not with an engine that owns the
    gradients (``disttrain_zero3``: DeepSpeed's).
    """

    def __init__(self, global_batch_size: int, micro_batch_size: Optional[int] = None,
                 normalize_by_tokens: bool = False, tokens_fn: Callable[[Any], int] = count_loss_tokens) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.normalize_by_tokens = normalize_by_tokens
        self.tokens_fn = tokens_fn
        self.steps: Optional[int] = None
        self._tokens = 0

    # -- Trainer -------------------------------------------------------------------------------------------
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        if any(type(cb).__name__ == "GradientAccumulationScheduler" for cb in trainer.callbacks):
            raise ValueError("GradientAccumulation and GradientAccumulationScheduler both set the accumulation;"
                             " keep one of them")
        micro = self.micro_batch_size or self._loader_batch_size(trainer)
        self.steps = accumulation_steps(self.global_batch_size, micro,
                                        data_parallel_ranks(trainer.strategy, trainer.world_size))
        if trainer.accumulate_grad_batches not in (1, self.steps):
            raise ValueError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) contradicts"
                             f" GradientAccumulation(global_batch_size={self.global_batch_size}) which needs"
                             f" {self.steps}; drop accumulate_grad_batches from the Trainer")
        layout = layout_of(trainer.strategy)
        if self.normalize_by_tokens and layout is not None and layout.can.owns_gradients:
            name = getattr(trainer.strategy.engine, "name", type(trainer.strategy).__name__)
            raise ValueError(f"normalize_by_tokens needs the gradients, which the library's own engine owns under"
                             f" {name} (DeepSpeed); use disttrain_fsdp or disttrain_ddp, or"
                             " normalize_by_tokens=False")
        trainer.accumulate_grad_batches = self.steps

    @staticmethod
    def _loader_batch_size(trainer: "L.Trainer") -> int:
        source = trainer.fit_loop._data_source
        loader = source.dataloader() if source.is_defined() else None
        size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size",
                                                              None)
        if not size:
            raise ValueError("GradientAccumulation cannot read the micro batch size from the train DataLoader"
                             " (batch_size=None); pass micro_batch_size=")
        return int(size)

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.normalize_by_tokens:
            self._tokens += self.tokens_fn(batch)

    def on_before_optimizer_step(self, trainer: "L.Trainer", pl_module: "L.LightningModule", optimizer: Any) -> None:
        if self.normalize_by_tokens:
            # Lightning divided each micro-step's loss by the accumulation and the strategy averaged over ranks:
            # undo both, then divide by the step's token count (summed over ranks).
            self._rescale(pl_module.parameters(), trainer.world_size, trainer.accumulate_grad_batches)

    # -- Fabric --------------------------------------------------------------------------------------------
    def attach(self, fabric: "L.Fabric", micro_batch_size: Optional[int] = None) -> int:
        """Compute the micro-steps for this Fabric; call before ``fabric.launch()``. Returns the count."""
        micro = micro_batch_size or self.micro_batch_size
        if not micro:
            raise ValueError("GradientAccumulation.attach needs micro_batch_size= (Fabric has no DataLoader yet)")
        self.steps = accumulation_steps(self.global_batch_size, micro,
                                        data_parallel_ranks(fabric.strategy, fabric.world_size))
        if accumulates_itself(fabric.strategy):  # e.g. DeepSpeed: inside its engine, from its config
            options = fabric.strategy.engine.options
            options.micro_batch_size, options.gradient_accumulation_steps = micro, self.steps
            if getattr(fabric.strategy, "_config_initialized", False) and \
                    fabric.strategy.config.get("gradient_accumulation_steps") != self.steps:
                # Under `lightning run model` Fabric() already built the config; the engine reads it only at
                # fabric.setup(), so it can be rebuilt until then.
                if getattr(fabric, "_models_setup", 0):
                    raise RuntimeError("GradientAccumulation.attach came after fabric.setup(); call it before")
                fabric.strategy._format_config()
        return self.steps

    def is_last(self, micro_step: int) -> bool:
        assert self.steps is not None, "attach() first"
        return (micro_step + 1) % self.steps == 0

    def scale(self, fabric: "L.Fabric", loss: torch.Tensor) -> torch.Tensor:
        """The micro-step's share of the loss: ``loss / steps``, except under an engine that accumulates itself
        (``disttrain_zero3``), which divides by its gradient_accumulation_steps."""
        assert self.steps is not None, "attach() first"
        return loss if accumulates_itself(fabric.strategy) else loss / self.steps

    @contextmanager
    def micro_step(self, fabric: "L.Fabric", model: torch.nn.Module, micro_step: int) -> Iterator[None]:
        """Skips gradient synchronisation unless this is the last micro-step of the optimizer step."""
        if accumulates_itself(fabric.strategy):
            yield  # the engine decides the boundary itself
            return
        with fabric.no_backward_sync(model, enabled=not self.is_last(micro_step)):
            yield

    # -- token normalisation ----------------------------------------------------------------------------------
    def _rescale(self, parameters: Iterator[torch.nn.Parameter], world_size: int, accumulation: int) -> None:
        tokens = torch.tensor(float(self._tokens))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(tokens)
        self._tokens = 0
        factor = world_size * accumulation / max(tokens.item(), 1.0)
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(factor)
