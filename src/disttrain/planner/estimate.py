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

from disttrain.parallel.families import family_named
from disttrain.planner.shards import first_rank_elements, zero3_partition_elements
from disttrain.planner.spec import ModelLike, ModelSpec, model_spec

STRATEGIES = ("disttrain_ddp", "disttrain_fsdp", "disttrain_fsdp_offload", "disttrain_zero3",
              "disttrain_zero3_offload", "disttrain_megatron", "disttrain_recsys")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "adagrad": 1, "sgd": 0, "rowwise_adagrad": 0}
ZERO3_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


@dataclass
class Estimate:
    """Bytes per rank (the busiest rank where ranks differ) and bytes moved per optimizer step.

    ``comm`` holds per-rank bytes per step: ``dp`` (data-parallel collectives, overlapped with compute), ``tp``
    (tensor-parallel all-reduces, on the critical path), ``pp`` (pipeline sends), ``a2a`` (embedding all-to-all),
    ``pcie`` (offload copies) and ``host_optimizer`` (state a CPU optimizer sweeps).
    """

    strategy: str
    world_size: int
    micro_batch: int
    seq_len: int
    precision: str
    activation_checkpointing: bool
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    host: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    comm: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Peak device bytes of this rank."""
        return self.states + self.activations + self.buffers

    @property
    def label(self) -> str:
        if self.strategy != "disttrain_megatron":
            return self.strategy
        dp = self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)
        return f"{self.strategy} tp={self.tensor_parallel_size} pp={self.pipeline_parallel_size} dp={dp}"


def _precision_bytes(precision: str, strategy: str, optimizer: str) -> tuple[int, int, int, int, int]:
    """(param, grad, optimizer-state, compute, reduce) bytes per parameter element."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not planned for; choose one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not known; choose one of {', '.join(OPTIMIZER_STATES)}")
    states = OPTIMIZER_STATES[optimizer]
    zero = strategy.startswith("disttrain_zero3")
    if precision == "32-true":
        # DeepSpeed ZeRO-3 keeps an fp32 master copy of its partition even when the parameters are fp32.
        return 4, 4, 4 * states + (4 if zero else 0), 4, 4
    if precision.endswith("-true"):
        return 2, 2, 2 * states, 2, 2
    if zero:  # 16-bit partitions + fp32 master + fp32 optimizer state (the ZeRO paper's 2 + 2 + 12)
        return 2, 2, 4 + 4 * states, 2, 2
    # FSDP2 MixedPrecisionPolicy / autocast: fp32 parameters, gradients and state; 16-bit compute, fp32 reduction.
    return 4, 4, 4 * states, 2, 4


def activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int,
                     activation_checkpointing: bool = False, tensor_parallel_size: int = 1) -> int:
    """Bytes saved for backward by one micro-batch's forward (see the module docstring for the coefficients)."""
    family = family_named(spec.family)
    if family is not None and family.analytic:
        return family.activation_bytes(spec, micro_batch, seq_len, compute_bytes, activation_checkpointing,
                                       tensor_parallel_size)
    measured = spec.extra.get("activations")
    if measured is None:  # a module without an input to run it on: see Plan.reasons
        return 0
    return measured.profile(micro_batch, seq_len).activation_bytes(compute_bytes, tensor_parallel_size,
                                                                   activation_checkpointing)


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


