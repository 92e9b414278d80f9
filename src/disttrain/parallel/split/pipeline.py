"""Pipeline parallelism with ``torch.distributed.pipelining``, made to look like a plain ``model(...)`` call.

The model's blocks are split into stages (balanced by measured forward FLOPs, or at explicit block indices); each
rank keeps only the stages it runs and drops every other parameter. The model object stays the user's model (the
same class, the same fully qualified parameter names, so checkpoints keep their keys); only its ``forward``
becomes the pipeline: ``model(input_ids=..., labels=...)`` runs the schedule (forward and backward of every
microbatch) and returns the mean loss on every rank of the pipeline, whose ``backward()`` does nothing because
the schedule already did it.

The stages are the model family's (:mod:`disttrain.parallel.families`): HF Llama-family causal LMs and GPT-2 (the
loss comes from ``labels`` as in HF), BERT-style encoders for sequence classification (``model(input_ids=...,
labels=...)``, HF's classification loss), and timm's VisionTransformer (the loss function comes from the caller:
``model(images, target=labels)``, or deferred through :meth:`Pipeline.defer_loss`, which is how a LightningModule's
``loss_fn`` hook is wired). Encoder-decoder models (T5, BART) are refused.

An LM head tied to the input embedding (Gemma-2, GPT-2, most small Llama-3.2/Qwen2 checkpoints) is kept as Megatron
keeps it: the first stage holds the embedding, the last stage a copy as its head (:class:`TiedHead`).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from disttrain.parallel.checkpoint.pretrained import TIED_COPIES
from disttrain.parallel.families import Family, family_of, unsupported_reason

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
if hasattr(torch_schedules, "ScheduleDualPipeV"):  # torch >= 2.9
    SCHEDULES["dualpipev"] = torch_schedules.ScheduleDualPipeV
# Several stages per rank, placed round-robin (stage s on rank s % pp): ``virtual_stages`` of them, at least 2.
INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")
# Exactly two stages per rank, placed in a V (rank r runs stages r and 2 * pp - 1 - r: the first and the last stage
# share rank 0, so the embeddings and the head share its time).
V_SHAPED = ("zbv", "dualpipev")
# Schedules that split each backward into an input-gradient and a weight-gradient pass over the stage modules'
# parameters (the weight passes fill the bubble).
SPLIT_BACKWARD = ("interleaved_zero_bubble", *V_SHAPED)


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage runs: ``bounds[s] = (first block, end block)``; stage s lives on pp rank s % pp
    (``style="loop"``) or, with two stages per rank in a V (``style="v"``), on rank s for s < pp and on rank
    ``2 * pp - 1 - s`` after that."""

    bounds: tuple[tuple[int, int], ...]
    pp: int
    style: str = "loop"

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def rank_of(self, stage: int) -> int:
        if self.style == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == pp_rank]


@dataclass(frozen=True)
class TiedHead:
    """An output head that shares the input embedding's weight, split over the first and the last stage.

    The last stage's head gets a weight of its own, equal to the embedding's at set-up (:meth:`Pipeline.sync_tied`);
    after each step's backward both copies get the sum of their two gradients, which is the tied weight's gradient
    (:meth:`Pipeline.reduce_tied_gradients`), so they take identical optimizer steps and stay equal. Gradient
    clipping counts the weight once, and checkpoints keep both names, as one process's ``state_dict`` does.
    Names are the model's own (``model.embed_tokens.weight``, ``lm_head.weight``)."""

    embedding: str
    head: str


def tied_head(model: nn.Module) -> Optional[TiedHead]:
    """The names of an HF model's input embedding and output head if they share one weight, else None."""
    get_input, get_output = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_input) and callable(get_output)):
        return None
    embedding, head = get_input(), get_output()
    weight = getattr(embedding, "weight", None)
    if weight is None or getattr(head, "weight", None) is not weight:
        return None
    module_names = {id(module): name for name, module in model.named_modules()}
    return TiedHead(f"{module_names[id(embedding)]}.weight", f"{module_names[id(head)]}.weight")


