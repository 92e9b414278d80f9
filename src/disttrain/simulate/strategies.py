"""One function per simulated strategy (fill a :class:`~disttrain.simulate.core.Simulation` with its roles), and
:func:`simulate`, which picks one."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Optional, Union

import torch

from disttrain.simulate.core import (
    SIMULATED,
    Role,
    Simulation,
    precision_sizes,
    count,
    fake_world,
    fsdp_traffic,
    meta_model,
    prepared,
)

CPU, META = torch.device("cpu"), torch.device("meta")
Config = Union[str, dict]


def chunk_numel(shapes: list[torch.Size], rank: int, n: int) -> int:
    """Elements FSDP2 leaves on ``rank`` of ``n``: each parameter's dim-0 ``torch.chunk`` (ceil(rows/n) rows per
    rank, the last ranks fewer or none)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if len(shape) else 1
        per = math.ceil(rows / n)
        mine = max(0, min(per, rows - rank * per))
        total += mine * (math.prod(shape[1:]) if len(shape) > 1 else 1)
    return total


def ddp(sim: Simulation, config: Config, **_: Any) -> None:
    from disttrain.parallel.ddp import DDPEngine, DDPOptions

    n = sim.world_size
    with fake_world(0, n):
        # DistributedDataParallel's constructor checks shapes across ranks with .item(), which meta tensors lack;
        # it keeps the module's parameters as they are, so the model it would wrap is what every rank holds.
        module = prepared(config, sim.precision)
        p, g, o, c = count(module, DDPEngine(DDPOptions()), replicas=n)
    # DDP all-reduces the gradients in their own dtype, bucket by bucket: a ring sends 2(n-1)/n of them.
    sim.roles.append(Role("every rank", 0, n, p, g, o, c, {"dp": 2 * (n - 1) / n * g}))
    sim.notes.append("DDP: every rank holds the whole model (DistributedDataParallel cannot be built on meta tensors;"
                     " it keeps the module's parameters as they are); the checkpoint's replicated tensors are written"
                     " once (DCP de-duplication), shown as a 1/world share")


