"""torchrec DistributedModelParallel for the ``disttrain_recsys`` strategies, in torch terms (no lightning here).

Embedding tables (``EmbeddingBagCollection``) are sharded by torchrec's planner across all ranks with the fused
(fbgemm) kernel, whose optimizer runs inside backward; everything else is data-parallel (DMP wraps it in DDP).
``RecsysEngine`` is what the Trainer and Fabric adapters share: options, sharding, checkpoints.
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.engines.base import Engine
from disttrain.parallel.engines.ddp import BUCKET_BYTES
from disttrain.parallel.engines.managed_ids import layout_processes, managed_sharder, one_bucket_per_process, readmit, \
    saved_world_size
from disttrain.parallel.engines.layout import (
    Buffers,
    Capabilities,
    Grads,
    Layout,
    Optimizer,
    Params,
    Reduce,
    Steps,
    Work,
)
# dense_parameters: what the dense optimizer is made from (users reach it here, next to the strategy's engine).
from disttrain.parallel.engines.sparse_pipeline import PIPELINES, SteppedPipeline, train_pipeline
from disttrain.parallel.engines.table_traffic import TableTraffic
from disttrain.parallel.engines.tables import dense_parameters, has_torchrec_tables
from disttrain.parallel.families.managed_ids import is_managed

# Sharding types the planner may choose per table by default. data_parallel is left out: replicating a table
# would defeat the point of the strategy (torchrec's planner picks it for small tables on one process).
DEFAULT_SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")
SPARSE_OPTIMIZERS = ("adagrad", "rowwise_adagrad", "sgd")
COMM_PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
FUSED_OPTIMIZER_KEY = "fused_optimizer"
ROW_STATE_KEY = "recsys_row_state_columns"  # meta.pt: column split of each per-row optimizer state


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
    pipeline: "sparse_dist": torchrec's TrainPipelineSparseDist, the next batch's input all-to-all (ids to the
        ranks holding their tables) in flight during this batch's forward and backward, the same losses and weights
        bit for bit (the module gives ``pipeline_batch``, as DeepFM does); "none": the plain loop.
    comm_precision: the dtype the pooled embeddings and their gradients cross ranks in (torchrec's quantized comms
        codecs): "fp32", "fp16", "bf16", or "fp8" (CUDA only: fbgemm's CPU build has no fp8 codec).
    """

    sharding_types: Optional[list[str]] = None
    constraints: dict[str, dict[str, Any]] = field(default_factory=dict)
    sparse_optimizer: str = "adagrad"
    sparse_lr: float = 0.05
    sparse_eps: float = 1e-8
    batch_size: int = 512
    pipeline: str = "none"
    comm_precision: str = "fp32"

    # Options of other disttrain strategies that this one cannot serve (parallel.options.build_options).
    refused: ClassVar[dict[str, str]] = {
        "compile": "torchrec's sharded tables run fbgemm kernels and input redistribution torch.compile does not"
                   " trace, and the dense part has no repeated blocks to compile; train with compile off",
    }

    def __post_init__(self) -> None:
        named = [("sharding_types", self.sharding_types or [])] + \
            [(f"constraints[{name!r}]", c.get("sharding_types") or []) for name, c in self.constraints.items()]
        if any(types for _, types in named):  # torchrec (seconds to import) only when there are types to check
            from torchrec.distributed.types import ShardingType

            known = [t.value for t in ShardingType]
            for where, types in named:
                for kind in types:
                    if kind not in known:
                        raise ValueError(f"{where} has unknown sharding type {kind!r}; choose from"
                                         f" {', '.join(known)}")
        if self.sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse_optimizer={self.sparse_optimizer!r} is not supported by the fused kernel;"
                             f" choose one of {', '.join(SPARSE_OPTIMIZERS)}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline={self.pipeline!r} is not a training pipeline; choose one of"
                             f" {', '.join(PIPELINES)}")
        if self.comm_precision not in COMM_PRECISIONS:
            raise ValueError(f"comm_precision={self.comm_precision!r} is not a precision of torchrec's comms codecs;"
                             f" choose one of {', '.join(COMM_PRECISIONS)}")


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


