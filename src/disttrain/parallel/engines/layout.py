"""How an engine holds a model's states: the one declaration that everything outside the engine reads.

Each engine states its layout in its own module, as a function of its options (``Engine.layout(options)``): for the
parameters, the gradients and the optimizer state, over which :class:`~disttrain.parallel.mesh.ParallelDims`
dimensions each is sharded (and replicated over the other data-parallel ones), in which dtype and where (device,
host, NVMe); when the parameters are gathered; how gradients are reduced; what the optimizer steps; the temporary
buffers the engine adds; its framework work per block; and what it can do (:class:`Capabilities`). The planner
(memory, traffic, step time, candidates), the simulator and the callbacks compute from it; none of them asks which
engine class or strategy name it has. A new way of holding states is a new layout in its engine's module and a row in
:mod:`disttrain.parallel.registry`.

Dimension names are ParallelDims' own: ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``. Dtypes are named
by role, so one layout holds for every precision (:meth:`Dtype.bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

DATA_PARALLEL = ("dp_replicate", "dp_shard", "cp")  # ranks holding the same part of the model (cp: other tokens)
MODEL_PARALLEL = ("tp", "pp", "ep")  # dimensions that split the model itself


class Dtype(str, Enum):
    """A state's dtype, by role."""

    PARAM = "param"  # the precision's parameter dtype: fp32 under "*-mixed" and "32-true", 16-bit under "*-true"
    COMPUTE = "compute"  # the precision's compute dtype: 16-bit under "bf16-*"/"16-*", fp32 under "32-true"
    FP32 = "fp32"

    def bytes(self, precision: str) -> int:
        """Bytes per element under a Lightning precision string ("bf16-mixed", "32-true", ...)."""
        if self is Dtype.FP32 or precision.startswith("32"):
            return 4
        if self is Dtype.COMPUTE or precision.endswith("-true"):
            return 2
        return 4  # a parameter under mixed precision: fp32, cast for compute


class Where(str, Enum):
    """Where a state lives between uses."""

    DEVICE = "device"
    HOST = "host"  # host memory (CPU offload): copied to the device for use, stepped there by a CPU optimizer
    NVME = "nvme"  # a local disk, swapped through host buffers (DeepSpeed ZeRO-Infinity)


class Gather(str, Enum):
    """When parameters sharded over the data-parallel ranks are all-gathered."""

    KEPT = "kept"  # never: each rank keeps its (tensor/pipeline part of the) parameters whole
    PER_UNIT = "per_unit"  # unit by unit for forward and again for backward, freed after each (FSDP2, ZeRO-3)
    AFTER_STEP = "after_step"  # each rank updates its partition; the updated partitions are all-gathered after
    # every optimizer step, and the parameters stay whole until the next one (ZeRO-1/2)

    @property
    def per_step(self) -> int:
        """All-gathers of every parameter per optimizer step."""
        return {Gather.KEPT: 0, Gather.PER_UNIT: 2, Gather.AFTER_STEP: 1}[self]


class Units(str, Enum):
    """What one gathered unit is (and so how many gathers, hooks and calls a step has)."""

    NONE = "none"  # nothing is gathered
    FSDP = "fsdp"  # FSDP2's units as apply_fsdp makes them: each block, each sub-network (embeddings, head), the root
    BLOCKS = "blocks"  # one per block and one for the ends (the root, or a pipeline stage's own ends)
    SUBMODULES = "submodules"  # every submodule with parameters, fetched as it is entered (DeepSpeed ZeRO-3's hooks:
    # a few calls per block)


class Reduce(str, Enum):
    """How gradients are reduced over the data-parallel ranks."""

    ALL_REDUCE = "all_reduce"  # every rank gets the whole reduced gradient
    REDUCE_SCATTER = "reduce_scatter"  # each rank gets the reduced gradient of the partition it updates; replicas
    # of that partition (HSDP's ``dp_replicate``) all-reduce it after


class Partition(str, Enum):
    """How a state sharded over n ranks is cut."""

    DIM0 = "dim0"  # each parameter chunked along dim 0 (torch.chunk): the first ranks hold ceil(rows/n) rows (FSDP2)
    FLAT = "flat"  # each parameter padded to a multiple of n, ceil(numel/n) elements per rank, in flat buffers the
    # library's own engine keeps (DeepSpeed): a rule over parameter sizes


class Steps(str, Enum):
    """What the optimizer steps, which sets its work per tensor (``Overheads.optimizer_tensor/_dtensor``)."""

    TENSORS = "tensors"  # plain tensors, one per parameter
    DTENSORS = "dtensors"  # distributed tensors (FSDP2's DTensor shards, torchrec's ShardedTensor tables): each op
    # through their dispatch
    FLAT = "flat"  # a few flat partitions (DeepSpeed ZeRO-3): no work per parameter tensor
    FLAT_PER_GRADIENT = "flat_per_gradient"  # a few flat partitions, each parameter's gradient copied into its
    # bucket by a hook of its own every step (DeepSpeed stages 1 and 2): a plain optimizer's work per tensor


