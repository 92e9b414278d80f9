"""Pipeline parallelism with ``torch.distributed.pipelining``, made to look like a plain ``model(...)`` call.

The model's blocks are split into stages (balanced by parameter count, or at explicit block indices); each rank
keeps only the stages it runs and drops every other parameter. The model object stays the user's model (the
same class, the same fully qualified parameter names, so checkpoints keep their keys); only its ``forward``
becomes the pipeline: ``model(input_ids=..., labels=...)`` runs the schedule (forward and backward of every
microbatch) and returns the mean loss on every rank of the pipeline, whose ``backward()`` does nothing because
the schedule already did it.

The stages are the model family's (:mod:`disttrain.parallel.families`): HF Llama-family causal LMs and GPT-2 (the
loss comes from ``labels`` as in HF), BERT-style encoders for sequence classification (``model(input_ids=...,
labels=...)``, HF's classification loss), and timm's VisionTransformer (the loss function comes from the caller:
``model(images, target=labels)``, or deferred through :meth:`Pipeline.defer_loss`, which is how a LightningModule's
``loss_fn`` hook is wired). Encoder-decoder models (T5, BART) are refused.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from disttrain.parallel.families import Family, family_of, unsupported_reason

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage runs: ``bounds[s] = (first block, end block)``; stage s lives on pp rank s % pp."""

    bounds: tuple[tuple[int, int], ...]
    pp: int

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if s % self.pp == pp_rank]


def plan_stages(block_sizes: Sequence[int], pp: int, virtual_stages: int = 1, first_extra: int = 0,
                last_extra: int = 0, split_points: Optional[Sequence[int]] = None) -> StagePlan:
    """Split ``len(block_sizes)`` blocks into ``pp * virtual_stages`` stages.

    ``split_points`` are the block indices where stages 1, 2, ... start. Without them, stages are balanced by
    parameter count, counting the embeddings (``first_extra``) with the first stage and the head with the last.
    """
    n_stages = pp * virtual_stages
    n_blocks = len(block_sizes)
    if n_blocks < n_stages:
        raise ValueError(f"{n_blocks} blocks cannot fill pipeline_parallel_size*virtual_stages={n_stages} stages;"
                         f" choose at most {n_blocks} stages in all")
    if split_points is not None:
        points = list(split_points)
        if len(points) != n_stages - 1 or points != sorted(set(points)) or not all(0 < p < n_blocks for p in points):
            raise ValueError(f"split_points={points} must be {n_stages - 1} increasing block indices between 1 and"
                             f" {n_blocks - 1} (where stages 1..{n_stages - 1} start)")
    else:
        sizes = list(block_sizes)
        sizes[0] += first_extra
        sizes[-1] += last_extra
        total = sum(sizes)
        points, running = [], 0
        for i, size in enumerate(sizes[:-1]):
            running += size
            stage = len(points) + 1
            left_blocks, left_stages = n_blocks - (i + 1), n_stages - stage
            target = total * stage / n_stages
            # Cut where the stage comes closest to its share, or when the remaining blocks are just enough for the
            # remaining stages.
            closest = abs(running - target) <= abs(running + sizes[i + 1] - target)
            if stage < n_stages and (closest or left_blocks == left_stages):
                points.append(i + 1)
        points = points[: n_stages - 1]
    edges = [0, *points, n_blocks]
    return StagePlan(tuple(zip(edges[:-1], edges[1:])), pp)


def pipeline_family(model: nn.Module) -> Family:
    """The family whose stages ``model`` splits into (see :mod:`disttrain.parallel.families`); refuses others."""
    family = family_of(model)
    if family is not None:
        return family
    if reason := unsupported_reason(model):
        raise ValueError(f"pipeline parallelism: {reason}")
    raise ValueError(f"pipeline parallelism knows how to split HF causal LMs whose config declares a pipeline plan,"
                     f" GPT2LMHeadModel, BERT-style sequence classifiers and timm VisionTransformers, not"
                     f" {type(model).__name__}")


def block_sizes(model: nn.Module) -> tuple[list[int], int, int]:
    """Parameters per block, plus those of the first stage's embeddings and the last stage's head: the weights
    that balance the stages (matmul parameters stand for compute)."""
    return pipeline_family(model).pipeline_sizes(model)


def split_model(model: nn.Module, plan: StagePlan, pp_rank: int) -> list[nn.Module]:
    """Prune ``model`` in place to the stages of ``pp_rank`` and return their stage modules (in stage order)."""
    return pipeline_family(model).split(model, plan, pp_rank)