def comm_codecs(precision: str, device: torch.device) -> Optional[dict[str, Any]]:
    """torchrec's quantized comms codecs for the pooled embeddings' all-to-all (forward) and their gradients'
    (backward) in ``precision``, per comm op as sharders take them; None for fp32.

    Built per op with ``get_qcomm_codecs`` rather than ``get_qcomm_codecs_registry``, which turns bf16 into fp16
    on CPU ("not supported on GLOO"): gloo and fbgemm's CPU kernels run bf16 (tests/test_recsys_pipeline.py)."""
    if precision == "fp32":
        return None
    if precision == "fp8" and device.type != "cuda":
        raise ValueError(f"comm_precision='fp8' needs CUDA: fbgemm-gpu-cpu has no fp8 codec ('fp8 is not supported by"
                         f" CPU'), and this run is on {device.type}; choose fp16 or bf16")
    from torchrec.distributed.fbgemm_qcomm_codec import CommOp, CommType, QCommsConfig, get_qcomm_codecs

    config = QCommsConfig(forward_precision=CommType(precision), backward_precision=CommType(precision))
    # Row-wise tables reduce-scatter their pooled output: torchrec has no fp8 codec for it (it stays fp32 then).
    ops = [CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL]
    if precision != "fp8":
        ops.append(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
    return {op.name: get_qcomm_codecs(config) for op in ops}


def sharders(fused: dict[str, Any], codecs: Optional[dict[str, Any]] = None) -> list[Any]:
    """The EmbeddingBagCollection sharder, with row-wise sharding allowed on CPU too: torchrec offers it on CUDA
    only, although the CPU kernels and gloo collectives run it. ``codecs``: :func:`comm_codecs`."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class Sharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            extra = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]
            return types + [t for t in extra if t not in types]

    return [Sharder(fused_params=fused, qcomm_codecs_registry=codecs)]


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
    module_sharders = sharders(fused_params(options, getattr(module, "sparse_optimizer", None)),
                               comm_codecs(options.comm_precision, device))
    if is_managed(module):  # managed-collision tables: their own sharder, over the tables' (row-wise only)
        module_sharders = [managed_sharder(module_sharders[0]), *module_sharders]
        one_bucket_per_process(module, dist.get_world_size())
    quiet_planner_logs()
    sharding_plan = plan(module, options, dist.get_world_size(), device, module_sharders, dist.group.WORLD)
    return DistributedModelParallel(module, device=device, plan=sharding_plan, sharders=module_sharders)


def shards_per_rank(sharding_plan: Any, world_size: int) -> list[tuple[int, int]]:
    """(table elements, table rows) each rank holds under a torchrec sharding plan (what :func:`plan` returns):
    what the planner estimates and the simulator reports."""
    per_rank = [[0, 0] for _ in range(world_size)]
    for shardings in sharding_plan.plan.values():
        for sharding in shardings.values():
            for shard in sharding.sharding_spec.shards:
                rows, cols = shard.shard_sizes
                per_rank[shard.placement.rank()][0] += rows * cols
                per_rank[shard.placement.rank()][1] += rows
    return [(elements, rows) for elements, rows in per_rank]


def quiet_planner_logs() -> None:
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


@contextmanager
def _torchrec_sharded_tensors() -> Iterator[None]:
    # torchrec's sharded tables and their fused optimizer state are ShardedTensors, which torch deprecates for
    # DTensor, and DCP's load planner calls tensor methods on them, each of which warns. torchrec 1.9.2 gives
    # DTensors only for all tables of a model at once (ShardingEnv(output_dtensor=True)); they then hold only this
    # rank's shard offsets (not the global column split that per-row optimizer state is regrouped by, see
    # row_states), and torchrec's own resharding (update_shards) refuses them. ShardedTensor is the state torchrec
    # hands out by default, so the warning names torchrec's limitation, not a call of ours to change.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield


class RecsysEngine(Engine):
    """The engine of ``disttrain_recsys``: tables sharded by torchrec's planner (DMP), the dense part data-parallel,
    and sharded checkpoints (table shards and fused optimizer state through DCP; everything else in ``meta.pt``)."""

    options_cls = RecsysOptions
    # No device mesh: DMP shards over the default process group and DDP uses it for the dense part (torchrec's
    # planner reads the topology itself). In degrees: the dense part is replicated on every rank; the tables are
    # placed by torchrec's planner across all of them.
    replicates = True
    options: RecsysOptions

    def __init__(self, options: RecsysOptions, name: str = "disttrain_recsys") -> None:
        super().__init__(options, name)
        self.traffic: Optional[TableTraffic] = None

    def table_bytes(self) -> Optional[dict[str, int]]:
        """Bytes this rank has handed to the tables' all-to-alls since set-up, ``{"embeddings": n, "ids": n}``
        (pooled embeddings and their gradients in ``comm_precision``; ids and lengths); None before set-up. The
        ``Throughput`` callback reports them per step as ``comm/table_bytes_per_step``."""
        return dict(self.traffic.sent) if self.traffic is not None else None

    def stepped_pipeline(self, root: nn.Module, device: torch.device) -> Optional[SteppedPipeline]:
        """The Trainer's driver of ``pipeline="sparse_dist"`` for the LightningModule ``root`` (None for "none"):
        its one sharded child, its batches made by ``root.pipeline_batch(batch)``."""
        if self.options.pipeline == "none":
            return None
        return SteppedPipeline(self._pipelined_net(root), device, self._to_batch(root))

    def train_pipeline(self, module: nn.Module, optimizer: Any, device: torch.device,
                       step: Callable[[Any], tuple[torch.Tensor, Any]],
                       backward: Callable[[torch.Tensor], None]) -> Any:
        """torchrec's pipeline over a sharded ``module`` for a hand-written loop (Fabric); see
        :func:`~disttrain.parallel.engines.sparse_pipeline.train_pipeline`. ``pipeline="none"``: no overlap."""
        return train_pipeline(self._pipelined_net(module), optimizer, device, step, backward,
                              overlap=self.options.pipeline == "sparse_dist")

    def _pipelined_net(self, root: nn.Module) -> nn.Module:
        nets = [net for _, net in sharded_modules(root)]
        if len(nets) != 1:
            raise ValueError(f"pipeline={self.options.pipeline!r} runs one sharded network, and"
                             f" {type(root).__name__} has {len(nets)}; keep the tables in one child or set"
                             " pipeline='none'")
        return nets[0]

    def _to_batch(self, root: nn.Module) -> Callable[[Any], Any]:
        to_batch = getattr(root, "pipeline_batch", None)
        if to_batch is None:
            raise ValueError(f"pipeline={self.options.pipeline!r} needs {type(root).__name__}.pipeline_batch(batch),"
                             " the loader's batch as a TableBatch (see disttrain.recsys.DeepFM); or set"
                             " pipeline='none'")
        return to_batch

    @classmethod
    def layout(cls, options: RecsysOptions) -> Layout:
        """Embedding tables placed by torchrec's planner over all ranks (fp32; their optimizer fused into backward,
        so no table gradients), the dense part a replica on every rank as DDP keeps it (gradients all-reduced in
        buckets during backward, a plain optimizer). The sharded tables distribute their inputs and outputs around
        every lookup: hooked modules, not plain ones."""
        return Layout(
            params=Params(),
            grads=Grads(reduce=Reduce.ALL_REDUCE, bucket_bytes=BUCKET_BYTES),
            optimizer=Optimizer(steps=Steps.TENSORS),
            tables=True,
            buffers=Buffers(gradient_copy=True),
            work=Work.SHARDED,
            can=Capabilities(compile=False, async_checkpoint=False),
        )

    def setup(self, module: nn.Module, device: torch.device, precision: str, optimizers: Any = (), *,
              container: bool = False, training: bool = True, forward_methods: tuple[str, ...] = (),
              sync_batchnorm: bool = False, convert: Any = None) -> tuple[nn.Module, list]:
        """``container``: shard the children of ``module`` that hold tables (the LightningModule stays the object
        Lightning calls); else ``module`` itself. Optimizers made before must cover the dense parameters only."""
        self.check_optimizers(module, optimizers)
        return self.parallelize(module, device, whole=not container), list(optimizers)

    def check_optimizers(self, module: nn.Module, optimizers: Any) -> None:
        dense = {id(p) for p in dense_parameters(module)}
        for optimizer in optimizers:
            if any(id(p) not in dense for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("an optimizer covers embedding-table parameters; under disttrain_recsys the tables"
                                 " have a fused optimizer: create the dense one over"
                                 " disttrain.parallel.engines.recsys.dense_parameters(model)")

    def parallelize(self, root: nn.Module, device: torch.device, whole: bool = False) -> nn.Module:
        """Shard ``root`` itself (``whole``: a plain model) or its children holding tables (a LightningModule)."""
        for transform in self.module_transforms:
            transform(root)
        if self.traffic is None:
            self.traffic = TableTraffic()
        if whole:
            return root if is_sharded(root) else shard(root, self.options, device)
        shard_children(root, self.options, device)
        return root

    # -- checkpoints: the protocol ----------------------------------------------------------------------------
    # The tables are read from the module itself, together with their fused optimizer state; the dense optimizers
    # (plain, the same on every rank) stay in meta.pt with the rest, as Lightning saves them.
    optimizers_by_name = False

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, path: str | os.PathLike, module: nn.Module, tensors: dict[str, Any],
                        metadata: dict[str, Any]) -> Path:
        return self.save(path, module, metadata)

    def load_checkpoint(self, path: str | os.PathLike, module: nn.Module, targets: dict[str, Any],
                        strict: bool = True, weights_only: Optional[bool] = None, source: Any = None) -> dict[str, Any]:
        if source is not None:  # Lightning has no torchrec strategy: its checkpoints hold no sharded tables
            raise ckpt.CheckpointError(f"checkpoint {str(path)!r} was written by Lightning's own strategy;"
                                       " disttrain_recsys resumes only checkpoints disttrain_recsys wrote")
        return self.load(path, module, strict=strict)

    # -- checkpoints: the folder itself (also what the daily job calls) ---------------------------------------
    @staticmethod
    def save(path: str | os.PathLike, root: nn.Module, metadata: dict[str, Any]) -> Path:
        """Collective: the model's (sharded) state dict and the fused optimizer states go through DCP (each rank
        writes its shards); ``metadata`` (dense optimizer state, loop state) is written by rank 0, with the column
        split of every per-row optimizer state so that :meth:`load` can reshard it, and the number of processes the
        managed tables' ids are laid out for (:func:`~disttrain.parallel.engines.managed_ids.layout_processes`)."""
        fused = fused_optimizer_state(root)
        tensors = {"state_dict": root.state_dict(), FUSED_OPTIMIZER_KEY: fused}
        layout = {state.key: state.columns for state in row_states(root, fused)}
        return ckpt.save_sharded(path, tensors, {**metadata, ROW_STATE_KEY: layout, **layout_processes(root)})

    @staticmethod
    def load(path: str | os.PathLike, root: nn.Module, strict: bool = True, optimizer: bool = True) -> dict[str, Any]:
        """Restore ``root``'s shards (and the fused optimizer states unless ``optimizer=False``) in place from a
        folder written by :meth:`save` at any world size and sharding plan; returns the metadata. Collective.

        DCP reshards the tables and their element-wise optimizer state (global offsets). Per-row state (row-wise
        Adagrad's momentum) is stored per column shard, so when the column split differs it is regrouped with
        :func:`regroup_row_state`. Every file read is verified against the checkpoint's manifest."""
        path = ckpt.check_checkpoint(path)
        # Managed-collision tables saved on another number of processes: torchrec places each id on the process of
        # its input range, so after DCP's load by offsets their ids, rows and optimizer state are admitted again on
        # the processes they belong to now (readmit).
        metadata = ckpt.read_meta(path)
        moved = saved_world_size(path, root, metadata)
        saved_columns = metadata.pop(ROW_STATE_KEY, None)
        tensors: dict[str, Any] = {"state_dict": root.state_dict()}
        regroup: dict[str, tuple[RowState, list[int]]] = {}
        if optimizer:
            tensors[FUSED_OPTIMIZER_KEY] = fused = fused_optimizer_state(root)
            regroup = _row_states_to_regroup(path, root, fused, saved_columns)
        # which output rows each process's managed-table part covers: this run's layout, not the saved one's
        layout_of_now = {k: v.clone() for k, v in tensors["state_dict"].items()
                         if moved is not None and k.endswith("_output_segments_tensor")}
        try:
            with _torchrec_sharded_tensors():
                dcp.load(_without(tensors, regroup), storage_reader=ckpt.CheckpointReader(path),
                         planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
            _load_regrouped(path, regroup)
            for key, value in layout_of_now.items():
                tensors["state_dict"][key].copy_(value)
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ckpt.unwrap_dcp_error(e) or ckpt.CheckpointError(
                f"checkpoint {str(path)!r} is corrupt or does not match the model: {e}") from e
        load_model_state(root, tensors["state_dict"], strict=strict)
        if optimizer:
            load_fused_optimizer_state(root, tensors[FUSED_OPTIMIZER_KEY])
        if moved is not None:
            dropped = readmit(path, root, FUSED_OPTIMIZER_KEY)
            if any(dropped.values()) and (not dist.is_initialized() or dist.get_rank() == 0):
                warnings.warn(f"checkpoint {str(path)!r}: its managed tables, saved on {moved[0]} process(es), hold"
                              f" fewer ids on {moved[1]}: {sum(dropped.values()):,} left out (the least frequent of"
                              " each process's id range), served by the shared row until seen again", stacklevel=2)
        return metadata


# -- per-row optimizer state across sharding plans ---------------------------------------------------------------
# fbgemm's row-wise optimizers keep one value per row and column shard (row-wise Adagrad: the running sum of the
# mean g^2 over that shard's columns); torchrec lays a column-wise table's out as one 1-D ShardedTensor of
# rows x shards values, segment k for column shard k. Its size depends on the plan, so DCP cannot reshard it.

def table_columns(weight: Any) -> Optional[list[int]]:
    """Column widths of a sharded table's shards in torchrec's order: ``[dim]`` when every shard spans all columns
    (table-wise, row-wise), the widths of the column shards (column-wise, table-column-wise), None otherwise."""
    rows, dim = _global_size(weight)
    shards = weight.metadata().shards_metadata
    if all(m.shard_sizes[1] == dim for m in shards):
        return [dim]
    if all(m.shard_sizes[0] == rows and m.shard_offsets[0] == 0 for m in shards):
        return [m.shard_sizes[1] for m in shards]
    return None


@dataclass
class RowState:
    """One per-row fused optimizer state: where it sits in the checkpoint, its (sharded) tensor, its table's rows and
    column split."""

    path: tuple[str, ...]  # (FUSED_OPTIMIZER_KEY, module, "state", param fqn, state name)
    tensor: Any
    rows: int
    columns: list[int]

    @property
    def key(self) -> str:  # how DCP names it (nested keys joined by dots)
        return ".".join(self.path)


def row_states(root: nn.Module, fused: dict[str, Any]) -> list[RowState]:
    """Every per-row state in ``fused`` (from :func:`fused_optimizer_state`) of the tables of ``root``."""
    found = []
    for name, dmp in sharded_modules(root):
        weights = dmp.state_dict()
        for param, states in fused[name or "model"].get("state", {}).items():
            size = _global_size(weights.get(param))
            if size is None or len(size) != 2:
                continue
            columns = table_columns(weights[param])
            for state_name, value in states.items():
                if columns and _global_size(value) == (size[0] * len(columns),):
                    path = (FUSED_OPTIMIZER_KEY, name or "model", "state", param, state_name)
                    found.append(RowState(path, value, size[0], columns))
    return found


def _global_size(tensor: Any) -> Optional[tuple[int, ...]]:
    """The global size of a ShardedTensor (None for anything else), from its metadata: a tensor method on it
    (``.size()``, ``.dim()``) goes through ShardedTensor's deprecated ``__torch_function__``, which warns."""
    return tuple(tensor.metadata().size) if hasattr(tensor, "metadata") else None


def regroup_row_state(saved: torch.Tensor, rows: int, saved_columns: list[int],
                      columns: list[int]) -> torch.Tensor:
    """Per-row optimizer state saved for one column split (``saved``: rows x len(saved_columns) values, shard by
    shard) -> the same for another split: each new shard gets the column-weighted mean of the saved shards it
    overlaps. Exact when new shards are unions of saved ones (column-wise -> table-wise gives the whole row's mean,
    what the table would have accumulated unsplit); an estimate when a saved shard is split (table-wise ->
    column-wise: every shard starts from the whole row's value)."""
    if sum(saved_columns) != sum(columns):
        raise ValueError(f"column splits {saved_columns} and {columns} cover different widths")
    segments = saved.reshape(len(saved_columns), rows)
    bounds = torch.tensor([0, *saved_columns]).cumsum(0).tolist()
    out, start = [], 0
    for width in columns:
        end = start + width
        mean = torch.zeros(rows, dtype=saved.dtype)
        for k in range(len(saved_columns)):
            overlap = min(end, bounds[k + 1]) - max(start, bounds[k])
            if overlap > 0:
                mean += segments[k] * (overlap / width)
        out.append(mean)
        start = end
    return torch.cat(out)


def _row_states_to_regroup(path: Path, root: nn.Module, fused: dict[str, Any],
                           saved_columns: Optional[dict[str, list[int]]]) -> dict[str, tuple[RowState, list[int]]]:
    """The per-row states whose saved column split differs from this plan's: DCP key -> (state, saved split)."""
    stored = ckpt.CheckpointReader(path).metadata.state_dict_metadata
    regroup = {}
    for state in row_states(root, fused):
        if state.key not in stored:
            continue  # strict loading reports it
        saved = (saved_columns or {}).get(state.key)
        if saved is None:  # written before the split was recorded: equal widths, as torchrec splits by default
            size, dim = stored[state.key].size[0], sum(state.columns)
            count = size // state.rows
            if size % state.rows or dim % max(count, 1):
                raise ckpt.CheckpointError(f"checkpoint {str(path)!r}: cannot tell how {state.key} was split over"
                                           f" column shards ({size} values for {state.rows} rows); load it at the"
                                           " sharding plan it was saved with")
            saved = [dim // count] * count
        if list(saved) != state.columns:
            regroup[state.key] = (state, list(saved))
    return regroup


def _without(tensors: dict[str, Any], regroup: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (nested) without the DCP keys in ``regroup``: those are loaded by :func:`_load_regrouped`."""
    def prune(node: dict[str, Any], prefix: str) -> dict[str, Any]:
        kept = {}
        for key, value in node.items():
            if f"{prefix}{key}" in regroup:
                continue
            if isinstance(value, dict) and value:
                value = prune(value, f"{prefix}{key}.")
                if not value:  # DCP would take an empty dict for a value of its own
                    continue
            kept[key] = value
        return kept
    return prune(tensors, "")


def _load_regrouped(path: Path, regroup: dict[str, tuple[RowState, list[int]]]) -> None:
    """Read the saved per-row states whole (one verified read for all of them), regroup each to this plan's column
    split, and copy this rank's shards into the targets. Not collective."""
    if not regroup:
        return
    full: dict[str, Any] = {}
    for state, saved in regroup.values():
        node = full
        for part in state.path[:-1]:
            node = node.setdefault(part, {})
        node[state.path[-1]] = torch.empty(state.rows * len(saved), dtype=state.tensor.dtype)
    dcp.load(full, storage_reader=ckpt.CheckpointReader(path), no_dist=True)
    for state, saved in regroup.values():
        value = full
        for part in state.path:
            value = value[part]
        new = regroup_row_state(value, state.rows, saved, state.columns)
        for shard in state.tensor.local_shards():
            offset = shard.metadata.shard_offsets[0]
            shard.tensor.copy_(new[offset:offset + shard.tensor.numel()])
