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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from disttrain.parallel import registry
from disttrain.parallel.engines.ddp import DDPEngine
from disttrain.parallel.engines.fsdp import FSDPEngine
from disttrain.parallel.engines.megatron import MegatronEngine
from disttrain.parallel.engines.recsys import RecsysEngine
from disttrain.parallel.engines.zero import ZeroEngine
from disttrain.parallel.families import family_named
from disttrain.parallel.mesh import ParallelDims
from disttrain.planner.shards import fsdp_rank_elements, zero3_partition
from disttrain.planner.spec import ModelLike, ModelSpec, model_spec

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "adagrad": 1, "sgd": 0, "rowwise_adagrad": 0}
ZERO3_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


@dataclass
class Estimate:
    """Bytes per rank (the busiest rank where ranks differ) and bytes moved per optimizer step, for one strategy
    with ``options`` (those it was given beyond its defaults) at the degrees ``dims``.

    ``comm`` holds per-rank bytes per step: ``dp`` (data-parallel collectives, overlapped with compute), ``tp``
    (tensor-parallel all-reduces, on the critical path), ``pp`` (pipeline sends), ``a2a`` (embedding all-to-all),
    ``cp`` (context-parallel all-to-all), ``ep`` (MoE tokens to their experts and back), ``pcie`` (offload copies)
    and ``host_optimizer`` (state a CPU optimizer sweeps).
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
        d = self.dims
        if (d.cp, d.tp, d.pp, d.ep) == (1, 1, 1, 1):
            return self.strategy
        return (f"{self.strategy} tp={d.tp} pp={d.pp} dp={d.dp}" + (f" cp={d.cp}" if d.cp > 1 else "")
                + (f" ep={d.ep}" if d.ep > 1 else ""))


@dataclass(frozen=True)
class Sizes:
    """Bytes per parameter element: parameter, gradient, optimizer state, compute (activations and gathers) and
    reduction (gradient collectives)."""

    param: int
    grad: int
    optimizer: int
    compute: int
    reduce: int


@dataclass(frozen=True)
class Setup:
    """What every formula starts from: the model, the strategy row, its options and degrees, the batch."""

    spec: ModelSpec
    row: registry.Registered
    options: Any
    dims: ParallelDims
    micro_batch: int
    seq_len: int
    precision: str
    optimizer: str
    sizes: Sizes
    model_recomputes: bool = False

    @property
    def activation_checkpointing(self) -> bool:
        return self.model_recomputes or bool(getattr(self.options, "activation_checkpointing", False))

    def estimate(self, **bytes_: Any) -> Estimate:
        return Estimate(strategy=self.row.name, dims=self.dims, micro_batch=self.micro_batch, seq_len=self.seq_len,
                        precision=self.precision, options=self.row.given(self.options),
                        model_recomputes=self.model_recomputes, **bytes_)

    def activations(self) -> int:
        """What one micro-batch's forward saves for backward on one rank (16-bit compute saves 16-bit tensors)."""
        return activation_bytes(self.spec, self.micro_batch, self.seq_len, self.sizes.compute,
                                self.activation_checkpointing, self.dims)

    def logits_grad(self) -> int:
        """The fp32 gradient of an LM's logits, held while the loss backpropagates."""
        lm = self.spec.extra.get("lm_logits", False)
        return self.micro_batch * self.seq_len * self.spec.vocab * 4 if lm else 0


def _sizes(precision: str, zero: bool, optimizer: str) -> Sizes:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not planned for; choose one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not known; choose one of {', '.join(OPTIMIZER_STATES)}")
    states = OPTIMIZER_STATES[optimizer]
    if precision == "32-true":
        # DeepSpeed ZeRO-3 keeps an fp32 master copy of its partition even when the parameters are fp32.
        return Sizes(4, 4, 4 * states + (4 if zero else 0), 4, 4)
    if precision.endswith("-true"):
        return Sizes(2, 2, 2 * states, 2, 2)
    if zero:  # 16-bit partitions + fp32 master + fp32 optimizer state (the ZeRO paper's 2 + 2 + 12)
        return Sizes(2, 2, 4 + 4 * states, 2, 2)
    # FSDP2 MixedPrecisionPolicy / autocast: fp32 parameters, gradients and state; 16-bit compute, fp32 reduction.
    return Sizes(4, 4, 4 * states, 2, 4)


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