def untie_head(model: nn.Module, keeps_both: bool) -> Optional[TiedHead]:
    """Give an HF model's output head its own weight if it shares the input embedding's (before the split);
    ``keeps_both``: this rank runs the first and the last stage (a V-shaped schedule), so both stay here and the
    head needs its own copy of the values."""
    tied = tied_head(model)
    if tied is None:
        return None
    weight = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    others = [names for names in shared.values() if len(names) > 1 and set(names) != {tied.embedding, tied.head}]
    if others:
        raise ValueError(f"pipeline parallelism keeps a tied input embedding and LM head in step across stages, not"
                         f" other shared parameters ({', '.join(others[0])}); give them weights of their own")
    data = weight.detach().clone() if keeps_both else weight.detach()
    head.weight = nn.Parameter(data, requires_grad=weight.requires_grad)
    # transformers ties them again whenever tie_weights() runs (its init does): not on a split model
    model._tied_weights_keys = None
    model.all_tied_weights_keys = {}
    setattr(model, TIED_COPIES, {tied.head: tied.embedding})
    return tied


def plan_stages(block_costs: Sequence[float], pp: int, virtual_stages: int = 1, first_extra: float = 0,
                last_extra: float = 0, split_points: Optional[Sequence[int]] = None, style: str = "loop") -> StagePlan:
    """Split ``len(block_costs)`` blocks into ``pp * virtual_stages`` stages.

    ``split_points`` are the block indices where stages 1, 2, ... start. Without them, stages are balanced by
    cost: what runs before the first block (``first_extra``: the embeddings) counts with the first stage and what
    runs after the last (``last_extra``: final norm, head and loss) with the last, like layers of their own; the
    split is the one whose costliest stage costs least (a pipeline runs at the pace of its slowest stage), the most
    even of those on a tie.
    """
    n_stages = pp * virtual_stages
    n_blocks = len(block_costs)
    if n_blocks < n_stages:
        raise ValueError(f"{n_blocks} blocks cannot fill pipeline_parallel_size*virtual_stages={n_stages} stages;"
                         f" choose at most {n_blocks} stages in all")
    if split_points is not None:
        points = list(split_points)
        if len(points) != n_stages - 1 or points != sorted(set(points)) or not all(0 < p < n_blocks for p in points):
            raise ValueError(f"split_points={points} must be {n_stages - 1} increasing block indices between 1 and"
                             f" {n_blocks - 1} (where stages 1..{n_stages - 1} start)")
    else:
        costs = [float(c) for c in block_costs]
        costs[0] += first_extra
        costs[-1] += last_extra
        points = _min_max_split(costs, n_stages)
    edges = [0, *points, n_blocks]
    return StagePlan(tuple(zip(edges[:-1], edges[1:])), pp, style)


def _min_max_split(costs: list[float], n_stages: int) -> list[int]:
    """Where stages 1.. start so that the costliest of ``n_stages`` contiguous stages (each at least one block)
    costs least; on a tie, the smallest sum of squared stage costs. Exact (dynamic programming, O(blocks^2 x
    stages)); a model has at most a few hundred blocks."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: (max stage cost, sum of squares, cut before the last stage) of the first i blocks in k stages
    inf = (float("inf"), float("inf"), 0)
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0, 0)
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j][0] == float("inf"):
                    continue
                stage = prefix[i] - prefix[j]
                candidate = (max(best[k - 1][j][0], stage), best[k - 1][j][1] + stage * stage, j)
                if candidate[:2] < best[k][i][:2]:
                    best[k][i] = candidate
    points, i = [], n
    for k in range(n_stages, 1, -1):
        i = best[k][i][2]
        points.append(i)
    return points[::-1]


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
    that balance the stages when the forward cannot be measured (matmul parameters stand for compute)."""
    return pipeline_family(model).pipeline_sizes(model)


# FLOPs per element of a log-softmax (max, subtract, exp, sum, log): the loss's work over the vocabulary, which
# torch's FlopCounterMode (matmuls and attention only) leaves out.
_SOFTMAX_FLOPS = 5