def fsdp(sim: Simulation, config: Config, hybrid_shard_size: Optional[int] = None, **_: Any) -> None:
    from disttrain.parallel.engine import FSDPEngine
    from disttrain.parallel.fsdp import FSDPOptions

    n = sim.world_size
    options = FSDPOptions(hybrid_shard=hybrid_shard_size is not None, shard_size=hybrid_shard_size)
    shard = hybrid_shard_size or n
    shapes = [p.shape for p in meta_model(config).parameters()]
    by_rank = [chunk_numel(shapes, r, shard) for r in range(shard)]
    compute, reduce = precision_sizes(sim.precision)
    for rank in sorted({0, shard - 1}):
        with fake_world(rank, n):
            module = prepared(config, sim.precision)
            engine = FSDPEngine(options)
            engine.allocates = False
            engine.setup_mesh(n, CPU, local_size=hybrid_shard_size)
            engine.parallelize(module, META, sim.precision)
            p, g, o, c = count(module, engine)
            comm = {"dp": fsdp_traffic(module, shard, compute, reduce)}
            if shard < n:  # HSDP: the shards' gradients are all-reduced across the replicas
                replicas = n // shard
                comm["dp_replicate"] = 2 * (replicas - 1) / replicas * g
        same = sum(1 for x in by_rank if x == by_rank[rank]) * (n // shard)
        if sim.roles and by_rank[rank] == by_rank[0]:
            sim.roles[0].name, sim.roles[0].ranks = "every rank", n  # equal shards everywhere: one role
            continue
        name = "rank 0 (first shards)" if rank == 0 else f"rank {rank} (last shards)"
        sim.roles.append(Role(name, rank, same, p, g, o, c, comm))
    sim.notes.append("FSDP2: fully_shard per block and root (the engine's own code) on the fake group; shards are"
                     " dim-0 chunks, so the first ranks hold ceil(rows/n) rows of each parameter and the last ranks"
                     " fewer; ranks between hold between these two")
    sim.notes.append("traffic: derived from the FSDP units' shapes (all-gather in forward and backward,"
                     " reduce-scatter of gradients); no step runs on meta shards")


def zero3(sim: Simulation, config: Config, **_: Any) -> None:
    """DeepSpeed cannot start on a fake group (its engine allocates and communicates on a real device), so the
    partition is computed with DeepSpeed's own rule (``partition_parameters``: each parameter padded to a multiple
    of the world size, ``ceil(numel / n)`` elements per rank) over the meta model's parameters."""
    n = sim.world_size
    part = sum(math.ceil(p.numel() / n) for p in meta_model(config).parameters())
    half = sim.precision != "32-true"
    pb = 2 if half else 4
    # 16-bit partitions of parameters and gradients, fp32 master partition + AdamW's two fp32 states.
    p, g, o = part * pb, part * pb, part * 12
    numel = sum(p.numel() for p in meta_model(config).parameters())
    comm = {"dp": (n - 1) / n * numel * pb * 3}  # all-gather forward and backward, reduce-scatter gradients
    sim.roles.append(Role("every rank", 0, n, p, g, o, part * 12, comm))
    sim.notes.append("ZeRO-3: DeepSpeed cannot run on a fake process group; its partition is computed from"
                     " DeepSpeed's own rule (each parameter padded to a multiple of the world size, ceil(numel/n)"
                     " elements per rank); the checkpoint holds the fp32 master and AdamW partitions")


def megatron(sim: Simulation, config: Config, **_: Any) -> None:
    from disttrain.parallel.megatron import MegatronEngine, MegatronOptions
    from disttrain.parallel.mesh import ParallelDims

    n, t, pp = sim.world_size, sim.tensor_parallel_size, sim.pipeline_parallel_size
    dims = ParallelDims(world_size=n, tp=t, pp=pp)  # the real run's size check and error
    compute, reduce = precision_sizes(sim.precision)
    for stage in range(pp):
        for tp_rank in range(t):
            rank = stage * dims.dp * t + tp_rank  # mesh order (pp, dp, tp): dp rank 0 of this stage and tp rank
            with fake_world(rank, n):
                module = prepared(config, sim.precision)
                engine = MegatronEngine(MegatronOptions(tensor_parallel_size=t, pipeline_parallel_size=pp))
                engine.allocates = False
                engine.setup_mesh(n, CPU)
                engine.parallelize(module, META, sim.precision)
                p, g, o, c = count(module, engine)
                comm = {"dp": fsdp_traffic(module, dims.dp, compute, reduce)}
            name = (f"pp stage {stage} x " if pp > 1 else "") + f"tp rank {tp_rank}"
            sim.roles.append(Role(name, rank, dims.dp, p, g, o, c, comm))
    sim.notes.append("megatron: pipeline split, tensor-parallel plan and FSDP over dp by the engine's own code on"
                     f" the fake group; each role is dp rank 0 of its stage x tp rank ({dims.dp} dp ranks each,"
                     " later dp ranks hold the same or slightly fewer rows)")
    sim.notes.append("traffic: data-parallel traffic derived from the FSDP units' shapes; tensor-parallel and"
                     " pipeline traffic scale with activations (batch x sequence): see the planner's estimate")


def recsys(sim: Simulation, config: Config, **_: Any) -> None:
    """torchrec's planner (the engine's ``plan``, same constraints and sharders) on a topology of ``world_size``
    GPUs; each rank's table shards are read from the sharding plan it returns."""
    from disttrain.parallel import recsys as rs
    from disttrain.planner.spec import recipe_model

    n = sim.world_size
    recipe = config if isinstance(config, dict) else _recipe(config)
    model_cfg = recipe.get("model", recipe) if not isinstance(config, str) else recipe_model(config)
    constraints = (recipe.get("strategy") or {}).get("constraints") or {}
    types = (recipe.get("strategy") or {}).get("sharding_types")
    options = rs.RecsysOptions(sharding_types=types, constraints=constraints)
    fused = rs.fused_params(options, model_cfg.get("sparse_optimizer"))
    from disttrain.recsys.model import DeepFMNet

    module = DeepFMNet(**{k: v for k, v in model_cfg.items()}, device="meta")
    rs.quiet_planner_logs()
    plan = rs.plan(module, options, n, torch.device("cuda"), rs.sharders(fused))
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    rowwise = fused["optimizer"] == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    table_params, table_opt = Counter(), Counter()
    for _, shardings in plan.plan.items():
        for _, sharding in shardings.items():
            for shard in sharding.sharding_spec.shards:
                rank = shard.placement.rank()
                rows, cols = shard.shard_sizes
                table_params[rank] += rows * cols * 4
                table_opt[rank] += rows * 4 if rowwise else rows * cols * 4
    dense = [p for name, p in module.named_parameters() if not name.startswith("ebc.")]
    d = sum(p.numel() for p in dense) * 4
    groups: dict[tuple[int, int], list[int]] = {}
    for rank in range(n):
        groups.setdefault((table_params[rank], table_opt[rank]), []).append(rank)
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


RUNNERS = {"disttrain_ddp": ddp, "disttrain_fsdp": fsdp, "disttrain_zero3": zero3, "disttrain_megatron": megatron,
           "disttrain_recsys": recsys}


def simulate(config: Union[str, dict], strategy: str, world_size: int, *, tensor_parallel_size: int = 1,
             pipeline_parallel_size: int = 1, precision: str = "bf16-mixed", hybrid_shard_size: Optional[int] = None,
             ) -> Simulation:
    """Shard the model of ``config`` (a recipe YAML path or its ``model:`` mapping) with ``strategy`` on a fake
    world of ``world_size`` ranks and count what each rank role holds (see the module docstring).

    ``tensor_parallel_size``/``pipeline_parallel_size``: ``disttrain_megatron``'s sizes (data parallel is what is
    left). ``hybrid_shard_size``: ``disttrain_fsdp`` with ``hybrid_shard=True`` and that many ranks per shard group.
    Sizes the real run refuses raise the real run's error.
    """
    if strategy not in SIMULATED:
        raise ValueError(f"strategy={strategy!r} is not simulated; choose one of {', '.join(SIMULATED)}"
                         " (the _offload variants hold the same states, on the host)")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if strategy != "disttrain_megatron" and (tensor_parallel_size, pipeline_parallel_size) != (1, 1):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}, pipeline_parallel_size="
                         f"{pipeline_parallel_size} need strategy='disttrain_megatron'")
    start = time.perf_counter()
    sim = Simulation(strategy, world_size, precision, tensor_parallel_size, pipeline_parallel_size)
    runner = RUNNERS[strategy]
    runner(sim, config, hybrid_shard_size=hybrid_shard_size)
    sim.seconds = time.perf_counter() - start
    return sim
