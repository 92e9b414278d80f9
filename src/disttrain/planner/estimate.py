"""Per-rank memory and per-step communication of a model under each disttrain strategy.

Memory of one rank, in bytes, split the way a user can act on it:
- ``params``, ``grads``, ``optimizer``: model states on the device (sharded where the strategy shards them).
- ``activations``: what the forward pass saves for backward at its peak (all micro-batch layers, or with activation
  checkpointing the block inputs plus one block recomputed). The per-token coefficients (the formulas of the family
  modules, :mod:`disttrain.parallel.families`) were counted on the actual implementations (transformers' Llama,
  timm's ViT) with saved-tensor hooks and are checked the same way by
  ``tests/test_planner_accuracy.py``; they follow Korthikanti et al. (2022), "sbh(34 + 5as/h)", adapted: no dropout,
  SwiGLU's four ``f``-wide tensors, and SDPA/FlashAttention keeps a per-head log-sum-exp instead of the ``a x s x s``
  scores that eager attention keeps. Every other model (GPT-2, BERT, T5, ResNet, any module) is measured: its own
  forward runs on the meta device under the same hooks (:mod:`disttrain.planner.measured`).
- ``buffers``: temporaries a strategy adds: DDP's gradient buckets, FSDP/ZeRO-3's gathered unit (and the one being
  prefetched), ZeRO-3's reduce bucket, tensor-parallel and all-to-all buffers, the logits' gradient.
- ``host``: host RAM per rank under CPU offload (optimizer state, master weights, gradients).

Everything a strategy contributes is read from its engine's declaration (``Engine.layout(options)``,
:mod:`disttrain.parallel.engines.layout`): which states are sharded over which dimensions, in which dtype and where,
how parameters are gathered and gradients reduced, the buffers it adds. The formula follows the structure it
declares: a model split by model-parallel dimensions (tensor, pipeline, expert) -> :func:`_model_parallel`;
embedding tables placed by torchrec -> :func:`_tables`; otherwise replicated or sharded states ->
:func:`_data_parallel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from disttrain.parallel import registry
from disttrain.parallel.engines.layout import Gather, Layout, Partition, Reduce, State, Units, Where
from disttrain.parallel.families import family_named
from disttrain.parallel.mesh import ParallelDims
from disttrain.planner.shards import fsdp_rank_elements, low_rank_elements, zero3_partition
from disttrain.planner.spec import ModelLike, ModelSpec, model_spec

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "adagrad": 1, "sgd": 0, "rowwise_adagrad": 0}


@dataclass
class Estimate:
    """Bytes per rank (the busiest rank where ranks differ) and bytes moved per optimizer step, for one strategy
    with ``options`` (those it was given beyond its defaults) at the degrees ``dims``.

    ``comm`` holds per-rank bytes per step: ``dp`` (data-parallel collectives, overlapped with compute: within a
    shard group, or DDP's all-reduce over the replicas), ``dp_replicate`` (HSDP: sharded gradients all-reduced
    across the replicas), ``tp`` (tensor-parallel all-reduces, on the critical path), ``pp`` (pipeline sends),
    ``a2a`` (embedding all-to-all), ``cp`` (context-parallel all-to-all), ``ep`` (MoE tokens to their experts and
    back), ``pcie`` (offload copies), ``host_optimizer`` (state a CPU optimizer sweeps), ``after_step`` (updated
    partitions all-gathered after the optimizer step). ``layout``: how the strategy holds the states with these
    options (its engine's declaration).
    """

    strategy: str
    dims: ParallelDims
    micro_batch: int
    seq_len: int
    precision: str
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    host: int = 0
    options: dict = field(default_factory=dict)
    comm: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    model_recomputes: bool = False  # the model checkpoints its own blocks (a recipe's train.activation_checkpointing)
    layout: Layout | None = field(default=None, repr=False, compare=False)
    lora_rank: int = 0  # LoRA adapters of this rank train; the base model is frozen (0: the whole model trains)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def activation_checkpointing(self) -> bool:
        return self.model_recomputes or bool(self.options.get("activation_checkpointing"))

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Peak device bytes of this rank."""
        return self.states + self.activations + self.buffers

    @property
    def label(self) -> str:
        """The strategy and its degrees: ``disttrain_megatron tp=2 pp=1 dp=16``, ``disttrain_fsdp hsdp shard=8 x 4``
        (sharded within groups of 8 ranks, 4 replicas)."""
        d = self.dims
        if (d.cp, d.tp, d.pp, d.ep) == (1, 1, 1, 1):
            return f"{self.strategy} hsdp shard={d.shard} x {d.dp_replicate}" if d.hybrid else self.strategy
        return (f"{self.strategy} tp={d.tp} pp={d.pp} dp={d.dp}" + (f" cp={d.cp}" if d.cp > 1 else "")
                + (f" ep={d.ep}" if d.ep > 1 else ""))


@dataclass(frozen=True)
class Sizes:
    """Bytes per parameter element, from a layout and a precision: parameter, gradient, optimizer state (its
    moments and any fp32 master copy), compute (activations and gathers), reduction (gradient collectives' buffers)
    and wire (what the gradient collectives send: the reduction's, or a compressed size)."""

    param: int
    grad: int
    optimizer: int
    compute: int
    reduce: int
    wire: float = 0.0

    @classmethod
    def of(cls, layout: Layout, precision: str, optimizer: str) -> Sizes:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not planned for; choose one of {', '.join(PRECISIONS)}")
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer={optimizer!r} is not known; choose one of {', '.join(OPTIMIZER_STATES)}")
        opt = layout.optimizer
        moments = OPTIMIZER_STATES[optimizer] * opt.dtype.bytes(precision)
        return cls(param=layout.params.dtype.bytes(precision), grad=layout.grads.dtype.bytes(precision),
                   optimizer=moments + (4 if opt.master else 0),
                   compute=4 if precision.startswith("32") else 2,
                   reduce=layout.grads.reduce_dtype.bytes(precision),
                   wire=layout.grads.wire_bytes or layout.grads.reduce_dtype.bytes(precision))


@dataclass(frozen=True)
class Setup:
    """What every formula starts from: the model, the strategy row, its options and degrees, the batch, and how
    the strategy holds the states (its layout) in bytes per element (``sizes``)."""

    spec: ModelSpec
    row: registry.Registered
    options: Any
    dims: ParallelDims
    micro_batch: int
    seq_len: int
    precision: str
    optimizer: str
    sizes: Sizes
    layout: Layout
    model_recomputes: bool = False
    lora_rank: int = 0

    @property
    def activation_checkpointing(self) -> bool:
        return self.model_recomputes or bool(getattr(self.options, "activation_checkpointing", False))

    @property
    def adapters(self) -> int:
        """Elements of the LoRA adapters (0 without LoRA)."""
        return lora_elements(self.spec, self.lora_rank)

    def estimate(self, **bytes_: Any) -> Estimate:
        return Estimate(strategy=self.row.name, dims=self.dims, micro_batch=self.micro_batch, seq_len=self.seq_len,
                        precision=self.precision, options=self.row.given(self.options),
                        model_recomputes=self.model_recomputes, layout=self.layout, lora_rank=self.lora_rank,
                        **bytes_)

    def activations(self) -> int:
        """What one micro-batch's forward saves for backward on one rank (16-bit compute saves 16-bit tensors)."""
        return activation_bytes(self.spec, self.micro_batch, self.seq_len, self.sizes.compute,
                                self.activation_checkpointing, self.dims)

    def logits_grad(self) -> int:
        """The fp32 gradient of an LM's logits, held while the loss backpropagates."""
        lm = self.spec.extra.get("lm_logits", False)
        return self.micro_batch * self.seq_len * self.spec.vocab * 4 if lm else 0


def activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int,
                     activation_checkpointing: bool = False, dims: ParallelDims | None = None) -> int:
    """Bytes saved for backward by one micro-batch's forward on one rank of ``dims`` (see the module docstring for
    the coefficients; ``dims`` None: one rank alone)."""
    dims = dims or ParallelDims(1)
    family = family_named(spec.family)
    if family is not None and family.analytic:
        return family.activation_bytes(spec, micro_batch, seq_len, compute_bytes, activation_checkpointing, dims)
    measured = spec.extra.get("activations")
    if measured is None:  # a module without an input to run it on: see Plan.reasons
        return 0
    return measured.profile(micro_batch, seq_len).activation_bytes(compute_bytes, dims, activation_checkpointing)