def estimate(model_or_config: ModelLike, strategy: str, world_size: int, *, micro_batch: int = 1,
             seq_len: int | None = None, precision: str = "bf16-mixed", optimizer: str | None = None,
             model_recomputes: bool = False, **options: Any) -> Estimate:
    """Per-rank bytes of ``model_or_config`` trained with ``strategy`` (a registered name) on ``world_size`` ranks.

    ``options`` are the strategy's own options (``tensor_parallel_size=2`` for ``disttrain_megatron``,
    ``activation_checkpointing=True`` for ``disttrain_fsdp``, ...): they set the degrees (``Estimate.dims``) by the
    strategy's own rule, as they would in a run. ``seq_len`` defaults to the model's (ViT: its patch count + 1;
    Llama: ``max_position_embeddings``). ``optimizer`` is "adamw" (default) or "adagrad"/"sgd"/"rowwise_adagrad"
    (DeepFM's tables default to Adagrad). ``model_recomputes``: the model checkpoints its own blocks (timm's
    ``set_grad_checkpointing``, HF's ``gradient_checkpointing_enable``), under any strategy.
    """
    spec = model_spec(model_or_config)
    row = registry.lookup(strategy)
    formula = FORMULAS.get(row.engine)  # type: ignore[arg-type]
    if formula is None:
        raise ValueError(f"strategy={strategy!r} is not planned for (it runs as the planner's choice); choose one of"
                         f" {', '.join(planned())}")
    for name, value in (("world_size", world_size), ("micro_batch", micro_batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    opts = row.options(**options)
    dims = row.dims(world_size, opts)
    recsys_opt = spec.extra.get("recsys", {}).get("sparse_optimizer") or "adagrad"
    opt = optimizer or (recsys_opt if spec.table_rows and row.engine is RecsysEngine else "adamw")
    setup = Setup(spec, row, opts, dims, micro_batch, int(seq_len or spec.tokens or 1), precision, opt,
                  _sizes(precision, row.engine is ZeroEngine, opt), model_recomputes)
    return formula(setup)


def planned() -> list[str]:
    """The registered names the planner has formulas for."""
    return [row.name for row in registry.STRATEGIES if row.engine in FORMULAS]


def tensor_parallel(spec: ModelSpec) -> bool:
    """Whether disttrain_megatron has a tensor-parallel plan for the model."""
    return bool(spec.extra.get("tensor_parallel"))


def pipelines(spec: ModelSpec) -> bool:
    """Whether disttrain_megatron can split the model into pipeline stages."""
    return bool(spec.extra.get("pipeline"))


# -- one formula per engine -----------------------------------------------------------------------------------------
def _replicated(s: Setup) -> Estimate:
    """DDP: every rank holds the whole model and all-reduces the gradients (a ring sends 2(n-1)/n of them)."""
    n, P, z = s.dims.dp_replicate, s.spec.params, s.sizes
    comm = {"dp": 2 * (n - 1) / n * P * z.grad}
    return s.estimate(params=P * z.param, grads=P * z.grad, optimizer=P * z.optimizer, activations=s.activations(),
                      buffers=P * z.grad + s.logits_grad(), comm=comm)  # buckets: a second copy of the gradients


def _sharded(s: Setup) -> Estimate:
    """FSDP2 and ZeRO-3: parameters, gradients and optimizer state sharded over ``dims.shard`` ranks, gathered one
    unit at a time; with CPU offload the shards live in host memory."""
    spec, z, n = s.spec, s.sizes, s.dims.shard
    zero = s.row.engine is ZeroEngine
    unit, P = spec.largest_unit, spec.params
    if zero:
        # The module being used and the one prefetched, and the reduce bucket DeepSpeed allocates whole
        # (reduce_bucket_size elements) when contiguous_gradients is on, as our config sets it.
        buffers = 2 * unit * z.compute + ZERO3_REDUCE_BUCKET * z.grad
    else:
        # FSDP2 keeps the root (embeddings, head) gathered through forward and backward, gathers one block
        # and prefetches the next, and reduce-scatters one block's unsharded gradients.
        root = spec.root_params if spec.layers else 0
        block = spec.layer_params or unit
        buffers = root * z.compute + 2 * block * z.compute + block * z.reduce
    comm = {"dp": (n - 1) / n * P * (2 * z.compute + z.reduce)}  # all-gather forward and backward, reduce-scatter
    # ZeRO-3 pads each parameter to a multiple of n (DeepSpeed's partition rule); FSDP2 chunks dim 0.
    exact = zero3_partition(spec, n) if zero else fsdp_rank_elements(spec, n)
    shard = exact if exact is not None else math.ceil(P / n)
    if s.dims.dp_replicate > 1:  # HSDP: the shards' gradients are all-reduced across the replicas too
        r = s.dims.dp_replicate
        comm["dp_replicate"] = 2 * (r - 1) / r * shard * z.reduce
    states = (shard * z.param, shard * z.grad, shard * z.optimizer)
    offloaded = getattr(s.options, "cpu_offload", False) or getattr(s.options, "offload_optimizer", None)
    if offloaded:
        comm["pcie"] = shard * (z.compute + z.grad)  # shards up before use, gradients down
        comm["host_optimizer"] = shard * (z.param + z.optimizer)
        return s.estimate(params=0, grads=0, optimizer=0, activations=s.activations(),
                          buffers=buffers + s.logits_grad(), host=sum(states), comm=comm)
    return s.estimate(params=states[0], grads=states[1], optimizer=states[2], activations=s.activations(),
                      buffers=buffers + s.logits_grad(), comm=comm)


def _megatron(s: Setup) -> Estimate:
    spec, z, dims = s.spec, s.sizes, s.dims
    t, p, c = dims.tp, dims.pp, dims.cp
    b, m = s.micro_batch, getattr(s.options, "microbatches", None) or 2 * p
    if not tensor_parallel(spec):
        raise ValueError(f"disttrain_megatron splits attention heads and MLPs of Llama, GPT-2, BERT-style and ViT "
                         f"blocks; a {spec.family} model has none it knows")
    if p > 1 and not pipelines(spec):
        raise ValueError(f"pipeline_parallel_size={p}: disttrain_megatron has no pipeline stages for this"
                         f" {spec.family} model (see disttrain.parallel.split.pipeline)")
    if spec.heads % t or spec.kv_heads % t:
        choices = [k for k in range(1, spec.kv_heads + 1) if spec.kv_heads % k == 0 and spec.heads % k == 0]
        raise ValueError(f"tensor_parallel_size={t} does not divide num_heads={spec.heads} (kv heads "
                         f"{spec.kv_heads}); choose one of {', '.join(map(str, choices))}")
    if spec.layers % p:
        raise ValueError(f"pipeline_parallel_size={p} does not divide the {spec.layers} layers")
    if c > 1 and not spec.extra.get("context_parallel"):
        raise ValueError(f"context_parallel_size={c}: disttrain_megatron splits the sequences of HF Llama-family"
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
    # rank (the plans split blocks only; embeddings, final norm and head are replicated, then FSDP-sharded).
    root = spec.root_params
    local = math.ceil((spec.layers // p * spec.layer_params - expert) / t) + (root if p == 1 else math.ceil(root / 2))
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
    if dims.shard > 1:
        buffers += 2 * block * z.compute + block * z.reduce
    n = dims.shard
    comm = {"dp": ((n - 1) / n * local + (expert_fsdp - 1) / expert_fsdp * expert / e) * (2 * z.compute + z.reduce)
            if n > 1 else 0.0,
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


def _recsys(s: Setup) -> Estimate:
    """torchrec: tables placed by its planner (fp32, fused optimizer in backward), the dense part replicated."""
    spec, z, n, b = s.spec, s.sizes, s.dims.world_size, s.micro_batch
    if not spec.table_rows:
        raise ValueError(f"disttrain_recsys shards embedding tables; a {spec.family} model has none")
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
    return s.estimate(params=table * 4 + dense * z.param, grads=dense * z.grad, optimizer=opt_tables + dense_opt,
                      activations=s.activations(), buffers=2 * pooled + dense * z.grad, comm=comm)


# The planner's formula of each engine (its strategies' rows find theirs here by engine class).
FORMULAS: dict[type, Callable[[Setup], Estimate]] = {
    DDPEngine: _replicated, FSDPEngine: _sharded, ZeroEngine: _sharded, MegatronEngine: _megatron,
    RecsysEngine: _recsys,
}