def block_costs(model: nn.Module, seq_len: Optional[int] = None) -> tuple[list[float], float, float]:
    """Forward FLOPs of one sample per block, before the first block (embeddings) and after the last (final norm,
    head and loss), measured by running the model's own forward on the meta device under torch's
    ``FlopCounterMode`` (nothing is allocated or computed). LMs are measured at ``seq_len`` tokens (default: the
    config's positions, at most 2048), which weighs attention against the head as training will.

    Falls back to :func:`block_sizes` (parameter counts) for a model whose forward does not run that way."""
    sizes, first, last = block_sizes(model)
    try:
        blocks = _stage_blocks(model, len(sizes))
        costs = _measure_flops(model, blocks, _example_inputs(model, seq_len))
    except Exception:  # a forward that needs real data: parameters stand for compute, as before measuring
        return [float(s) for s in sizes], float(first), float(last)
    return costs


def _stage_blocks(model: nn.Module, n_blocks: int) -> list[nn.Module]:
    """The model's repeated blocks in order: the stack of ``n_blocks`` identical modules the family splits."""
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) == n_blocks:
            children = list(module.children())
            if len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters()):
                return children
    raise ValueError(f"no stack of {n_blocks} blocks in {type(model).__name__}")


def _example_inputs(model: nn.Module, seq_len: Optional[int]) -> tuple[tuple, dict]:
    """One sample on the meta device, as the pipelined model is called: token ids and labels (HF), or an image."""
    config = getattr(model, "config", None)
    if config is None:  # timm VisionTransformer
        patch = model.patch_embed
        size = patch.img_size if isinstance(patch.img_size, (tuple, list)) else (patch.img_size,) * 2
        return (torch.zeros(1, patch.proj.in_channels, *size, device="meta"),), {}
    positions = next((int(v) for n in ("max_position_embeddings", "n_positions")
                      if isinstance(v := getattr(config, n, None), int)), 2048)
    ids = torch.zeros(1, seq_len or min(positions, 2048), dtype=torch.long, device="meta")
    labels = ids if type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")) else \
        torch.zeros(1, dtype=torch.long, device="meta")
    return (), {"input_ids": ids, "labels": labels}


