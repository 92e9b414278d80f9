"""torchrec DistributedModelParallel for the ``disttrain_recsys`` strategies, in torch terms (no lightning here).

Embedding tables (``EmbeddingBagCollection``) are sharded by torchrec's planner across all ranks with the fused
(fbgemm) kernel, whose optimizer runs inside backward; everything else is data-parallel (DMP wraps it in DDP).
``RecsysEngine`` is what the Trainer and Fabric adapters share: options, sharding, checkpoints.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from disttrain.parallel import checkpoint as ckpt

# Sharding types the planner may choose per table by default. data_parallel is left out: replicating a table
# would defeat the point of the strategy (torchrec's planner picks it for small tables on one process).
DEFAULT_SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")
SPARSE_OPTIMIZERS = ("adagrad", "rowwise_adagrad", "sgd")
FUSED_OPTIMIZER_KEY = "fused_optimizer"


@dataclass
class RecsysOptions:
    """What a user can set on ``disttrain_recsys`` (the same names on the Trainer and Fabric strategies).

    sharding_types: sharding types the planner may choose from for every table (default: table_wise,
        column_wise, table_column_wise, row_wise, table_row_wise; "data_parallel" to allow replication).
    constraints: per-table overrides, ``{"table_name": {"sharding_types": ["row_wise"], "min_partition": 8}}``
        (keyword arguments of torchrec's ``ParameterConstraints``).
    sparse_optimizer: the fused in-backward optimizer of the tables when the model does not name one:
        "adagrad", "rowwise_adagrad" or "sgd" (the ones fbgemm runs on CPU too).
    sparse_lr: its learning rate (the model's ``sparse_optimizer`` mapping wins when present).
    sparse_eps: its epsilon.
    batch_size: the per-rank batch size the planner assumes when it estimates costs.
    """

    sharding_types: Optional[list[str]] = None
    constraints: dict[str, dict[str, Any]] = field(default_factory=dict)
    sparse_optimizer: str = "adagrad"
    sparse_lr: float = 0.05
    sparse_eps: float = 1e-8
    batch_size: int = 512

    def __post_init__(self) -> None:
        from torchrec.distributed.types import ShardingType

        known = [t.value for t in ShardingType]
        for where, types in [("sharding_types", self.sharding_types or [])] + \
                [(f"constraints[{name!r}]", c.get("sharding_types") or []) for name, c in self.constraints.items()]:
            for kind in types:
                if kind not in known:
                    raise ValueError(f"{where} has unknown sharding type {kind!r}; choose from {', '.join(known)}")
        if self.sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse_optimizer={self.sparse_optimizer!r} is not supported by the fused kernel;"
                             f" choose one of {', '.join(SPARSE_OPTIMIZERS)}")


def _is_embedding_module(module: nn.Module) -> bool:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
        return True
    try:
        from torchrec.distributed.types import ShardedModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, ShardedModule)


def has_torchrec_tables(module: nn.Module) -> bool:
    """Whether ``module`` holds torchrec embedding tables (plain or already sharded)."""
    if "torchrec" not in sys.modules:
        # No table can exist without torchrec imported. Importing it here would also be wrong: under DeepSpeed it
        # can run after zero.Init patched nn.Module subclassing, and torchrec's Generic modules then fail to build.
        return False
    try:
        return any(_is_embedding_module(m) for m in module.modules())
    except ImportError:  # torchrec not installed: no module can hold its tables
        return False


def refuse_torchrec_tables(module: nn.Module, strategy_name: str) -> None:
    """Raise a clear error when a non-recsys strategy is given a model with torchrec tables: DDP/FSDP/ZeRO would
    replicate or flatten the tables (and wrap a DistributedModelParallel a second time)."""
    if has_torchrec_tables(module):
        raise TypeError(
            f"strategy {strategy_name!r} cannot train a model with torchrec embedding tables"
            f" ({type(module).__name__}); use strategy='disttrain_recsys', which shards the tables with"
            " DistributedModelParallel and keeps the dense part data-parallel")


def dense_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters outside torchrec's embedding modules: what the dense optimizer (Adam) updates. The tables
    are updated by the fused optimizer inside backward."""
    skip: set[int] = set()
    for m in module.modules():
        if _is_embedding_module(m):
            skip.update(id(p) for p in m.parameters())
    return [p for p in module.parameters() if id(p) not in skip and p.requires_grad]


def fused_params(options: RecsysOptions, model_spec: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """fbgemm's fused-kernel optimizer arguments from the options, overridden by the model's own
    ``sparse_optimizer`` mapping (``{"name": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8}``)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    spec = {"name": options.sparse_optimizer, "lr": options.sparse_lr, "eps": options.sparse_eps,
            **(model_spec or {})}
    kinds = {"adagrad": EmbOptimType.EXACT_ADAGRAD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
             "sgd": EmbOptimType.EXACT_SGD}
    if spec["name"] not in kinds:
        raise ValueError(f"sparse optimizer {spec['name']!r} is not supported by the fused kernel; choose one of"
                         f" {', '.join(kinds)}")
    params: dict[str, Any] = {"optimizer": kinds[spec["name"]], "learning_rate": float(spec["lr"])}
    if spec["name"] != "sgd":
        params["eps"] = float(spec["eps"])
    return params


def sharders(fused: dict[str, Any]) -> list[Any]:
    """The EmbeddingBagCollection sharder, with row-wise sharding allowed on CPU too: torchrec offers it on CUDA
    only, although the CPU kernels and gloo collectives run it."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class Sharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            extra = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]
            return types + [t for t in extra if t not in types]

    return [Sharder(fused_params=fused)]


def table_names(module: nn.Module) -> list[str]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return [t.name for m in module.modules() if isinstance(m, EmbeddingBagCollection)
            for t in m.embedding_bag_configs()]


def plan(module: nn.Module, options: RecsysOptions, world_size: int, device: torch.device,
         module_sharders: list[Any], pg: Any = None) -> Any:
    """torchrec's planner with our constraints; collective (all ranks agree) when a process group is given."""
    from torchrec.distributed.comm import get_local_size
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    names = table_names(module)
    unknown = sorted(set(options.constraints) - set(names))
    if unknown:
        raise ValueError(f"constraints name tables {unknown} that the model does not have; its tables are {names}")
    default = list(options.sharding_types or DEFAULT_SHARDING_TYPES)
    constraints = {name: ParameterConstraints(**{"sharding_types": default, **options.constraints.get(name, {})})
                   for name in names}
    topology = Topology(world_size=world_size, compute_device=device.type,
                        local_world_size=get_local_size(world_size))
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, batch_size=options.batch_size,
                                       debug=False)
    return planner.collective_plan(module, module_sharders, pg) if pg is not None \
        else planner.plan(module, module_sharders)


def shard(module: nn.Module, options: RecsysOptions, device: torch.device) -> nn.Module:
    """``DistributedModelParallel(module)`` over the default process group: tables sharded by the planner, fused
    optimizer from the module's ``sparse_optimizer`` (or the options), dense part wrapped in DDP."""
    from torchrec.distributed import DistributedModelParallel

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("disttrain_recsys shards over a process group: initialise torch.distributed first"
                           " (the Trainer and Fabric strategies do it in setup)")
    module_sharders = sharders(fused_params(options, getattr(module, "sparse_optimizer", None)))
    _quiet_planner_logs()
    sharding_plan = plan(module, options, dist.get_world_size(), device, module_sharders, dist.group.WORLD)
    return DistributedModelParallel(module, device=device, plan=sharding_plan, sharders=module_sharders)


def _quiet_planner_logs() -> None:
    # The planner warns about its own topology construction and about meta-device dry runs at every call.
    for name in ("torchrec.distributed.planner.types", "torchrec.distributed.planner.storage_reservations",
                 "torchrec.distributed.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)


def is_sharded(module: nn.Module) -> bool:
    from torchrec.distributed import DistributedModelParallel

    return isinstance(module, DistributedModelParallel)


def shard_children(root: nn.Module, options: RecsysOptions, device: torch.device) -> list[str]:
    """Replace each direct child of ``root`` that holds tables by its ``DistributedModelParallel``; the rest of
    ``root`` (a LightningModule's metrics, losses) moves to ``device``. Already sharded children are kept, so a
    second fit on the same module does not shard twice. Returns the sharded children's names."""
    names = []
    for name, child in list(root.named_children()):
        if is_sharded(child):
            names.append(name)
        elif has_torchrec_tables(child):
            setattr(root, name, shard(child, options, device))
            names.append(name)
        else:
            child.to(device)
    if not names:
        raise TypeError(f"disttrain_recsys found no torchrec EmbeddingBagCollection in {type(root).__name__}'s"
                        " direct children; put the tables in a submodule (e.g. self.net = DeepFMNet(...))")
    return names


def sharded_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from torchrec.distributed import DistributedModelParallel

    if isinstance(root, DistributedModelParallel):
        yield "", root
        return
    for name, child in root.named_children():
        if isinstance(child, DistributedModelParallel):
            yield name, child


def fused_optimizer_state(root: nn.Module) -> dict[str, Any]:
    """The fused (in-backward) optimizer states of every DMP in ``root``, keyed by submodule name."""
    return {name or "model": dmp.fused_optimizer.state_dict() for name, dmp in sharded_modules(root)}


def load_fused_optimizer_state(root: nn.Module, state: dict[str, Any]) -> None:
    for name, dmp in sharded_modules(root):
        dmp.fused_optimizer.load_state_dict(state[name or "model"])


def load_model_state(root: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """``root.load_state_dict`` that also works when children are DMPs: nn.Module's recursive load would look
    for DMP's internal wrapper prefixes, so each DMP child loads its own part through its own method."""
    if is_sharded(root):
        root.load_state_dict(state, strict=strict)
        return
    own = {k: v for k, v in state.items() if "." not in k}
    if own:
        root.load_state_dict(own, strict=False)
    for name, child in root.named_children():
        part = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
        if is_sharded(child):
            child.load_state_dict(part, strict=strict)
        elif part or strict:
            child.load_state_dict(part, strict=strict)


class RecsysEngine:
    """The shared core of the Trainer and Fabric ``disttrain_recsys`` strategies: options, sharding, and sharded
    checkpoints (embedding shards and fused optimizer state through DCP; everything else in ``meta.pt``)."""

    def __init__(self, options: RecsysOptions) -> None:
        self.options = options
        self.module_transforms: list = []
        self.world_size = 1
        self.rank = 0

    def setup_mesh(self, world_size: int, device: torch.device, local_size: int | None = None) -> None:
        # No device mesh: DMP shards over the default process group and DDP uses it for the dense part (and
        # torchrec's planner reads the topology itself, so ``local_size`` is not needed here).
        self.world_size, self.rank = world_size, dist.get_rank() if dist.is_initialized() else 0
        return None

    def sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.rank}

    def parallelize(self, root: nn.Module, device: torch.device, whole: bool = False) -> nn.Module:
        """Shard ``root`` itself (Fabric: the model passed to setup) or its children holding tables (Trainer:
        the LightningModule stays the object Lightning calls ``training_step`` on)."""
        for transform in self.module_transforms:
            transform(root)
        if whole:
            return root if is_sharded(root) else shard(root, self.options, device)
        shard_children(root, self.options, device)
        return root

    # -- checkpoints ----------------------------------------------------------------------------------------
    @staticmethod
    def save(path: str | os.PathLike, root: nn.Module, metadata: dict[str, Any]) -> Path:
        """Collective: the model's (sharded) state dict and the fused optimizer states go through DCP (each rank
        writes its shards); ``metadata`` (dense optimizer state, loop state) is written by rank 0."""
        tensors = {"state_dict": root.state_dict(), FUSED_OPTIMIZER_KEY: fused_optimizer_state(root)}
        return ckpt.save_sharded(path, tensors, metadata)

    @staticmethod
    def load(path: str | os.PathLike, root: nn.Module, strict: bool = True, optimizer: bool = True) -> dict[str, Any]:
        """Restore ``root``'s shards (and the fused optimizer states unless ``optimizer=False``) in place from
        a folder written by :meth:`save`, at the same sharding plan; returns the metadata."""
        path = ckpt.check_checkpoint(path)
        metadata = ckpt._read_meta(path)
        metadata.pop(ckpt.FORMAT_KEY, None)
        tensors: dict[str, Any] = {"state_dict": root.state_dict()}
        if optimizer:
            tensors[FUSED_OPTIMIZER_KEY] = fused_optimizer_state(root)
        try:
            dcp.load(tensors, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ckpt.CheckpointError(f"checkpoint {str(path)!r} is corrupt or does not match the model: {e}") from e
        load_model_state(root, tensors["state_dict"], strict=strict)
        if optimizer:
            load_fused_optimizer_state(root, tensors[FUSED_OPTIMIZER_KEY])
        return metadata