class Work(str, Enum):
    """The framework's own work per block executed (the ``Overheads`` fields of :mod:`disttrain.planner.hardware`)."""

    PLAIN = "plain"  # a plain module (``eager``)
    SHARDED = "sharded"  # hooks around each block that gather and reduce, or distribute inputs and outputs
    # (FSDP2's; torchrec's sharded modules) (``sharded``)
    ZERO3 = "zero3"  # DeepSpeed ZeRO-3's hooks on every submodule and their fetches (``zero3``, beyond ``eager``)


class Precision(str, Enum):
    """Who applies the precision."""

    AUTOCAST = "autocast"  # Lightning's precision plugin (autocast and a GradScaler)
    CASTS_ITSELF = "casts_itself"  # the engine casts (FSDP2's MixedPrecisionPolicy): adapters must not autocast
    DEEPSPEED = "deepspeed"  # DeepSpeed's own (its config's fp16/bf16; Lightning's DeepSpeedPrecision plugin)


class Accumulation(str, Enum):
    """How gradients are accumulated over micro-steps."""

    NO_SYNC = "no_sync"  # the adapter's backward per micro-step, no gradient sync but on the last (``no_sync``)
    ENGINE = "engine"  # inside the engine, from its batch settings (options ``micro_batch_size`` and
    # ``gradient_accumulation_steps`` on Fabric, the Trainer's otherwise): it divides the loss itself
    MICROBATCHES = "microbatches"  # the pipeline schedule's microbatches within one step (no accumulation across)


@dataclass(frozen=True)
class State:
    """How one of the model's states is held on each rank.

    sharded_over: the dimensions whose ranks each hold 1/n of it (n: the product of their degrees); it is
        replicated over the other data-parallel dimensions. ``()``: every rank holds it whole.
    dtype: its dtype (:class:`Dtype`).
    where: where it lives between uses (:class:`Where`).
    """

    sharded_over: tuple[str, ...] = ()
    dtype: Dtype = Dtype.PARAM
    where: Where = Where.DEVICE

    def shards(self, dims: Any) -> int:
        """Ranks one copy of the state is split over, at degrees ``dims`` (a ParallelDims)."""
        return math.prod(getattr(dims, name) for name in self.sharded_over)


@dataclass(frozen=True)
class Params(State):
    """The parameters: gathered ``gather`` (:class:`Gather`), in units of ``units`` (:class:`Units`), each unit in
    ``calls`` all-gathers per pass (DeepSpeed fetches a block's submodules in a few)."""

    gather: Gather = Gather.KEPT
    units: Units = Units.NONE
    calls: int = 1


@dataclass(frozen=True)
class Grads(State):
    """The gradients, reduced by ``reduce`` (:class:`Reduce`) in ``reduce_dtype``; ``bucket_bytes`` > 0: in buckets
    of that many bytes as backward produces them (DDP), else unit by unit as each unit's backward ends.
    Compressed for the wire (``gradient_compression``): ``wire_bytes`` per element sent instead of the reduce dtype's
    size, or (``low_rank`` > 0, PowerSGD) each gradient matrix (dim 0 by the rest) sent as two factors of that rank,
    (m + n) x rank elements, in ``low_rank_calls`` all-reduces per bucket, vectors and matrices the factors would not
    shrink sent whole; at the cost of ``codec_passes`` passes over the fp32 gradients at memory speed per step
    (casting, quantising, error feedback, the factors' products, dequantising and summing what arrives)."""

    reduce: Reduce = Reduce.ALL_REDUCE
    reduce_dtype: Dtype = Dtype.PARAM
    bucket_bytes: int = 0
    wire_bytes: float = 0.0
    low_rank: int = 0
    low_rank_calls: int = 0
    codec_passes: int = 0


@dataclass(frozen=True)
class Optimizer(State):
    """The optimizer's state (``dtype``: of its moments): ``master``: it also keeps an fp32 copy of the parameters it
    updates (16-bit parameters, fp32 steps); ``steps``: what it steps (:class:`Steps`)."""

    master: bool = False
    steps: Steps = Steps.TENSORS