def analytic(spec: ModelSpec) -> bool:
    """Whether the model's family counts it by formulas (else its activations were measured, or are unknown)."""
    family = family_named(spec.family)
    return family is not None and family.analytic


def flops_per_sample(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one sample."""
    family = family_named(spec.family)
    if family is not None and family.analytic:
        return family.flops_per_sample(spec, seq_len)
    measured = spec.extra.get("activations")
    if measured is not None:  # backward costs about twice the forward that was counted
        return 3.0 * measured.profile(1, seq_len).flops
    return 6.0 * spec.params * max(1, seq_len)


def lora_elements(spec: ModelSpec, rank: int) -> int:
    """Elements of rank-``rank`` LoRA adapters on every Linear of every block ("all-linear", the recipes' default):
    each adds ``rank x (inputs + outputs)``; a block's Linears are attention's q, k, v, o and a gated MLP's gate, up
    and down (``7 h + 2 a d + 2 kv d + 3 f`` inputs and outputs)."""
    if not rank:
        return 0
    if not (spec.layers and spec.hidden and spec.heads):
        raise ValueError(f"lora_rank={rank}: LoRA is planned for transformer decoders (attention and MLP blocks), not"
                         f" a {spec.family} model; plan it without lora_rank")
    h, f, a, kv = spec.hidden, spec.ffn or 4 * spec.hidden, spec.heads, spec.kv_heads or spec.heads
    d = spec.extra.get("head_dim") or spec.head_dim
    return rank * spec.layers * (7 * h + 2 * a * d + 2 * kv * d + 3 * f)


def estimate(model_or_config: ModelLike, strategy: str, world_size: int, *, micro_batch: int = 1,
             seq_len: int | None = None, precision: str = "bf16-mixed", optimizer: str | None = None,
             model_recomputes: bool = False, lora_rank: int = 0, **options: Any) -> Estimate:
    """Per-rank bytes of ``model_or_config`` trained with ``strategy`` (a registered name) on ``world_size`` ranks.

    ``options`` are the strategy's own options (``tensor_parallel_size=2`` for ``disttrain_megatron``,
    ``activation_checkpointing=True`` for ``disttrain_fsdp``, ...): they set the degrees (``Estimate.dims``) by the
    strategy's own rule, as they would in a run. ``seq_len`` defaults to the model's (ViT: its patch count + 1;
    Llama: ``max_position_embeddings``). ``optimizer`` is "adamw" (default) or "adagrad"/"sgd"/"rowwise_adagrad"
    (DeepFM's tables default to Adagrad). ``model_recomputes``: the model checkpoints its own blocks (timm's
    ``set_grad_checkpointing``, HF's ``gradient_checkpointing_enable``), under any strategy. ``lora_rank``: only
    LoRA adapters of this rank train (a recipe's ``lora.rank``): the frozen base has no gradients or optimizer
    state and its gradients are not reduced; its parameters are held and gathered as usual.
    """
    spec = model_spec(model_or_config)
    row = registry.lookup(strategy)
    if row.engine is None:
        raise ValueError(f"strategy={strategy!r} is not planned for (it runs as the planner's choice); choose one of"
                         f" {', '.join(planned())}")
    for name, value in (("world_size", world_size), ("micro_batch", micro_batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    opts = row.options(**options)
    dims = row.dims(world_size, opts)
    layout = row.engine.layout(opts)
    # Tables default to the recipe's sparse optimizer (Adagrad) where torchrec places them.
    sparse = spec.extra.get("recsys", {}).get("sparse_optimizer") or "adagrad"
    opt = optimizer or (sparse if spec.table_rows and layout.tables else "adamw")
    if not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank={lora_rank!r} must be a non-negative integer (0: the whole model trains)")
    setup = Setup(spec, row, opts, dims, micro_batch, int(seq_len or spec.tokens or 1), precision, opt,
                  Sizes.of(layout, precision, opt), layout, model_recomputes, lora_rank)
    if lora_rank and layout.tables:
        raise ValueError(f"lora_rank={lora_rank}: {strategy} places embedding tables, which LoRA does not adapt;"
                         " plan it without lora_rank")
    setup.adapters  # a model LoRA is not planned for is refused here
    return formula(layout)(setup)


def formula(layout: Layout) -> Callable[[Setup], Estimate]:
    """The formula for a layout's structure: a model split by model-parallel dimensions, tables placed by torchrec,
    or replicated/sharded data parallelism."""
    if layout.split_by:
        return _model_parallel
    if layout.tables:
        return _tables
    return _data_parallel


def planned() -> list[str]:
    """The registered names the planner has formulas for (every strategy with an engine, hence a layout)."""
    return [row.name for row in registry.STRATEGIES if row.engine is not None]


def tensor_parallel(spec: ModelSpec) -> bool:
    """Whether disttrain_megatron has a tensor-parallel plan for the model."""
    return bool(spec.extra.get("tensor_parallel"))


def pipelines(spec: ModelSpec) -> bool:
    """Whether disttrain_megatron can split the model into pipeline stages."""
    return bool(spec.extra.get("pipeline"))


# -- the formulas, by the structure a layout declares -------------------------------------------------------------
def shard_elements(s: Setup, state: State) -> int:
    """Elements of ``state`` one rank holds: all of them when replicated, else its shard as the layout's partition
    cuts the parameters (DeepSpeed pads each to a multiple of n, FSDP2 chunks dim 0), or P/n rounded up when the
    shapes are unknown."""
    n, P = state.shards(s.dims), s.spec.params
    if not state.sharded_over:
        return P
    exact = zero3_partition(s.spec, n) if s.layout.partition is Partition.FLAT else fsdp_rank_elements(s.spec, n)
    return exact if exact is not None else math.ceil(P / n)


def _data_parallel(s: Setup) -> Estimate:
    """Replicated or sharded states (DDP, FSDP2, HSDP, ZeRO-3): each state's elements on a rank in its dtype, on the
    device or (offloaded) in host memory; the buffers the layout declares; parameters all-gathered as the layout
    says and gradients all-reduced (a ring sends 2(n-1)/n of them) or reduce-scattered ((n-1)/n), then all-reduced
    across replicas of their shard."""
    layout, spec, z = s.layout, s.spec, s.sizes
    P = spec.params
    elements = [shard_elements(s, state) for state in layout.states]
    if s.lora_rank:  # the adapters are parameters too; only they have gradients and optimizer state
        adapters = [math.ceil(s.adapters / state.shards(s.dims)) for state in layout.states]
        elements = [elements[0] + adapters[0], adapters[1], adapters[2]]
    per_element = (z.param, z.grad, z.optimizer)
    states = [e * b for e, b in zip(elements, per_element)]
    trained = s.adapters if s.lora_rank else P  # the elements whose gradients are reduced

    grads, buffers = layout.grads, layout.buffers
    unit = spec.largest_unit if layout.params.units is Units.SUBMODULES else (spec.layer_params or spec.largest_unit)
    root = spec.root_params if spec.layers and buffers.root_gathered else 0
    extra = ((trained * z.grad if buffers.gradient_copy else 0) + root * z.compute
             + buffers.gathered_units * unit * z.compute + buffers.unit_gradients * unit * z.reduce * trained / P
             + buffers.reduce_bucket * z.reduce)

    # Gathers per unit run over the parameters' shard group, which is the optimizer's (FSDP2, ZeRO-3).
    gathers = layout.params.gather.per_step if layout.params.gather is Gather.PER_UNIT else 0
    if grads.reduce is Reduce.ALL_REDUCE:  # over every data-parallel rank
        n = s.dims.dp
        # PowerSGD sends the gradient matrices' low-rank factors (the whole model's shapes: uncounted, whole)
        sent = (low_rank_elements(spec, grads.low_rank) if grads.low_rank and not s.lora_rank else None) or trained
        comm = {"dp": 2 * (n - 1) / n * sent * z.wire}
    else:  # over the ranks sharing the partitions the optimizer updates, then across the replicas of a partition
        n = layout.optimizer.shards(s.dims)
        comm = {"dp": (n - 1) / n * (P * gathers * z.compute + trained * z.wire)}
        replicas = math.prod(getattr(s.dims, d) for d in ("dp_replicate", "dp_shard")
                             if d not in layout.optimizer.sharded_over)
        if replicas > 1:
            comm["dp_replicate"] = 2 * (replicas - 1) / replicas * elements[1] * z.wire
    if layout.params.gather is Gather.AFTER_STEP:  # the updated partitions, once the optimizer step is done
        n = layout.optimizer.shards(s.dims)
        comm["after_step"] = (n - 1) / n * trained * z.compute

    device = [b if state.where is Where.DEVICE else 0 for b, state in zip(states, layout.states)]
    host = sum(b for b, state in zip(states, layout.states) if state.where is Where.HOST)
    # Copies of a partition (DeepSpeed's stage 1/2 offload), in the compute dtype, beside the state they copy.
    for copied, state, count in ((buffers.partition_copy, layout.optimizer, elements[2]),
                                 (buffers.accumulation_copy, layout.grads, elements[1])):
        if copied and state.where is Where.HOST:
            host += count * z.compute
        elif copied:
            extra += count * z.compute
    if layout.optimizer.where is not Where.DEVICE:  # a CPU optimizer steps the shards
        shard = elements[2]
        comm["pcie"] = shard * (z.compute + z.grad)  # shards up before use, gradients down
        comm["host_optimizer"] = shard * (z.param + z.optimizer)
    notes = []
    on_disk = sum(b for b, state in zip(states, layout.states) if state.where is Where.NVME)
    if on_disk:
        notes.append(f"{on_disk / 2**30:.1f} GiB of states per rank on NVMe")
    return s.estimate(params=device[0], grads=device[1], optimizer=device[2], activations=s.activations(),
                      buffers=extra + s.logits_grad(), host=host, comm=comm, notes=notes)


def _model_parallel(s: Setup) -> Estimate:
    """A model split by tensor, pipeline, context and expert parallelism, with the layout's data-parallel sharding
    (FSDP2) over the ranks that remain: the busiest stage's share of the blocks split over the tensor-parallel ranks,
    the pipeline's microbatches in flight, the split dimensions' traffic."""
    spec, z, dims, name = s.spec, s.sizes, s.dims, s.row.name
    t, p, c = dims.tp, dims.pp, dims.cp
    b, m = s.micro_batch, getattr(s.options, "microbatches", None) or 2 * p
    if not tensor_parallel(spec):
        raise ValueError(f"{name} splits attention heads and MLPs of Llama, GPT-2, BERT-style and ViT "
                         f"blocks; a {spec.family} model has none it knows")
    if p > 1 and not pipelines(spec):
        raise ValueError(f"pipeline_parallel_size={p}: {name} has no pipeline stages for this"
                         f" {spec.family} model (see disttrain.parallel.split.pipeline)")
    if spec.heads % t or spec.kv_heads % t:
        choices = [k for k in range(1, spec.kv_heads + 1) if spec.kv_heads % k == 0 and spec.heads % k == 0]
        raise ValueError(f"tensor_parallel_size={t} does not divide num_heads={spec.heads} (kv heads "
                         f"{spec.kv_heads}); choose one of {', '.join(map(str, choices))}")
    if spec.layers % p:
        raise ValueError(f"pipeline_parallel_size={p} does not divide the {spec.layers} layers")
    if c > 1 and not spec.extra.get("context_parallel"):
        raise ValueError(f"context_parallel_size={c}: {name} splits the sequences of HF Llama-family"
                         f" decoders (Llama, Qwen2/3, Mistral), not of a {spec.family} model")
    if c > 1 and s.seq_len % c:
        raise ValueError(f"context_parallel_size={c} does not divide seq_len={s.seq_len}")
    e = dims.ep
    experts = spec.extra.get("experts") or {}
    if e > 1 and not experts:
        raise ValueError(f"expert_parallel_size={e}: a {spec.family} model has no experts to split (its config"
                         " declares no expert-parallel plan); use expert_parallel_size=1")
    if e > 1 and experts.get("count") and experts["count"] % e:
        raise ValueError(f"expert_parallel_size={e} does not divide the model's {experts['count']} experts")
    # Under expert parallelism each rank keeps experts/ep whole experts of its stage's layers (not split by tensor
    # parallelism), sharded over the dp_shard/ep ranks that hold the same ones; the rest is split as usual.
    expert = experts.get("params", 0) // p if e > 1 else 0
    # The busiest stage: its share of the blocks, split across the tensor-parallel ranks (column/row-split
    # layers), plus (pipeline) the bigger end or (no pipeline) both ends, which stay whole on every tensor-parallel
    # rank (the plans split blocks only; embeddings, final norm and head are replicated, then FSDP-sharded). A tied
    # embedding is held by both ends of a pipeline (the last stage's head is a copy).
    root = spec.root_params
    ends = root if p == 1 or spec.extra.get("tied") else math.ceil(root / 2)
    local = math.ceil((spec.layers // p * spec.layer_params - expert) / t) + ends
    exact = fsdp_rank_elements(spec, dims.shard, t) if p == 1 and not expert else None
    shard = exact if exact is not None else math.ceil(local / dims.shard)  # FSDP on the data dimension
    expert_fsdp = dims.dp_shard // e
    shard += math.ceil(expert / e / expert_fsdp)
    per_mb = s.activations()
    # 1F1B: the first stage holds min(p, m) pipeline microbatches (b/m samples each) of its layers/p blocks.
    acts = per_mb * min(p, m) / (p * m) if p > 1 else per_mb
    # Micro-batches per data-parallel group for the same global batch as the other strategies (its t*p*c ranks share
    # each one), and the hidden states of one micro-batch on one rank (its s/c tokens).
    micro_steps = t * p * c
    width = s.seq_len / c * b * spec.hidden * z.compute
    buffers = 2 * width * (t > 1) + 2 * width * (p > 1) + 2 * width * (c > 1)
    layer_expert = expert * p // spec.layers if expert else 0  # one layer's experts
    block = math.ceil((spec.layer_params - layer_expert) / t) + layer_expert // e  # one block gathered
    held = s.layout.buffers
    if dims.shard > 1:  # one block's share gathered and the next prefetched, one block's gradients to reduce
        buffers += held.gathered_units * block * z.compute + held.unit_gradients * block * z.reduce
    n, gathers = dims.shard, s.layout.params.gather.per_step
    # LoRA: this rank's adapters (split as the layers they adapt), the only gradients and optimizer state
    adapters = math.ceil(s.adapters // p / t / dims.shard)
    trained = adapters / shard if s.lora_rank else 1.0  # the fraction of the shard whose gradients are reduced
    comm = {"dp": ((n - 1) / n * local + (expert_fsdp - 1) / expert_fsdp * expert / e)
            * (gathers * z.compute + z.reduce * trained) if n > 1 else 0.0,
            # two all-reduces forward and two backward per block (attention and MLP), ring: 2(t-1)/t of the tensor
            "tp": 4 * (spec.layers // p) * 2 * (t - 1) / t * width * micro_steps if t > 1 else 0.0,
            "pp": 2 * width * micro_steps if p > 1 else 0.0,
            # Ulysses: per block, q, k, v (one exchange) and the attention output (one back), forward and backward
            # again for their gradients; each rank sends (c-1)/c of its share of them
            "cp": 2 * (spec.layers // p) * (c - 1) / c * width / t * (2 + 2 * spec.kv_heads / spec.heads)
            * micro_steps if c > 1 else 0.0,
            # experts: each (token, expert) pair to the expert's rank and back, forward and backward again; a rank
            # sends (e-1)/e of its tokens' top_k copies
            "ep": 4 * (spec.layers // p) * experts.get("top_k", 1) * (e - 1) / e * width * micro_steps
            if e > 1 else 0.0,
            "bubble": (p - 1) / (micro_steps + p - 1)}
    if s.lora_rank:
        return s.estimate(params=(shard + adapters) * z.param, grads=adapters * z.grad,
                          optimizer=adapters * z.optimizer, activations=acts, buffers=buffers, comm=comm)
    return s.estimate(params=shard * z.param, grads=shard * z.grad, optimizer=shard * z.optimizer, activations=acts,
                      buffers=buffers, comm=comm)


def table_placement(rows: tuple[int, ...], world_size: int) -> list[list[int]]:
    """Table-wise sharding: each table whole on one rank, largest first onto the least loaded rank."""
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(rows)), key=lambda i: -rows[i]):
        r = load.index(min(load))
        ranks[r].append(i)
        load[r] += rows[i]
    return ranks


def torchrec_placement(spec: ModelSpec, world_size: int, options: Any = None) -> list[tuple[int, int]] | None:
    """(table elements, table rows) per rank as torchrec's planner places the tables (the engine's ``plan``, with
    the recipe's sharding types and constraints, or ``options``: RecsysOptions), or None without torchrec."""
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return None
    from disttrain.parallel.engines import recsys as rs

    settings = spec.extra.get("recsys", {})
    if options is None or options == rs.RecsysOptions():
        options = rs.RecsysOptions(sharding_types=settings.get("sharding_types"),
                                   constraints=dict(settings.get("constraints") or {}))
    key = (spec.table_rows, spec.embedding_dim, world_size, repr(options), settings.get("sparse_optimizer"))
    if key not in _PLACEMENTS:
        _PLACEMENTS[key] = _plan_tables(spec, world_size, options, settings.get("sparse_optimizer"))
    return _PLACEMENTS[key]


_PLACEMENTS: dict[tuple, list[tuple[int, int]]] = {}


def _plan_tables(spec: ModelSpec, world_size: int, options: Any, sparse_optimizer: str | None
                 ) -> list[tuple[int, int]]:
    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from disttrain.parallel.engines import recsys as rs

    class Tables(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # DeepFMNet's table and feature names, so the recipe's constraints name the same tables.
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=spec.embedding_dim, num_embeddings=rows,
                                   feature_names=[f"cat_{i}"]) for i, rows in enumerate(spec.table_rows)],
                device=torch.device("meta"))

    fused = rs.fused_params(options, {"name": sparse_optimizer} if sparse_optimizer else None)
    rs.quiet_planner_logs()
    plan = rs.plan(Tables(), options, world_size, torch.device("cuda"), rs.sharders(fused))
    return rs.shards_per_rank(plan, world_size)


def _tables(s: Setup) -> Estimate:
    """Tables placed by torchrec's planner (fp32, fused optimizer in backward), the dense part as the layout holds
    it (replicated)."""
    spec, z, n, b = s.spec, s.sizes, s.dims.world_size, s.micro_batch
    if not spec.table_rows:
        raise ValueError(f"{s.row.name} shards embedding tables; a {spec.family} model has none")
    placed = torchrec_placement(spec, n, s.options)
    if placed is not None:  # torchrec's own planner: row/column/table-wise as the run will shard
        table, rows = max(placed)
        busiest_tables = len(spec.table_rows) / n  # pooled lookups per rank, on average
    else:  # table-wise, largest first onto the least loaded rank
        placement = table_placement(spec.table_rows, n)
        busiest = max(placement, key=lambda tables: sum(spec.table_rows[i] for i in tables))
        rows = sum(spec.table_rows[i] for i in busiest)
        table = rows * spec.embedding_dim
        busiest_tables = len(busiest)
    dense = spec.dense_params
    # Tables stay fp32; the fused optimizer updates them in backward, so no table gradient is kept. Row-wise
    # Adagrad keeps one value per row, Adagrad one per element. The dense part trains with Adam.
    opt_tables = 4 * (rows if s.optimizer == "rowwise_adagrad" else table * OPTIMIZER_STATES[s.optimizer])
    dense_opt = dense * 4 * OPTIMIZER_STATES["adam"]
    pooled = int(b * n * busiest_tables * spec.embedding_dim * z.compute)  # this rank's tables looked up
    comm = {"dp": 2 * (n - 1) / n * dense * z.grad,
            "a2a": 2 * (n - 1) / n * b * len(spec.table_rows) * spec.embedding_dim * z.compute}
    copy = dense * z.grad if s.layout.buffers.gradient_copy else 0  # the dense gradients' buckets
    return s.estimate(params=table * 4 + dense * z.param, grads=dense * z.grad, optimizer=opt_tables + dense_opt,
                      activations=s.activations(), buffers=2 * pooled + copy, comm=comm)
