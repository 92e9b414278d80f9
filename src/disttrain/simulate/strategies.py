"""The runners (each fills a :class:`~disttrain.simulate.core.Simulation` with its roles) and :func:`simulate`, which
chooses one by the structure the strategy's layout declares (:func:`runner_for`): tables placed by torchrec's
planner; flat partitions, computed by their rule; shards or model-parallel splits made by the engine's own code on
the fake group; or a replica, counted as it is."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Union

import torch

from disttrain.parallel import registry
from disttrain.parallel.engines.deepspeed import partition_elements
from disttrain.parallel.engines.layout import Dtype, Gather, Layout, Partition, Reduce
from disttrain.parallel.split.fsdp import shard_elements
from disttrain.simulate.core import (
    Role,
    Simulation,
    count,
    fake_world,
    fsdp_traffic,
    meta_model,
    precision_sizes,
    prepared,
)

CPU, META = torch.device("cpu"), torch.device("meta")
Config = Union[str, dict]


def replica(sim: Simulation, config: Config, options: Any) -> None:
    """A replica per rank (DDP): the module as it is, which is what the engine's wrapper keeps on every rank."""
    n = sim.dims.dp
    with fake_world(0, sim.world_size):
        # DistributedDataParallel's constructor checks shapes across ranks with .item(), which meta tensors lack;
        # it keeps the module's parameters as they are, so the model it would wrap is what every rank holds.
        module = prepared(config, sim.precision)
        p, g, o, c = count(module, sim.row.engine(options), replicas=n)  # type: ignore[misc]
    # The gradients all-reduced in their own dtype, bucket by bucket: a ring sends 2(n-1)/n of them.
    sim.roles.append(Role("every rank", 0, n, p, g, o, c, {"dp": 2 * (n - 1) / n * g}))
    sim.notes.append("replica: every rank holds the whole model (DistributedDataParallel cannot be built on meta"
                     " tensors; it keeps the module's parameters as they are); the checkpoint's replicated tensors are"
                     " written once (DCP de-duplication), shown as a 1/world share")


def sharded(sim: Simulation, config: Config, options: Any) -> None:
    """Shards (FSDP2) and model-parallel splits: the engine's own ``parallelize`` on the fake group, once per rank
    role: each pipeline stage x tensor-parallel rank at the first shard of its FSDP group, and for plain data
    sharding the last shard too (dim-0 chunks leave the last ranks fewer rows). Offloaded states are the same bytes
    in host memory: the engine, told not to allocate, shards them on the meta device as on the device."""
    dims, n = sim.dims, sim.world_size
    engine_cls = sim.row.engine
    compute, reduce = precision_sizes(sim.precision)
    model_parallel = dims.tp * dims.pp > 1
    shapes = [p.shape for p in meta_model(config).parameters()]
    by_shard = [shard_elements(shapes, i, dims.shard) for i in range(dims.shard)] if not model_parallel else []
    for stage in range(dims.pp):
        for tp_rank in range(dims.tp):
            for index in [0] if model_parallel else sorted({0, dims.shard - 1}):
                dp_shard, cp = divmod(index, dims.cp)  # the FSDP group is (dp_shard, cp) flattened
                rank = dims.rank_of(pp=stage, tp=tp_rank, dp_shard=dp_shard, cp=cp)
                with fake_world(rank, n):
                    module = prepared(config, sim.precision)
                    engine = engine_cls(options)  # type: ignore[misc]
                    engine.allocates = False
                    engine.setup_mesh(n, CPU)
                    engine.parallelize(module, META, sim.precision)
                    p, g, o, c = count(module, engine)
                    comm = {"dp": fsdp_traffic(module, dims.shard, compute, reduce)}
                    if dims.dp_replicate > 1:  # HSDP: the shards' gradients are all-reduced across the replicas
                        r = dims.dp_replicate
                        comm["dp_replicate"] = 2 * (r - 1) / r * g
                if model_parallel:
                    name = (f"pp stage {stage} x " if dims.pp > 1 else "") + f"tp rank {tp_rank}"
                    sim.roles.append(Role(name, rank, dims.dp * dims.cp, p, g, o, c, comm))
                    continue
                same = sum(1 for x in by_shard if x == by_shard[index]) * dims.dp_replicate
                if sim.roles and by_shard[index] == by_shard[0]:
                    sim.roles[0].name, sim.roles[0].ranks = "every rank", n  # equal shards everywhere: one role
                    continue
                name = "rank 0 (first shards)" if index == 0 else f"rank {rank} (last shards)"
                sim.roles.append(Role(name, rank, same, p, g, o, c, comm))
    if dims.ep > 1:
        sim.notes.append(f"expert parallelism: each rank keeps 1/{dims.ep} of every MoE layer's experts (whole experts),"
                         f" sharded over the {dims.dp_shard // dims.ep} ranks that hold the same ones; the rest over all"
                         f" {dims.shard}. Tokens go to their experts and back with all-to-all, which scales with the"
                         " batch: see the planner's estimate")
    if dims.cp > 1:
        sim.notes.append(f"context parallelism: the {dims.cp} ranks that split each sequence hold the same parameters,"
                         f" so FSDP shards them over dp_shard x cp ({dims.shard} ranks); their all-to-all traffic scales"
                         " with the sequence: see the planner's estimate")
    if model_parallel:
        sim.notes.append("pipeline split, tensor-parallel plan and FSDP over the data dimension by the engine's own"
                         " code on the fake group; each role is the first data-parallel rank of its stage x tp rank"
                         f" ({dims.dp * dims.cp} such ranks each, later ones hold the same or slightly fewer rows)")
        sim.notes.append("traffic: data-parallel traffic derived from the FSDP units' shapes; tensor-parallel and"
                         " pipeline traffic scale with activations (batch x sequence): see the planner's estimate")
        return
    sim.notes.append("FSDP2: fully_shard per block and root (the engine's own code) on the fake group; shards are"
                     " dim-0 chunks, so the first ranks hold ceil(rows/n) rows of each parameter and the last ranks"
                     " fewer; ranks between hold between these two")
    sim.notes.append("traffic: derived from the FSDP units' shapes (all-gather in forward and backward,"
                     " reduce-scatter of gradients); no step runs on meta shards")