@dataclass(frozen=True)
class Buffers:
    """Temporary memory the engine adds beyond the states.

    gradient_copy: a second copy of the gradients (DDP's buckets), in their dtype.
    gathered_units: units held gathered at once (the one computing and the one prefetched), in the compute dtype.
    root_gathered: the root's own parameters (embeddings, head) stay gathered through forward and backward (FSDP2).
    unit_gradients: units whose unsharded gradients are held for their reduction, in the reduce dtype.
    reduce_bucket: elements of a reduction buffer allocated whole (DeepSpeed's ``reduce_bucket_size``), in the
        gradients' reduce dtype.
    partition_copy: a copy of the optimizer's parameter partition in the compute dtype, where the optimizer lives
        (DeepSpeed's stage 1/2 offload casts the updated partition there before it is all-gathered).
    accumulation_copy: a copy of this rank's gradients in the compute dtype, where the gradients live, that the
        micro-steps of an accumulation window are summed into (DeepSpeed's stage 1/2 offload; allocated by the
        first window that accumulates, and counted as if the run accumulates).
    """

    gradient_copy: bool = False
    gathered_units: int = 0
    root_gathered: bool = False
    unit_gradients: int = 0
    reduce_bucket: int = 0
    partition_copy: bool = False
    accumulation_copy: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What the engine does besides holding the states.

    precision: who applies the precision (:class:`Precision`).
    accumulation: how gradients accumulate over micro-steps (:class:`Accumulation`).
    owns_gradients: the library's own engine runs backward and the optimizer step, so callbacks cannot read or
        rescale ``param.grad`` (DeepSpeed).
    module_transforms: functions may swap modules of the plain model before it is parallelised (FP8's Linear swap).
    float8_all_gather: FSDP2 can all-gather float8 weights (NCCL only).
    compile: ``torch.compile`` per block is offered.
    async_checkpoint: sharded checkpoints can be written in the background.
    offload: which states the engine can keep off the device (the options that put them there name them).
    """

    precision: Precision = Precision.AUTOCAST
    accumulation: Accumulation = Accumulation.NO_SYNC
    owns_gradients: bool = False
    module_transforms: bool = True
    float8_all_gather: bool = False
    compile: bool = True
    async_checkpoint: bool = True
    offload: tuple[str, ...] = ()


@dataclass(frozen=True)
class Layout:
    """How an engine, with given options, holds a model's states (see the module docstring).

    params, grads, optimizer: each state (:class:`Params`, :class:`Grads`, :class:`Optimizer`).
    split_by: model-parallel dimensions that split the model itself (``tp``: heads and MLPs, ``pp``: stages of
        layers, ``ep``: experts); their degrees come from the options.
    partition: how a sharded state is cut (:class:`Partition`).
    tables: embedding tables are placed by torchrec's planner (fp32, their optimizer fused into backward, no
        gradients kept); the states above describe the rest of the model.
    buffers: temporary memory (:class:`Buffers`).
    work: the framework's work per block (:class:`Work`).
    searched: dimensions whose degrees the planner chooses (``Engine.degree_options`` turns degrees into options).
    can: capabilities (:class:`Capabilities`).
    """

    params: Params
    grads: Grads
    optimizer: Optimizer
    split_by: tuple[str, ...] = ()
    partition: Partition = Partition.DIM0
    tables: bool = False
    buffers: Buffers = field(default_factory=Buffers)
    work: Work = Work.PLAIN
    searched: tuple[str, ...] = ()
    can: Capabilities = field(default_factory=Capabilities)

    def __post_init__(self) -> None:
        for state in (self.params, self.grads, self.optimizer):
            unknown = [d for d in state.sharded_over if d not in DATA_PARALLEL]
            if unknown:
                raise ValueError(f"{type(state).__name__}.sharded_over={state.sharded_over}: {unknown} are not"
                                 f" data-parallel dimensions; choose among {', '.join(DATA_PARALLEL)}")
        for name in (*self.split_by, *self.searched):
            if name not in DATA_PARALLEL + MODEL_PARALLEL:
                raise ValueError(f"{name!r} is not a ParallelDims dimension; choose among"
                                 f" {', '.join(DATA_PARALLEL + MODEL_PARALLEL)}")

    @property
    def states(self) -> tuple[State, State, State]:
        return self.params, self.grads, self.optimizer

    @property
    def sharded(self) -> bool:
        """Some state is split over data-parallel ranks."""
        return any(state.sharded_over for state in self.states)

    @property
    def replica(self) -> bool:
        """Every rank holds the whole model and all its states (a plain replica: DDP)."""
        return not (self.sharded or self.split_by or self.tables)

    @property
    def offloaded(self) -> bool:
        """Some state lives off the device."""
        return any(state.where is not Where.DEVICE for state in self.states)


__all__ = ["Accumulation", "Buffers", "Capabilities", "DATA_PARALLEL", "Dtype", "Gather", "Grads", "Layout",
           "MODEL_PARALLEL", "Optimizer", "Params", "Partition", "Precision", "Reduce", "State", "Steps", "Units",
           "Where", "Work"]
