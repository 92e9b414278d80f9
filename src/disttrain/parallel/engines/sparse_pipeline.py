"""torchrec's sparse-dist training pipeline for ``disttrain_recsys`` (``pipeline="sparse_dist"``), in torch terms.

A sharded table's lookup starts with an input all-to-all: each rank sends the ids of its batch to the ranks holding
their tables (a splits exchange, then the ids and lengths). torchrec's ``TrainPipelineSparseDist`` starts that
exchange for batch i+1 before batch i's forward and leaves it in flight through i's backward, so the lookup of
i+1 finds its ids already delivered. The arithmetic is the plain loop's, in the same order: losses and weights are
the same bit for bit.

How the pipeline reaches a model: torchrec traces the network (``torch.fx``) to find the sharded table modules fed
straight from the batch, and replaces their ``forward`` with one that takes the delivered ids from the pipeline.
The batch the pipeline moves is a :class:`TableBatch` (or any ``Pipelineable``) whose attributes are named after
the network's ``forward`` arguments (``DeepFMNet.forward(dense, sparse)``: ``batch.dense``, ``batch.sparse``).

Two drivers of the one pipeline:

- the Trainer's, :class:`SteppedPipeline`: Lightning keeps its loop (forward in ``training_step``, backward,
  optimizer step, logging, callbacks); the strategy hands the pipeline each batch as the loader gives it
  (:meth:`SteppedPipeline.add`, one batch ahead of the step, as Lightning prefetches) and steps it around the
  forward (:meth:`~SteppedPipeline.before_forward`, :meth:`~SteppedPipeline.after_forward`), in torchrec's order;
- Fabric's, :func:`train_pipeline`: torchrec's own ``progress(dataloader_iter)`` (forward, backward, optimizer step).
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any, Callable, Optional

import torch
from torch import nn

PIPELINES = ("sparse_dist", "none")


def _pipelineable() -> type:
    from torchrec.streamable import Pipelineable

    return Pipelineable


class TableBatch:
    """One batch as the pipeline moves it: ``dense`` (B, F) float, ``sparse`` (a ``KeyedJaggedTensor``), ``labels``
    (B,); ``source``: the batch the loader gave (what a LightningModule's ``training_step`` receives)."""

    def __init__(self, dense: torch.Tensor, sparse: Any, labels: torch.Tensor, source: Any = None) -> None:
        self.dense, self.sparse, self.labels, self.source = dense, sparse, labels, source

    def to(self, device: torch.device, non_blocking: bool = False) -> "TableBatch":
        return TableBatch(self.dense.to(device, non_blocking=non_blocking),
                          self.sparse.to(device, non_blocking=non_blocking),
                          self.labels.to(device, non_blocking=non_blocking), self.source)

    def record_stream(self, stream: Any) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "TableBatch":
        return TableBatch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory(), self.source)


def _register_pipelineable() -> None:
    # torchrec checks batches against its Pipelineable ABC; TableBatch implements it without importing torchrec
    # (seconds) when this module is imported.
    _pipelineable().register(TableBatch)


class _CalledOnBatch(nn.Module):
    """What torchrec traces: ``net`` called with the batch's attributes named after its ``forward`` arguments."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.names = [name for name in inspect.signature(net.forward).parameters]

    def forward(self, batch: Any) -> Any:
        return self.net(*[getattr(batch, name) for name in self.names])


def _unwrapped(net: nn.Module) -> nn.Module:
    """The network inside a DistributedModelParallel (and its DDP), with its sharded modules."""
    return getattr(net, "module", net)


class _Pipeline:
    """torchrec's ``TrainPipelineSparseDist`` over ``net`` (a DistributedModelParallel), imported on first use."""

    @staticmethod
    def build(net: nn.Module, device: torch.device, optimizer: Any = None, model_fwd: Any = None,
              backward: Optional[Callable[[torch.Tensor], None]] = None) -> Any:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        _register_pipelineable()

        class Pipeline(TrainPipelineSparseDist):
            def _backward(self, losses: torch.Tensor) -> None:
                backward(losses) if backward is not None else super()._backward(losses)

        traced = _CalledOnBatch(_unwrapped(net))
        traced.train(net.training)
        return Pipeline(traced, optimizer, device, execute_all_batches=True, custom_model_fwd=model_fwd)


def check_pipelined(pipeline: Any, net: nn.Module) -> None:
    """One line when torchrec found no table module fed straight from the batch (nothing would overlap)."""
    if not pipeline._pipelined_modules:
        raise ValueError(f"pipeline='sparse_dist' found no sharded table module in {type(_unwrapped(net)).__name__}"
                         " called on one of its forward arguments (torchrec pipelines only those); pass the"
                         " KeyedJaggedTensor straight to the tables, or set pipeline='none'")