def partitioned(sim: Simulation, config: Config, options: Any, layout: Layout) -> None:
    """Flat partitions (DeepSpeed ZeRO): the library's engine allocates and communicates on a real device and cannot
    start on a fake group, so each state is computed from the layout and the partition rule
    (:func:`disttrain.parallel.engines.deepspeed.partition_elements`, each parameter padded to a multiple of the
    ranks) over the meta model's parameters: a sharded state holds its partition, a replicated one everything."""
    numels = [p.numel() for p in meta_model(config).parameters()]
    total = sum(numels)

    def elements(sharded_over: tuple[str, ...]) -> int:
        n = math.prod(getattr(sim.dims, d) for d in sharded_over)
        return partition_elements(numels, n) if sharded_over else total

    def size(dtype: Dtype) -> int:
        return dtype.bytes(sim.precision)

    opt = layout.optimizer
    per_optimizer = 2 * size(opt.dtype) + (4 if opt.master else 0)  # AdamW's two moments (and the master copy)
    p = elements(layout.params.sharded_over) * size(layout.params.dtype)
    g = elements(layout.grads.sharded_over) * size(layout.grads.dtype)
    o = elements(opt.sharded_over) * per_optimizer
    n = opt.shards(sim.dims)
    compute, reduce = size(Dtype.COMPUTE), size(layout.grads.reduce_dtype)
    gathers = layout.params.gather.per_step if layout.params.gather is Gather.PER_UNIT else 0
    if layout.grads.reduce is Reduce.ALL_REDUCE:
        comm = {"dp": 2 * (n - 1) / n * total * reduce}
    else:  # each rank's partition of the gradients reduce-scattered, with the gathers per unit
        comm = {"dp": (n - 1) / n * total * (gathers * compute + reduce)}
    if layout.params.gather is Gather.AFTER_STEP:  # the updated partitions, once the optimizer step is done
        comm["after_step"] = (n - 1) / n * total * compute
    # The checkpoint holds what the optimizer steps: the fp32 master copy and moments (else the parameters too).
    checkpoint = o if opt.master else o + p
    sim.roles.append(Role("every rank", 0, sim.world_size, p, g, o, checkpoint, comm))
    sim.notes.append("flat partitions: DeepSpeed cannot run on a fake process group; each state is computed from the"
                     " layout and DeepSpeed's own partition rule (each parameter padded to a multiple of the ranks,"
                     f" ceil(numel/n) elements per rank); the checkpoint holds the optimizer's partitions")