def estimate(model_or_config: ModelLike, strategy: str, world_size: int, micro_batch: int = 1,
             seq_len: int | None = None, precision: str = "bf16-mixed", activation_checkpointing: bool = False,
             offload: bool | None = None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
             optimizer: str | None = None, microbatches: int | None = None) -> Estimate:
    """Per-rank bytes of ``model_or_config`` trained with ``strategy`` on ``world_size`` ranks.

    ``seq_len`` defaults to the model's (ViT: its patch count + 1; Llama: ``max_position_embeddings``).
    ``offload=True`` turns ``disttrain_fsdp``/``disttrain_zero3`` into their ``_offload`` variants.
    ``optimizer`` is "adamw" (default) or "adagrad"/"sgd"/"rowwise_adagrad" (DeepFM's tables default to Adagrad).
    ``microbatches``: pipeline microbatches the ``micro_batch`` samples are split into (``disttrain_megatron``'s
    default, ``2 * pipeline_parallel_size``, when None).
    """
    spec = model_spec(model_or_config)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not planned for; choose one of {', '.join(STRATEGIES)}")
    if offload and strategy in ("disttrain_fsdp", "disttrain_zero3"):
        strategy += "_offload"
    for name, value in (("world_size", world_size), ("micro_batch", micro_batch),
                        ("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    t, p = tensor_parallel_size, pipeline_parallel_size
    if strategy != "disttrain_megatron" and (t, p) != (1, 1):
        raise ValueError(f"tensor_parallel_size={t}, pipeline_parallel_size={p} need strategy='disttrain_megatron'")
    seq = int(seq_len or spec.tokens or 1)
    recsys_opt = spec.extra.get("recsys", {}).get("sparse_optimizer") or "adagrad"
    opt = optimizer or (recsys_opt if spec.table_rows and strategy == "disttrain_recsys" else "adamw")
    pb, gb, ob, cb, rb = _precision_bytes(precision, strategy, opt)
    n, P = world_size, spec.params
    est = dict(strategy=strategy, world_size=n, micro_batch=micro_batch, seq_len=seq, precision=precision,
               activation_checkpointing=activation_checkpointing, tensor_parallel_size=t, pipeline_parallel_size=p)
    acts = activation_bytes(spec, micro_batch, seq, cb if precision != "32-true" else 4, activation_checkpointing)
    lm = spec.extra.get("lm_logits", False)
    logits_grad = micro_batch * seq * spec.vocab * 4 if lm else 0
    samples = micro_batch * n  # the global batch every strategy is compared on (one micro-batch per rank)

    if strategy == "disttrain_ddp":
        comm = {"dp": 2 * (n - 1) / n * P * gb}
        return Estimate(params=P * pb, grads=P * gb, optimizer=P * ob, activations=acts,
                        buffers=P * gb + logits_grad, comm=comm, **est)  # buckets: a second copy of the gradients

    if strategy.startswith(("disttrain_fsdp", "disttrain_zero3")):
        zero = strategy.startswith("disttrain_zero3")
        unit = spec.largest_unit
        if zero:
            # The module being used and the one prefetched, and the reduce bucket DeepSpeed allocates whole
            # (reduce_bucket_size elements) when contiguous_gradients is on, as our config sets it.
            buffers = 2 * unit * cb + ZERO3_REDUCE_BUCKET * gb
        else:
            # FSDP2 keeps the root (embeddings, head) gathered through forward and backward, gathers one block
            # and prefetches the next, and reduce-scatters one block's unsharded gradients.
            root = spec.root_params if spec.layers else 0
            block = spec.layer_params or unit
            buffers = root * cb + 2 * block * cb + block * rb
        comm = {"dp": (n - 1) / n * P * (2 * cb + rb)}  # all-gather forward and backward, reduce-scatter
        # ZeRO-3 pads each parameter to a multiple of n (DeepSpeed's partition rule); FSDP2 chunks dim 0.
        exact = zero3_partition_elements(spec, n) if zero else first_rank_elements(spec, n)
        shard = exact if exact is not None else math.ceil(P / n)
        states = (shard * pb, shard * gb, shard * ob)
        if strategy.endswith("_offload"):
            comm["pcie"] = shard * (cb + gb)  # shards up before use, gradients down
            comm["host_optimizer"] = shard * (pb + ob)
            return Estimate(params=0, grads=0, optimizer=0, activations=acts, buffers=buffers + logits_grad,
                            host=sum(states), comm=comm, **est)
        return Estimate(params=states[0], grads=states[1], optimizer=states[2], activations=acts,
                        buffers=buffers + logits_grad, comm=comm, **est)

    if strategy == "disttrain_megatron":
        return _megatron(spec, est, n, t, p, micro_batch, seq, activation_checkpointing, (pb, gb, ob, cb, rb),
                         samples, microbatches or 2 * p)
    return _recsys(spec, est, n, micro_batch, (pb, gb, ob, cb, rb), acts, opt)


def tensor_parallel(spec: ModelSpec) -> bool:
    """Whether disttrain_megatron has a tensor-parallel plan for the model."""
    return bool(spec.extra.get("tensor_parallel"))


def pipelines(spec: ModelSpec) -> bool:
    """Whether disttrain_megatron can split the model into pipeline stages."""
    return bool(spec.extra.get("pipeline"))


def _megatron(spec: ModelSpec, est: dict, n: int, t: int, p: int, b: int, s: int, ac: bool,
              sizes: tuple[int, int, int, int, int], samples: int, m: int) -> Estimate:
    pb, gb, ob, cb, rb = sizes
    if not tensor_parallel(spec):
        raise ValueError(f"disttrain_megatron splits attention heads and MLPs of Llama, GPT-2, BERT-style and ViT "
                         f"blocks; a {spec.family} model has none it knows")
    if p > 1 and not pipelines(spec):
        raise ValueError(f"pipeline_parallel_size={p}: disttrain_megatron has no pipeline stages for this"
                         f" {spec.family} model (see disttrain.parallel.pipeline)")
    if n % (t * p):
        raise ValueError(f"tensor_parallel_size={t} x pipeline_parallel_size={p} does not divide world_size={n}")
    if spec.heads % t or spec.kv_heads % t:
        choices = [k for k in range(1, spec.kv_heads + 1) if spec.kv_heads % k == 0 and spec.heads % k == 0]
        raise ValueError(f"tensor_parallel_size={t} does not divide num_heads={spec.heads} (kv heads "
                         f"{spec.kv_heads}); choose one of {', '.join(map(str, choices))}")
    if spec.layers % p:
        raise ValueError(f"pipeline_parallel_size={p} does not divide the {spec.layers} layers")
    dp = n // (t * p)
    # The busiest stage: its share of the blocks, split across the tensor-parallel ranks (column/row-split
    # layers), plus (pipeline) the bigger end or (no pipeline) both ends, which stay whole on every tensor-parallel
    # rank (the plans split blocks only; embeddings, final norm and head are replicated, then FSDP-sharded).
    root = spec.root_params
    local = math.ceil(spec.layers // p * spec.layer_params / t) + (root if p == 1 else math.ceil(root / 2))
    exact = first_rank_elements(spec, dp, t) if p == 1 else None
    shard = exact if exact is not None else math.ceil(local / dp)  # FSDP on the data dimension
    cb_act = cb if est["precision"] != "32-true" else 4
    per_mb = activation_bytes(spec, b, s, cb_act, ac, tensor_parallel_size=t)
    # 1F1B: the first stage holds min(p, m) pipeline microbatches (b/m samples each) of its layers/p blocks.
    acts = per_mb * min(p, m) / (p * m) if p > 1 else per_mb
    micro_steps = t * p  # micro-batches per data-parallel group for the same global batch as the other strategies
    width = s * b * spec.hidden * cb
    buffers = 2 * width * (t > 1) + 2 * width * (p > 1)
    if dp > 1:
        buffers += 2 * math.ceil(spec.layer_params / t) * cb + math.ceil(spec.layer_params / t) * rb
    comm = {"dp": (dp - 1) / dp * local * (2 * cb + rb) if dp > 1 else 0.0,
            # two all-reduces forward and two backward per block (attention and MLP), ring: 2(t-1)/t of the tensor
            "tp": 4 * (spec.layers // p) * 2 * (t - 1) / t * width * micro_steps if t > 1 else 0.0,
            "pp": 2 * width * micro_steps if p > 1 else 0.0,
            "bubble": (p - 1) / (micro_steps + p - 1)}
    return Estimate(params=shard * pb, grads=shard * gb, optimizer=shard * ob, activations=acts, buffers=buffers,
                    comm=comm, **est)


def table_placement(rows: tuple[int, ...], world_size: int) -> list[list[int]]:
    """Table-wise sharding: each table whole on one rank, largest first onto the least loaded rank."""
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(rows)), key=lambda i: -rows[i]):
        r = load.index(min(load))
        ranks[r].append(i)
        load[r] += rows[i]
    return ranks


def torchrec_placement(spec: ModelSpec, world_size: int) -> list[tuple[int, int]] | None:
    """(table elements, table rows) per rank as torchrec's planner places the tables (the engine's ``plan``, with
    the recipe's sharding types and constraints), or None without torchrec."""
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return None
    settings = spec.extra.get("recsys", {})
    key = (spec.table_rows, spec.embedding_dim, world_size, repr(settings))
    if key not in _PLACEMENTS:
        _PLACEMENTS[key] = _plan_tables(spec, world_size, settings)
    return _PLACEMENTS[key]


_PLACEMENTS: dict[tuple, list[tuple[int, int]]] = {}


def _plan_tables(spec: ModelSpec, world_size: int, settings: dict) -> list[tuple[int, int]]:
    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from disttrain.parallel import recsys as rs

    class Tables(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # DeepFMNet's table and feature names, so the recipe's constraints name the same tables.
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=spec.embedding_dim, num_embeddings=rows,
                                   feature_names=[f"cat_{i}"]) for i, rows in enumerate(spec.table_rows)],
                device=torch.device("meta"))

    options = rs.RecsysOptions(sharding_types=settings.get("sharding_types"),
                               constraints=dict(settings.get("constraints") or {}))
    fused = rs.fused_params(options, {"name": settings["sparse_optimizer"]} if settings.get("sparse_optimizer")
                            else None)
    rs.quiet_planner_logs()
    plan = rs.plan(Tables(), options, world_size, torch.device("cuda"), rs.sharders(fused))
    per_rank = [[0, 0] for _ in range(world_size)]
    for shardings in plan.plan.values():
        for sharding in shardings.values():
            for shard in sharding.sharding_spec.shards:
                rows, cols = shard.shard_sizes
                per_rank[shard.placement.rank()][0] += rows * cols
                per_rank[shard.placement.rank()][1] += rows
    return [(elements, rows) for elements, rows in per_rank]


def _recsys(spec: ModelSpec, est: dict, n: int, b: int, sizes: tuple[int, int, int, int, int],
            acts: int, optimizer: str) -> Estimate:
    pb, gb, ob, cb, rb = sizes
    if not spec.table_rows:
        raise ValueError(f"disttrain_recsys shards embedding tables; a {spec.family} model has none")
    placed = torchrec_placement(spec, n)
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
    opt_tables = 4 * (rows if optimizer == "rowwise_adagrad" else table * OPTIMIZER_STATES[optimizer])
    dense_opt = dense * 4 * OPTIMIZER_STATES["adam"]
    pooled = int(b * n * busiest_tables * spec.embedding_dim * cb)  # this rank's tables looked up for the batch
    comm = {"dp": 2 * (n - 1) / n * dense * gb,
            "a2a": 2 * (n - 1) / n * b * len(spec.table_rows) * spec.embedding_dim * cb}
    return Estimate(params=table * 4 + dense * pb, grads=dense * gb, optimizer=opt_tables + dense_opt,
                    activations=acts, buffers=2 * pooled + dense * gb, comm=comm, **est)