def _measure_flops(model: nn.Module, blocks: list[nn.Module],
                   inputs: tuple[tuple, dict]) -> tuple[list[float], float, float]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    state = {n: fake.from_tensor(t.detach().to("meta")) for n, t in [*model.named_parameters(),
                                                                      *model.named_buffers()]}
    softmax = {torch.ops.aten._log_softmax: lambda shape, *a, **k: _SOFTMAX_FLOPS * math.prod(shape)}
    counter = FlopCounterMode(display=False, custom_mapping=softmax)
    marks: dict[int, float] = {}
    per_block = [0.0] * len(blocks)

    def enter(i: int) -> Callable:
        return lambda module, args: marks.__setitem__(i, counter.get_total_flops())

    def leave(i: int) -> Callable:
        return lambda module, args, output: per_block.__setitem__(i, counter.get_total_flops() - marks[i])

    handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(enter(i)),
                                                         b.register_forward_hook(leave(i)))]
    args, kwargs = inputs
    try:
        with counter, fake:
            functional_call(model, state, tuple(fake.from_tensor(a) for a in args),
                            {k: fake.from_tensor(v) for k, v in kwargs.items()}, tie_weights=True, strict=False)
    finally:
        for handle in handles:
            handle.remove()
    total = float(counter.get_total_flops())
    first = float(marks[0])
    return per_block, first, total - first - sum(per_block)


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
                 loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 tied: Optional[TiedHead] = None) -> None:
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
        self.last_rank = plan.rank_of(plan.num_stages - 1)
        self._schedules: dict[tuple[bool, tuple[int, ...]], Any] = {}  # (with loss, batch shape): its schedule
        self._gradients: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.tied = tied

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

    # -- a tied embedding and head -----------------------------------------------------------------------------
    def _tied_pair(self) -> tuple[Optional[nn.Parameter], Optional[nn.Parameter]]:
        """(embedding, head) weights of a :class:`TiedHead` that live on this rank (the parameters FSDP put there)."""
        assert self.tied is not None
        params = {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in self.model.named_parameters()}
        return params.get(self.tied.embedding), params.get(self.tied.head)

    def _other_end(self) -> int:
        """The global rank of the other end of this pipeline: the last stage's for the first stage's, and back."""
        return dist.get_global_rank(self.group, self.last_rank if self.has_first else self.plan.rank_of(0))

    def tied_copies(self) -> list[nn.Parameter]:
        """The head copies of tied weights on this rank: left out of the gradient norm, which counts the embedding."""
        return [] if self.tied is None or self._tied_pair()[1] is None else [self._tied_pair()[1]]

    @torch.no_grad()
    def sync_tied(self) -> None:
        """Make the head's copy equal to the embedding (after initialisation, which each rank ran on its own).
        Collective over the two ends of the pipeline; refuses shards that do not line up (a head split otherwise
        than the embedding)."""
        if self.tied is None or not (self.has_first or self.has_last):
            return
        embedding, head = (_local(p) if p is not None else None for p in self._tied_pair())
        if embedding is not None and head is not None:  # both ends on this rank
            head.copy_(embedding)
            return
        peer = self._other_end()
        mine = embedding if embedding is not None else head
        assert mine is not None
        theirs: list[Any] = [None]
        if self.has_first:
            dist.send_object_list([tuple(mine.shape)], dst=peer, group=self.group)
            dist.recv_object_list(theirs, src=peer, group=self.group)
        else:
            dist.recv_object_list(theirs, src=peer, group=self.group)
            dist.send_object_list([tuple(mine.shape)], dst=peer, group=self.group)
        if theirs[0] != tuple(mine.shape):
            raise ValueError(f"the tied {self.tied.embedding} and {self.tied.head} are split differently ("
                             f"{tuple(embedding.shape) if embedding is not None else theirs[0]} against"
                             f" {tuple(head.shape) if head is not None else theirs[0]} per rank); untie them"
                             " (tie_word_embeddings=False) or shard the head as the embedding")
        if self.has_first:
            dist.send(mine.contiguous(), dst=peer, group=self.group)
        else:
            received = torch.empty_like(mine)
            dist.recv(received, src=peer, group=self.group)
            mine.copy_(received)

    @torch.no_grad()
    def reduce_tied_gradients(self) -> None:
        """Both copies get the sum of the two gradients (the embedding's from the lookup, the head's from the
        logits): the tied weight's gradient, in the same order of addition on both ends, so the copies stay
        bitwise equal. A frozen tied weight (LoRA) has none to add."""
        if self.tied is None or not (self.has_first or self.has_last):
            return
        pair = self._tied_pair()
        if not any(p is not None and p.requires_grad for p in pair):
            return
        embedding, head = (_local_grad(p) if p is not None else None for p in pair)
        if embedding is not None and head is not None:
            embedding.add_(head)
            head.copy_(embedding)
            return
        mine = embedding if embedding is not None else head
        assert mine is not None
        theirs = torch.empty_like(mine)
        peer = self._other_end()
        ops = [dist.P2POp(dist.isend, mine.contiguous(), peer, self.group),
               dist.P2POp(dist.irecv, theirs, peer, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        mine.add_(theirs)

    def _schedule(self, with_loss: bool, batch_shape: tuple[int, ...]) -> Any:
        """The schedule for batches of ``batch_shape``. torch's stages infer their activations' shapes on their first
        step and keep them, so a batch of another shape (a DataLoader's last, partial batch; another sequence
        length) needs stages of its own: the last few shapes' are kept (every rank of the pipeline reads the same
        samples, so they build them together)."""
        key = (with_loss, tuple(batch_shape))
        if key not in self._schedules:
            if len(self._schedules) >= 4:
                self._schedules.pop(next(iter(self._schedules)))  # the oldest
            stages = [PipelineStage(m, s, self.plan.num_stages, self.device, group=self.group)
                      for m, s in zip(self.stage_modules, self.stage_ids)]
            cls = SCHEDULES[self.schedule_name]
            loss = self._compute_loss if with_loss else None
            if issubclass(cls, PipelineScheduleMulti):
                self._schedules[key] = cls(stages, n_microbatches=self.microbatches, loss_fn=loss)
            else:
                self._schedules[key] = cls(stages[0], n_microbatches=self.microbatches, loss_fn=loss)
        return self._schedules[key]

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
            self._schedule(True, inputs.shape).step(*args, losses=losses, **kwargs)
            self.reduce_tied_gradients()
            self.reduce_stray_gradients()
            self._gradients = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
            outputs = None
        else:
            if self.schedule_name in V_SHAPED:
                result = self._eval_stage_by_stage(inputs, target, losses)
            else:
                schedule = self._schedule(target is not None, inputs.shape)
                result = schedule.eval(*args, losses=losses, **kwargs) if target is not None else \
                    schedule.eval(*args)
            outputs = self._broadcast_from_last(result if self.has_last else None, inputs)
        local = torch.stack([l.detach().float() for l in losses]).mean() if losses else None
        loss = self._broadcast_from_last(local, inputs) if target is not None else None
        if loss is not None and train:
            loss = _ScheduleDidBackward.apply(loss, self._anchor, self)
        return loss, outputs

    def _eval_stage_by_stage(self, inputs: torch.Tensor, target: Optional[torch.Tensor],
                             losses: list[torch.Tensor]) -> Optional[torch.Tensor]:
        """Evaluation under the V-shaped schedules: each microbatch through the stages in order, sent between ranks
        with plain send/recv. torch 2.14's ``eval`` of ZBV and DualPipeV still hands gradients between the two
        stages at the tip of the V (with backward off) and fails; forward alone needs no schedule."""
        modules = dict(zip(self.stage_ids, self.stage_modules))
        targets = target.tensor_split(self.microbatches) if target is not None else [None] * self.microbatches
        outputs = []
        for chunk, chunk_target in zip(inputs.tensor_split(self.microbatches), targets):
            value: Optional[torch.Tensor] = chunk if self.has_first else None
            for stage in range(self.plan.num_stages):
                owner = self.plan.rank_of(stage)
                if stage > 0 and self.plan.rank_of(stage - 1) != owner:
                    value = self._send_or_receive(value, self.plan.rank_of(stage - 1), owner, like=inputs)
                if owner == self.pp_rank:
                    value = modules[stage](value)
            if self.has_last:
                outputs.append(value)
                if chunk_target is not None:
                    losses.append(self._compute_loss(value, chunk_target))
        return torch.cat(outputs) if self.has_last else None

    def _send_or_receive(self, value: Optional[torch.Tensor], src: int, dst: int,
                         like: torch.Tensor) -> Optional[torch.Tensor]:
        """``value`` from pipeline rank ``src`` to ``dst`` (its shape first); other ranks pass through."""
        if self.pp_rank == src:
            assert value is not None
            dist.send_object_list([(tuple(value.shape), value.dtype)], dst=dist.get_global_rank(self.group, dst),
                                  group=self.group)
            dist.send(value.contiguous(), dst=dist.get_global_rank(self.group, dst), group=self.group)
            return None
        if self.pp_rank == dst:
            meta: list[Any] = [None]
            dist.recv_object_list(meta, src=dist.get_global_rank(self.group, src), group=self.group)
            out = torch.empty(meta[0][0], dtype=meta[0][1], device=like.device)
            dist.recv(out, src=dist.get_global_rank(self.group, src), group=self.group)
            return out
        return value

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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (sharded) tensor, sharing its storage."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param``'s gradient, created as zeros if the step left it none."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return _local(param.grad)


def _is_trivial(key: str, value: torch.Tensor) -> bool:
    if key == "attention_mask":
        return bool(value.bool().all())
    if key == "token_type_ids":
        return not bool(value.any())
    expected = torch.arange(value.shape[-1], device=value.device).expand_as(value)
    return bool((value == expected).all())


def check_schedule(schedule: str, pp: int, virtual_stages: int = 1, microbatches: Optional[int] = None) -> \
        tuple[int, int]:
    """``(virtual_stages, microbatches)`` that ``schedule`` runs with on ``pp`` ranks (defaults filled in), or a
    one-line refusal naming the value to change."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline_schedule={schedule!r}; choose one of {sorted(SCHEDULES)}")
    if schedule in INTERLEAVED:
        virtual_stages = max(virtual_stages, 2)
    elif schedule in V_SHAPED:
        if virtual_stages not in (1, 2):
            raise ValueError(f"pipeline_schedule={schedule!r} runs exactly 2 stages per rank (in a V); got"
                             f" virtual_stages={virtual_stages}: remove virtual_stages or set it to 2")
        virtual_stages = 2
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs a schedule with several stages per rank:"
                         f" pipeline_schedule in {[*INTERLEAVED, *V_SHAPED]}")
    m = microbatches or 2 * pp
    stages = pp * virtual_stages
    # torch's own conditions, checked here so that they fail at set-up, in one line, naming the option
    if schedule in INTERLEAVED and m % pp:
        need = f"a multiple of pipeline_parallel_size={pp}"
    elif schedule == "1f1b" and m < pp:
        need = f"at least pipeline_parallel_size={pp}"
    elif schedule == "zbv" and m < 2 * pp - 1:
        need = f"at least 2 * pipeline_parallel_size - 1 = {2 * pp - 1}"
    elif schedule == "dualpipev" and m < stages:
        need = f"at least the number of stages, 2 * pipeline_parallel_size = {stages}"
    else:
        return virtual_stages, m
    raise ValueError(f"pipeline_schedule={schedule!r} needs microbatches {need}; got microbatches={m}")


def pipeline_model(model: nn.Module, pp_mesh: DeviceMesh, device: torch.device, *, schedule: str = "1f1b",
                   microbatches: Optional[int] = None, virtual_stages: int = 1,
                   split_points: Optional[Sequence[int]] = None,
                   loss_fn: Optional[Callable] = None) -> Pipeline:
    """Split ``model`` over ``pp_mesh`` in place: this rank keeps its stages only, and ``model(...)`` runs the
    schedule. Returns the :class:`Pipeline` (also ``model.pipeline``).

    Without ``split_points`` the stages are balanced by measured cost (:func:`block_costs`)."""
    pp = pp_mesh.size()
    virtual_stages, microbatches = check_schedule(schedule, pp, virtual_stages, microbatches)
    costs, first_extra, last_extra = block_costs(model) if split_points is None else (block_sizes(model)[0], 0, 0)
    style = "v" if schedule in V_SHAPED else "loop"
    plan = plan_stages(costs, pp, virtual_stages, first_extra, last_extra, split_points, style)
    pp_rank = pp_mesh.get_local_rank()
    tied = untie_head(model, keeps_both={0, plan.num_stages - 1} <= set(plan.stages_of(pp_rank)))
    stage_modules = split_model(model, plan, pp_rank)
    pipe = Pipeline(model, stage_modules, plan, pp_mesh, device, schedule, microbatches, loss_fn, tied)
    if schedule in SPLIT_BACKWARD and (stray := pipe.stray_parameters()):
        raise ValueError(f"pipeline_schedule={schedule!r} computes weight gradients of the stage modules only, and"
                         f" {type(model).__name__} has {len(stray)} parameters outside them (e.g. timm's cls_token/"
                         f"pos_embed); use pipeline_schedule='1f1b' or 'interleaved_1f1b' for it")
    model.pipeline = pipe
    model.forward = types.MethodType(lambda self, *a, **k: self.pipeline.forward(*a, **k), model)
    return pipe