def recsys(sim: Simulation, config: Config, options: Any) -> None:
    """torchrec's planner (the engine's ``plan``, same constraints and sharders) on a topology of ``world_size``
    GPUs; each rank's table shards are read from the sharding plan it returns."""
    from disttrain.parallel.engines import recsys as rs
    from disttrain.planner.spec import recipe_model

    n = sim.world_size
    recipe = config if isinstance(config, dict) else _recipe(config)
    model_cfg = recipe.get("model", recipe) if not isinstance(config, str) else recipe_model(config)
    if options == rs.RecsysOptions():  # the recipe's strategy: section, as the daily job reads it
        section = recipe.get("strategy") or {}
        options = rs.RecsysOptions(sharding_types=section.get("sharding_types"),
                                   constraints=section.get("constraints") or {})
    fused = rs.fused_params(options, model_cfg.get("sparse_optimizer"))
    module = meta_model({"model": model_cfg})
    rs.quiet_planner_logs()
    plan = rs.plan(module, options, n, torch.device("cuda"), rs.sharders(fused))
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    rowwise = fused["optimizer"] == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    dense = [p for name, p in module.named_parameters() if not name.startswith("ebc.")]
    d = sum(p.numel() for p in dense) * 4
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, (elements, rows) in enumerate(rs.shards_per_rank(plan, n)):
        table_opt = rows * 4 if rowwise else elements * 4
        groups.setdefault((elements * 4, table_opt), []).append(rank)
    for (tp_bytes, to_bytes), ranks in sorted(groups.items(), key=lambda kv: -kv[0][0]):
        name = "rank " + ", ".join(map(str, ranks[:4])) + (" ..." if len(ranks) > 4 else "")
        ckpt = tp_bytes + to_bytes + 3 * d / n  # dense params and Adam states written once (DCP de-duplication)
        sim.roles.append(Role(name, ranks[0], len(ranks), tp_bytes + d, d, to_bytes + 2 * d, int(ckpt),
                              {"dp": 2 * (n - 1) / n * d}))
    sim.notes.append("recsys: torchrec's EmbeddingShardingPlanner (the engine's plan(), constraints and sharders)"
                     f" on a topology of {n} GPUs; bytes read from the table shards of its sharding plan; the fused"
                     " table optimizer keeps no table gradients; dense part replicated (DDP, Adam)")
    sim.notes.append("traffic: dense all-reduce only; the embedding all-to-all scales with the batch: see the"
                     " planner's estimate")


def _recipe(path: str) -> dict:
    import yaml

    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


Runner = Callable[[Simulation, Config, Any], None]


def runner_for(layout: Layout) -> Runner:
    """The runner for the structure ``layout`` declares: tables placed by torchrec's planner; flat partitions (a
    library's own engine, which cannot start on a fake group), computed by their rule; shards or model-parallel
    splits, made by the engine's own code on the fake group; a replica, counted as it is."""
    if layout.tables:
        return recsys
    if layout.sharded and layout.partition is Partition.FLAT:
        return lambda sim, config, options: partitioned(sim, config, options, layout)
    if layout.sharded or layout.split_by:
        return sharded
    return replica


def simulated() -> list[str]:
    """The registered names the simulator runs (every strategy with an engine, hence a layout)."""
    return [row.name for row in registry.STRATEGIES if row.engine is not None]


def simulate(config: Config, strategy: str, world_size: int, *, precision: str = "bf16-mixed",
             **options: Any) -> Simulation:
    """Shard the model of ``config`` (a recipe YAML path or its ``model:`` mapping) with ``strategy`` (a registered
    name) on a fake world of ``world_size`` ranks and count what each rank role holds (see
    :mod:`disttrain.simulate.core`).

    ``options`` are the strategy's own (``tensor_parallel_size=2`` for ``disttrain_megatron``, ``hybrid_shard=True,
    shard_size=8`` for ``disttrain_fsdp``): they set the degrees (``Simulation.dims``) as in a run, and sizes the
    real run refuses raise the real run's error. The ``_offload`` strategies hold the same states, on the host.
    """
    row = registry.lookup(strategy)
    if row.engine is None:
        raise ValueError(f"strategy={strategy!r} is not simulated; choose one of {', '.join(simulated())}")
    opts = row.options(**options)
    dims = row.dims(world_size, opts)
    layout = row.engine.layout(opts)
    start = time.perf_counter()
    sim = Simulation(row.name, dims, precision, row.given(opts), layout=layout)
    runner_for(layout)(sim, config, opts)
    sim.seconds = time.perf_counter() - start
    return sim