class SteppedPipeline:
    """The Trainer's driver: torchrec's pipeline stepped around Lightning's own training step.

    ``to_batch(batch) -> TableBatch`` turns what the loader gives into the pipeline's batch (a LightningModule's
    ``pipeline_batch``). The strategy calls :meth:`add` for every training batch in loader order, then, for each
    step, :meth:`before_forward` with the batch Lightning passes to ``training_step`` and :meth:`after_forward`
    after it, before backward. :meth:`pause` (validation) and :meth:`finish` (end of fit) give the tables their own
    forward back."""

    def __init__(self, net: nn.Module, device: torch.device, to_batch: Callable[[Any], Any]) -> None:
        self.net = net
        self.to_batch = to_batch
        self.pipeline = _Pipeline.build(net, device)
        self.sources: deque[Any] = deque()  # the loader's batches in the pipeline, oldest (this step's) first
        self.started = False

    def add(self, batch: Any) -> None:
        """A training batch the loader handed out (Lightning fetches one ahead of the step)."""
        self.pipeline.enqueue_batch(iter([self.to_batch(batch)]))
        self.sources.append(batch)

    def before_forward(self, batch: Any) -> None:
        """Before the forward of ``batch``: its ids are delivered (or, at the first step, fetched now) and the next
        batch's splits exchange starts."""
        p = self.pipeline
        if not self.sources or not _same_batch(self.sources[0], batch):
            raise RuntimeError("pipeline='sparse_dist': the training step's batch is not the next one the loader"
                               " gave the pipeline; set pipeline='none' for loops that skip or reorder batches")
        if not self.started:  # the first step, or the first after validation: trace (once) and deliver batch i
            if p._pipelined_modules:
                p.attach(sparse_dist=False)
                p._set_module_context(p.contexts[0])
                if not p.contexts[0].input_dist_tensors_requests:
                    p.start_sparse_data_dist(p.batches[0], p.contexts[0])
                    p.wait_sparse_data_dist(p.contexts[0])
            else:
                p._init_pipelined_modules(p.batches[0], p.contexts[0], p._pipelined_forward_type)
                check_pipelined(p, self.net)
                p.wait_sparse_data_dist(p.contexts[0])
            self.started = True
        if len(p.batches) >= 2 and not p.contexts[1].input_dist_splits_requests \
                and not p.contexts[1].input_dist_tensors_requests:
            p.start_sparse_data_dist(p.batches[1], p.contexts[1])  # batch i+1: the splits exchange

    def after_forward(self) -> None:
        """After the forward, before backward: batch i+1's ids and lengths go out, in flight through backward."""
        p = self.pipeline
        if len(p.batches) >= 2 and p.contexts[1].fused_splits_awaitables:
            p.wait_sparse_data_dist(p.contexts[1])
        p.dequeue_batch()
        self.sources.popleft()

    def pause(self) -> None:
        """The tables' own forward (validation, evaluation); batches in flight stay and resume at the next step."""
        if self.started:
            self.pipeline.detach()
            self.started = False

    def finish(self) -> None:
        """End of fit: wait for every exchange still in flight (on every rank alike, as the steps were) and give
        the tables their own forward back."""
        p = self.pipeline
        for context in p.contexts:
            if context.fused_splits_awaitables:
                p.wait_sparse_data_dist(context)
            for request in context.input_dist_tensors_requests.values():
                request.wait()
        self.pause()
        if p._pipelined_modules and p._model_attached:
            p.detach()
        p.reset()
        self.sources.clear()


def _same_batch(a: Any, b: Any) -> bool:
    """The loader's batch and the one Lightning passes to the step: the same object, or its copy on the device
    (Lightning moves batches after fetching): the same structure of tensors of the same shapes."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_batch(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_batch(a[k], b[k]) for k in a)
    return type(a) is type(b)


def train_pipeline(net: nn.Module, optimizer: Any, device: torch.device,
                   step: Callable[[Any], tuple[torch.Tensor, Any]],
                   backward: Optional[Callable[[torch.Tensor], None]] = None, overlap: bool = True) -> Any:
    """torchrec's pipeline for a hand-written loop (Fabric): ``pipeline.progress(batches)`` takes the next batch of
    the iterator ``batches`` (``TableBatch``es), runs ``step(batch) -> (loss, output)``, ``backward(loss)`` and
    ``optimizer.step()``, and returns ``output``; it raises ``StopIteration`` when the batches are done.
    ``overlap=False``: torchrec's plain ``TrainPipelineBase`` (the same calls, no overlap)."""
    if overlap:
        return _Pipeline.build(net, device, optimizer, model_fwd=step, backward=backward)
    from torchrec.distributed.train_pipeline import TrainPipelineBase

    _register_pipelineable()

    class Plain(TrainPipelineBase):
        def _backward(self, losses: torch.Tensor) -> None:
            backward(losses) if backward is not None else super()._backward(losses)

    return Plain(_Step(net, step), optimizer, device)


class _Step(nn.Module):
    """``step`` as the model torchrec's plain pipeline calls (it has no ``custom_model_fwd``); training when
    ``net`` is."""

    def __init__(self, net: nn.Module, step: Callable[[Any], tuple[torch.Tensor, Any]]) -> None:
        super().__init__()
        self.net, self.step = net, step

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        self.training = self.net.training
        return self.step(batch)