class _ScheduleDidBackward(torch.autograd.Function):
    """The pipeline loss handed to the training loop: its value is the mean microbatch loss, and its backward runs
    nothing (the schedule already ran every microbatch's backward) except putting back gradients that were
    cleared in between: Lightning's automatic optimization calls ``zero_grad`` after ``training_step`` and before
    ``backward``, and the schedule ran inside ``training_step``."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, anchor: torch.Tensor, pipeline: "Pipeline") -> torch.Tensor:
        ctx.pipeline = pipeline
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.pipeline.restore_gradients()
        return None, None, None


class Pipeline:
    """Runs a model's stages on this rank with a ``torch.distributed.pipelining`` schedule.

    Installed on the model by :func:`pipeline_model`; reach it as ``model.pipeline``.
    """

    def __init__(self, model: nn.Module, stage_modules: list[nn.Module], plan: StagePlan, pp_mesh: DeviceMesh,
                 device: torch.device, schedule: str, microbatches: int,
                 loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None) -> None:
        self.model = model
        self.family = pipeline_family(model)
        self.plan = plan
        self.group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.device = device
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.stage_ids = plan.stages_of(self.pp_rank)
        self.stage_modules = stage_modules
        self.loss_fn = loss_fn
        self._pending: Optional[tuple[tuple, dict]] = None
        self._pending_marker = torch.empty(0)
        self._anchor = torch.zeros((), requires_grad=True)
        self.last_rank = (plan.num_stages - 1) % plan.pp
        self._schedules: dict[bool, Any] = {}
        self._gradients: list[tuple[nn.Parameter, torch.Tensor]] = []

    # -- what runs where -------------------------------------------------------------------------------------
    @property
    def owns_loss(self) -> bool:
        """The model computes its loss from labels itself (HF causal LMs, BERT classifiers); else a loss_fn."""
        return self.family.hf_loss

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_ids

    def stray_parameters(self) -> list[nn.Parameter]:
        """Parameters of the model no stage module owns (timm's cls_token/pos_embed): replicated, their gradients
        averaged over data parallel by :meth:`reduce_stray_gradients`."""
        owned = {id(p) for m in self.stage_modules for p in m.parameters()}
        return [p for p in self.model.parameters() if id(p) not in owned]

    def _schedule(self, with_loss: bool) -> Any:
        if with_loss not in self._schedules:
            stages = [PipelineStage(m, s, self.plan.num_stages, self.device, group=self.group)
                      for m, s in zip(self.stage_modules, self.stage_ids)]
            cls = SCHEDULES[self.schedule_name]
            loss = self._compute_loss if with_loss else None
            if issubclass(cls, PipelineScheduleMulti):
                self._schedules[with_loss] = cls(stages, n_microbatches=self.microbatches, loss_fn=loss)
            else:
                self._schedules[with_loss] = cls(stages[0], n_microbatches=self.microbatches, loss_fn=loss)
        return self._schedules[with_loss]

    def _compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.owns_loss:
            return self.family.loss(self.model, output, target)
        if self.loss_fn is None:
            raise RuntimeError("the pipeline has no loss function: pass target= together with a loss_fn, or give"
                               " the LightningModule a loss_fn(output, target) method (the pipeline hook)")
        return self.loss_fn(output, target)

    def _check_batch(self, batch: int) -> None:
        if batch % self.microbatches:
            raise ValueError(f"the batch of {batch} samples does not split into microbatches={self.microbatches};"
                             f" use a batch size divisible by {self.microbatches} or change microbatches")

    def _broadcast_from_last(self, tensor: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """``tensor`` lives on the last stage's rank; every rank of the pipeline gets it."""
        src = dist.get_global_rank(self.group, self.last_rank)
        meta = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
        dist.broadcast_object_list(meta, src=src, group=self.group)
        shape, dtype = meta[0]
        out = tensor.detach().contiguous() if tensor is not None else torch.empty(shape, dtype=dtype,
                                                                                   device=like.device)
        dist.broadcast(out, src=src, group=self.group)
        return out

    # -- running ---------------------------------------------------------------------------------------------
    def run(self, inputs: torch.Tensor, target: Optional[torch.Tensor], train: bool) -> tuple[torch.Tensor, Any]:
        """One batch through the pipeline: ``(loss, outputs)`` on every rank; training also runs backward.

        Outputs (e.g. logits) are only gathered in evaluation; training returns ``outputs=None``."""
        self._check_batch(inputs.shape[0])
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": target} if self.has_last and target is not None else {}
        losses: list[torch.Tensor] = []
        if train:
            if target is None:
                raise ValueError("training through a pipeline needs labels/target: the last stage computes the loss")
            self._schedule(True).step(*args, losses=losses, **kwargs)
            self.reduce_stray_gradients()
            self._gradients = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
            outputs = None
        else:
            schedule = self._schedule(target is not None)
            result = schedule.eval(*args, losses=losses, **kwargs) if target is not None else \
                schedule.eval(*args)
            outputs = self._broadcast_from_last(result if self.has_last else None, inputs)
        local = torch.stack([l.detach().float() for l in losses]).mean() if losses else None
        loss = self._broadcast_from_last(local, inputs) if target is not None else None
        if loss is not None and train:
            loss = _ScheduleDidBackward.apply(loss, self._anchor, self)
        return loss, outputs

    def restore_gradients(self) -> None:
        """Give back the gradients of the last training step if ``zero_grad(set_to_none=True)`` dropped them."""
        for param, grad in self._gradients:
            if param.grad is None:
                param.grad = grad
        self._gradients = []

    def reduce_stray_gradients(self) -> None:
        """Finish the stray parameters' gradients as the schedule does for its stages' own: divide by the number
        of microbatches (each one's loss is a mean), then average over data parallel."""
        dp = getattr(self, "dp_group", None)
        dp_size = dist.get_world_size(dp) if dp is not None else 1
        for param in self.stray_parameters():
            if param.grad is None:
                continue
            param.grad /= self.microbatches * dp_size
            if dp_size > 1:
                dist.all_reduce(param.grad, group=dp)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's new ``forward``.

        HF causal LM: ``model(input_ids=..., labels=...)`` -> an HF output with ``loss`` (and ``logits`` in eval).
        Others: ``model(x, target=y)`` -> the loss; ``model(x)`` in eval -> outputs on every rank; ``model(x)`` in
        training -> a placeholder that :meth:`defer_loss`'s wrapped loss function turns into the pipeline loss.
        """
        train = self.model.training and torch.is_grad_enabled()
        if self.owns_loss:
            input_ids = kwargs.pop("input_ids", args[0] if args else None)
            labels = kwargs.pop("labels", None)
            for key in ("attention_mask", "position_ids", "token_type_ids"):
                value = kwargs.pop(key, None)
                if value is not None and not _is_trivial(key, value):
                    raise ValueError(f"pipeline parallelism runs full, unpadded sequences of one segment: {key} with"
                                     " padding, packed sequences or a second segment is not supported under"
                                     " pipeline_parallel_size > 1")
            kwargs.pop("use_cache", None)
            if kwargs:
                raise TypeError(f"arguments {sorted(kwargs)} are not supported by the pipelined model")
            return self.family.wrap_output(*self.run(input_ids, labels, train))
        inputs = args[0] if args else kwargs.pop("x")
        target = kwargs.pop("target", None)
        if train and target is None:
            self._pending = inputs
            return self._pending_marker
        loss, outputs = self.run(inputs, target, train)
        return loss if target is not None else outputs

    def defer_loss(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
        """Wrap a module's ``loss_fn(output, target)``: called on the placeholder that ``model(x)`` returned in
        training, it runs the pipeline on ``x`` with ``target`` and returns the mean loss; otherwise it is the
        plain loss function. This keeps ``loss = self.loss_fn(self.model(x), y)`` unchanged under PP."""
        self.loss_fn = loss_fn

        def pipelined_loss(output: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if output is self._pending_marker:
                inputs, self._pending = self._pending, None
                return self.run(inputs, target, train=True)[0]
            return loss_fn(output, target, *args, **kwargs)

        return pipelined_loss


def _is_trivial(key: str, value: torch.Tensor) -> bool:
    if key == "attention_mask":
        return bool(value.bool().all())
    if key == "token_type_ids":
        return not bool(value.any())
    expected = torch.arange(value.shape[-1], device=value.device).expand_as(value)
    return bool((value == expected).all())


def pipeline_model(model: nn.Module, pp_mesh: DeviceMesh, device: torch.device, *, schedule: str = "1f1b",
                   microbatches: Optional[int] = None, virtual_stages: int = 1,
                   split_points: Optional[Sequence[int]] = None,
                   loss_fn: Optional[Callable] = None) -> Pipeline:
    """Split ``model`` over ``pp_mesh`` in place: this rank keeps its stages only, and ``model(...)`` runs the
    schedule. Returns the :class:`Pipeline` (also ``model.pipeline``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline_schedule={schedule!r}; choose one of {sorted(SCHEDULES)}")
    pp = pp_mesh.size()
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        virtual_stages = 2
    if schedule != "interleaved_1f1b" and virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs pipeline_schedule='interleaved_1f1b'")
    microbatches = microbatches or 2 * pp
    if schedule == "interleaved_1f1b" and microbatches % pp:
        raise ValueError(f"interleaved_1f1b needs microbatches divisible by pipeline_parallel_size={pp}; got"
                         f" {microbatches}")
    sizes, first_extra, last_extra = block_sizes(model)
    plan = plan_stages(sizes, pp, virtual_stages, first_extra, last_extra, split_points)
    stage_modules = split_model(model, plan, pp_mesh.get_local_rank())
    pipe = Pipeline(model, stage_modules, plan, pp_mesh, device, schedule, microbatches, loss_fn)
    model.pipeline = pipe
    model.forward = types.MethodType(lambda self, *a, **k: self.pipeline.forward(*a, **k), model)
    return pipe
