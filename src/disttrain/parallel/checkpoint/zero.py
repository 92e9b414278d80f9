"""ZeRO partitions (stages 1, 2 and 3) in the one checkpoint layout: each rank writes and reads only the partitions
DeepSpeed gave it, in the terms every other strategy uses (see the comment above :func:`flat_range_boxes`); and the
full model in one file (torch and deepspeed only)."""

from __future__ import annotations

import ctypes
import math
import os
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from disttrain.parallel.checkpoint.io import restore_rest, write_from_rank0
from disttrain.parallel.engines.deepspeed import zero_stage_of


def export_zero(module: torch.nn.Module, path: Union[str, os.PathLike], prefix: str = "") -> Path:
    """The full state dict of a DeepSpeed model, written from rank 0 as safetensors, in the training dtype: ZeRO-3's
    partitions gathered on every rank; ZeRO-1/2's parameters are whole on every rank already. Collective: call on
    every rank."""
    import deepspeed

    partitioned = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
    state: dict[str, torch.Tensor] = {}
    gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None) if partitioned else nullcontext()
    with gathered:
        if torch.distributed.get_rank() == 0:
            state = {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}
    return write_from_rank0(state, path, prefix)


# -- the one checkpoint layout (DCP, parameters by fully qualified name) -----------------------------------------
# Why this way: DeepSpeed's own folder holds flat per-rank fp32 partitions whose boundaries depend on the world size
# and on its sub-groups, so nothing else can read it. Here each rank describes what it already holds in the terms
# every strategy uses: a parameter is stored under its FQN with its full shape (the fp32 master weights when the
# optimizer holds them; Adam moments likewise, flattened per parameter as `checkpoint.flatten_optimizer` does), and
# ZeRO-3's partition of it, elements [rank x p, (rank + 1) x p) of the flattened tensor (p = ceil(numel / world),
# the rest padding), is a union of a few n-d boxes: a ShardedTensor with one local shard per box, each aliasing
# DeepSpeed's own partition memory. DCP writes every rank's boxes from that rank, in place, and on load reads for
# each box only the stored chunks that overlap it, straight into the partition. Nothing is gathered: a save needs
# next to no extra host memory and a load about a stored chunk at a time, where gathering held the whole model and
# optimizer state on rank 0 (and on every rank to load); and the folder moves to and from every other strategy and
# world size through DCP's resharding.
# ZeRO-1/2 keep every parameter whole on every rank and partition the fp32 master weights and the optimizer state
# instead: each parameter group is one flat tensor (the parameters in order, padded to a multiple of the world size),
# rank r holding elements [r x P, (r + 1) x P). A parameter's elements that fall in a rank's range are again a flat
# range of the parameter, stored as the same boxes; the rank's partition of the group is the union of such ranges
# of consecutive parameters.

def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The n-d boxes ``(offsets, sizes)`` whose union is elements ``[start, end)`` of a row-major tensor of ``shape``,
    in storage order. Each box is a contiguous run of the flattened tensor (``flat[a:b].view(sizes)``); there are
    at most ``2 x ndim - 1`` of them."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, first_col = divmod(start, inner)
    last, last_col = divmod(end, inner)

    def in_row(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], a, b)]

    if first == last:
        return in_row(first, first_col, last_col)
    boxes = []
    if first_col:  # the end of a partial first row
        boxes += in_row(first, first_col, inner)
        first += 1
    if last > first:  # whole rows
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    return boxes + in_row(last, 0, last_col)  # the start of a partial last row


def _partition_ranges(param: torch.nn.Parameter) -> list[tuple[int, int]]:
    """Per rank of the partition group: the elements ``[start, end)`` of the flattened parameter its partition
    holds, padding excluded (a parameter smaller than the world leaves the last ranks empty)."""
    size, numel = param.partition_numel(), param.ds_numel
    world = torch.distributed.get_world_size(group=param.ds_process_group)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(world)]


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """The same memory as ``view`` (a slice of DeepSpeed's flat partition), as a tensor whose storage is exactly its
    bytes. Why: DCP's file writer copies every tensor that is a view of a larger storage and keeps the copies until
    the rank's file is closed, which would cost each rank its whole share of the checkpoint in host memory while
    saving; a tensor of its own storage is written in place. The alias holds ``view``, so the memory outlives it."""
    if view.device.type != "cpu" or view.numel() == 0:
        return view  # device memory is copied to the host by DCP anyway
    memory = (ctypes.c_byte * view.nbytes).from_address(view.data_ptr())
    alias = torch.frombuffer(memory, dtype=view.dtype).view(view.shape)
    alias.owner = view
    return alias


def _sharded(partition: torch.Tensor, shape: Sequence[int], ranges: list[tuple[int, int]], rank: int) -> Any:
    """A ShardedTensor of full ``shape`` whose local shards are views of ``partition`` (this rank's flat slice of
    the tensor, from element ``ranges[rank][0]``); its global metadata lists every rank's boxes."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    partition = partition.detach()
    local, every = [], []
    for r, (start, end) in enumerate(ranges):
        at = 0
        for offsets, sizes in flat_range_boxes(shape, start, end):
            # Placements name the rank; the device is only checked for this rank's own shards.
            meta = ShardMetadata(list(offsets), list(sizes), f"rank:{r}/{partition.device}")
            every.append(meta)
            numel = math.prod(sizes)
            if r == rank:
                local.append(Shard(_own_storage(partition[at:at + numel].view(sizes)), meta))
            at += numel
    properties = TensorProperties(dtype=partition.dtype, pin_memory=partition.is_pinned())
    # No collective: every rank computes the same global metadata from the partition sizes.
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(every, torch.Size(shape), properties))


@dataclass
class _Slot:
    """Where one stored tensor of a parameter lives on this rank: ``partition`` is this rank's flat slice (a view
    of DeepSpeed's memory, or a copy for NVMe-swapped optimizer state, which ``commit`` writes back after a load)."""

    partition: torch.Tensor
    commit: Optional[Callable[[], None]] = None


class _Layout:
    """The partitions of one DeepSpeed model (and its ZeRO optimizer, which holds the fp32 master weights and the
    moments) as ShardedTensors in the one layout, for saving and as load targets. A subclass says, per stage, which
    parameters are partitioned and where each rank's part of a parameter, its master weights and moments live."""

    zero: Any  # DeepSpeed's ZeRO optimizer of this stage, or None (a model set up without one)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.rank = torch.distributed.get_rank()
        self.pending: list[Callable[[], None]] = []

    # -- what each stage says ---------------------------------------------------------------------------------
    def groups(self) -> list[list[torch.nn.Parameter]]:
        """The optimizer's parameters, per flat group (``optimizer.param_groups[i]`` holds group i's flat tensor)."""
        raise NotImplementedError

    def flat(self, group: int) -> torch.Tensor:
        """Group ``group``'s flat fp32 partition: the key of its optimizer state."""
        raise NotImplementedError

    def shape(self, param: torch.nn.Parameter) -> torch.Size:
        raise NotImplementedError

    def partitioned(self, param: torch.nn.Parameter) -> bool:
        """Whether the parameter is stored from its partitions (else as the tensor it is, the same on every rank)."""
        raise NotImplementedError

    def ranges(self, param: torch.nn.Parameter) -> list[tuple[int, int]]:
        """Per rank: the elements ``[start, end)`` of the flattened parameter its partition holds (padding
        excluded; empty where it holds none)."""
        raise NotImplementedError

    def weights(self, param: torch.nn.Parameter, name: str) -> _Slot:
        raise NotImplementedError

    def moment(self, param: torch.nn.Parameter, key: str) -> _Slot:
        raise NotImplementedError

    def around_load(self) -> AbstractContextManager:
        return nullcontext()

    def after_load(self) -> None:
        """The low-precision parameters the model computes with follow the loaded fp32 master weights."""

    # -- shared -------------------------------------------------------------------------------------------------
    def names(self) -> dict[int, str]:
        """id(parameter) -> its FQN (the first one, for tied parameters), as the optimizer state is keyed."""
        return {id(p): n for n, p in self.module.named_parameters()}

    def sharded(self, slot: _Slot, param: torch.nn.Parameter) -> Any:
        if slot.commit is not None:
            self.pending.append(slot.commit)
        return _sharded(slot.partition, self.shape(param), self.ranges(param), self.rank)

    def model_state(self, keys: Optional[set[str]] = None) -> dict[str, Any]:
        """Each entry of the module's state dict (or only ``keys``): partitioned parameters as ShardedTensors, tied
        names included; buffers (the same on every rank; DCP writes one copy) and parameters that are not
        partitioned as they are."""
        params = dict(self.module.named_parameters(remove_duplicate=False))
        state: dict[str, Any] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if keys is not None and name not in keys:
                continue
            param = params.get(name)
            if param is None or not self.partitioned(param):
                state[name] = tensor.detach()
            else:
                state[name] = self.sharded(self.weights(param, name), param)
        return state

    def hyper(self, group: int) -> dict[str, Any]:
        return {k: v for k, v in self.zero.optimizer.param_groups[group].items() if k != "params"}

    def flat_state(self, group: int) -> dict[str, Any]:
        return self.zero.optimizer.state.get(self.flat(group), {})

    def flat_moment(self, group: int, key: str) -> torch.Tensor:
        """Optimizer state ``key`` of a group's flat partition; created (zeros) when the optimizer has not stepped
        yet (torch optimizers create their state at the first step)."""
        flat = self.flat(group)
        state = self.zero.optimizer.state[flat]
        if key not in state:
            state[key] = torch.zeros_like(flat)
        return state[key]

    def optimizer_state(self) -> dict[str, Any]:
        """``{"state.<fqn>.<key>": ..., "param_groups.<fqn>.<hyper>": ...}`` (``checkpoint.flatten_optimizer``'s
        form): moments as ShardedTensors, scalars shared by a group ("step") and hyper-parameters as values
        (the same on every rank; DCP writes one copy)."""
        names = self.names()
        flat: dict[str, Any] = {}
        for i, params in enumerate(self.groups()):
            numel = self.flat(i).numel()
            for param in params:
                fqn = names[id(param)]
                for key, value in self.flat_state(i).items():
                    if torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel:
                        flat[f"state.{fqn}.{key}"] = self.sharded(self.moment(param, key), param)
                    else:  # a scalar shared by the flat group
                        flat[f"state.{fqn}.{key}"] = value.detach() if torch.is_tensor(value) else value
                flat.update({f"param_groups.{fqn}.{k}": v for k, v in self.hyper(i).items()})
        return flat


class _Zero3Layout(_Layout):
    """ZeRO-3: every parameter partitioned (``ds_tensor``); the optimizer's fp32 master weights and moments are
    flat sub-groups holding each parameter's partition at an offset."""

    def __init__(self, module: torch.nn.Module, optimizer: Any = None) -> None:
        super().__init__(module)
        self.zero = optimizer if zero_stage_of(optimizer) == 3 else None
        # fp32 master and moments of a parameter: (sub-group, offset of its partition in the flat sub-group tensor)
        self.slots: dict[int, tuple[int, int]] = {}
        if self.zero is not None:
            for group in self.zero.fp16_groups:
                for p in group:
                    sub_group, offset, _ = self.zero.grad_position[self.zero.get_param_id(p)]
                    self.slots[id(p)] = (int(sub_group), int(offset))
        self.swapped = bool(getattr(self.zero, "swap_optimizer", False))
        world = torch.distributed.get_world_size()
        for name, p in module.named_parameters():
            if hasattr(p, "ds_tensor") and torch.distributed.get_world_size(group=p.ds_process_group) != world:
                raise NotImplementedError(
                    f"{name} is partitioned over {torch.distributed.get_world_size(group=p.ds_process_group)} of"
                    f" {world} ranks (MiCS / hierarchical partitioning); disttrain checkpoints need ZeRO-3"
                    " partitioning over all ranks: remove mics_shard_size from the ds_config")

    def groups(self) -> list[list[torch.nn.Parameter]]:
        return self.zero.fp16_groups

    def flat(self, group: int) -> torch.Tensor:
        return self.zero.fp32_partitioned_groups_flat[group]

    def shape(self, param: torch.nn.Parameter) -> torch.Size:
        return param.ds_shape

    def partitioned(self, param: torch.nn.Parameter) -> bool:
        return hasattr(param, "ds_tensor")

    def ranges(self, param: torch.nn.Parameter) -> list[tuple[int, int]]:
        return _partition_ranges(param)

    def weights(self, param: torch.nn.Parameter, name: str) -> _Slot:
        """The fp32 master partition when the optimizer holds one, else the parameter's own (frozen parameters,
        or a model without optimizer)."""
        slot = self.slots.get(id(param))
        if slot is None:
            if param.ds_tensor.numel() < param.partition_numel():
                raise NotImplementedError(f"{name} is swapped out to NVMe and has no optimizer copy; checkpoints"
                                          " of frozen parameters under offload_parameters='nvme' are not supported")
            return _Slot(param.ds_tensor.data)
        if self.swapped:
            from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

            copy = safe_get_local_fp32_param(param).to("cpu", copy=True)
            return _Slot(copy, lambda: safe_set_local_fp32_param(param, copy))
        sub_group, offset = slot
        return _Slot(self.flat(sub_group).narrow(0, offset, param.partition_numel()))

    def moment(self, param: torch.nn.Parameter, key: str) -> _Slot:
        """The partition of optimizer state ``key`` (one value per element, e.g. exp_avg)."""
        sub_group, offset = self.slots[id(param)]
        if self.swapped:
            from deepspeed.utils import safe_get_local_optimizer_state, safe_set_local_optimizer_state

            if key not in self.flat_state(sub_group):
                raise NotImplementedError(
                    f"cannot restore optimizer state {key!r} under offload_optimizer='nvme' before the first step"
                    " (DeepSpeed creates the swapped state there); resume with offload_optimizer='cpu' and switch"
                    " back at the next checkpoint (the layout is the same)")

            copy = safe_get_local_optimizer_state(param, key).to("cpu", copy=True)
            return _Slot(copy, lambda: safe_set_local_optimizer_state(param, copy, key))
        return _Slot(self.flat_moment(sub_group, key).narrow(0, offset, param.partition_numel()))

    def around_load(self) -> AbstractContextManager:
        return _partitions_only(self.module, self.zero)

    def after_load(self) -> None:
        if self.zero is not None:
            for i in range(len(self.zero.fp16_groups)):
                self.zero._reassign_or_swap_out_partitioned_parameters(i)


class _Zero12Layout(_Layout):
    """ZeRO-1/2: parameters whole on every rank (16-bit under mixed precision); each of the optimizer's parameter
    groups is one flat tensor of its trainable parameters (DeepSpeed's ``bit16_groups_flat``, each parameter at
    ``round_robin_bit16_offsets``, padded to a multiple of the world size) whose range [r x P, (r + 1) x P),
    ``P = partition_size``, rank r's fp32 master weights (``single_partition_of_fp32_groups``) and moments hold. A
    model without optimizer (or frozen parameters) is stored as it is."""

    def __init__(self, module: torch.nn.Module, optimizer: Any = None) -> None:
        super().__init__(module)
        self.zero = optimizer if zero_stage_of(optimizer) in (1, 2) else None
        self.slots: dict[int, tuple[int, int]] = {}  # id(parameter) -> (group, its first element in the group's flat)
        if self.zero is None:
            return
        world = torch.distributed.get_world_size()
        for i, params in enumerate(self.zero.round_robin_bit16_groups):
            ranks = torch.distributed.get_world_size(group=self.zero.real_dp_process_group[i])
            if ranks != world:
                raise NotImplementedError(
                    f"parameter group {i} is partitioned over {ranks} of {world} ranks (expert or sequence data"
                    " parallel groups); disttrain checkpoints need ZeRO partitioning over all ranks")
            for param, offset in zip(params, self.zero.round_robin_bit16_offsets[i]):
                self.slots[id(param)] = (i, int(offset))

    def groups(self) -> list[list[torch.nn.Parameter]]:
        return self.zero.bit16_groups

    def flat(self, group: int) -> torch.Tensor:
        return self.zero.single_partition_of_fp32_groups[group]

    def shape(self, param: torch.nn.Parameter) -> torch.Size:
        return param.shape

    def partitioned(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.slots

    def ranges(self, param: torch.nn.Parameter) -> list[tuple[int, int]]:
        group, offset = self.slots[id(param)]
        size, numel = self.zero.partition_size[group], param.numel()
        clamp = lambda element: min(max(element - offset, 0), numel)  # noqa: E731
        return [(clamp(r * size), clamp((r + 1) * size)) for r in range(torch.distributed.get_world_size())]

    def local(self, flat: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's elements of the parameter in a flat partition of its group (a view; empty if none)."""
        group, offset = self.slots[id(param)]
        start, end = self.ranges(param)[self.rank]
        if start == end:
            return flat.narrow(0, 0, 0)
        return flat.narrow(0, offset + start - self.rank * self.zero.partition_size[group], end - start)

    def weights(self, param: torch.nn.Parameter, name: str) -> _Slot:
        return _Slot(self.local(self.flat(self.slots[id(param)][0]), param))

    def moment(self, param: torch.nn.Parameter, key: str) -> _Slot:
        return _Slot(self.local(self.flat_moment(self.slots[id(param)][0], key), param))

    def after_load(self) -> None:
        if self.zero is not None:
            self.zero.update_lp_params()  # each rank's partition to 16-bit, then all-gathered: whole again


def _layout(module: torch.nn.Module, optimizer: Any = None) -> _Layout:
    """The layout of a DeepSpeed model by its stage: ZeRO-3's when its parameters are partitioned."""
    if zero_stage_of(optimizer) == 3 or any(hasattr(p, "ds_tensor") for p in module.parameters()):
        return _Zero3Layout(module, optimizer)
    return _Zero12Layout(module, optimizer)


@contextmanager
def _sharded_tensors_allowed() -> Iterator[None]:
    # DCP warns that ShardedTensor is deprecated for DTensor, but a DTensor cannot describe a flat range of a tensor;
    # ShardedTensor (several local shards per rank) is the type DCP still plans and reshards (torchrec relies on it).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield


def _zero_optimizer(optimizer: Any) -> Any:
    if zero_stage_of(optimizer) is None:
        raise TypeError(f"{type(optimizer).__name__} is not DeepSpeed's ZeRO optimizer; pass the optimizer that"
                        " fabric.setup returned for the disttrain_zero* model")
    return optimizer


def zero_model_state(module: torch.nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """This rank's part of the model state dict, by FQN, for ``dcp.save``: each parameter a ShardedTensor of its
    full shape holding only this rank's partition of the fp32 master weights when ``optimizer``, DeepSpeed's ZeRO
    optimizer, holds them (ZeRO-3 without one: the parameter's partition; ZeRO-1/2 without one: the whole
    parameter), buffers as they are. No collective and no copy."""
    return _layout(module, optimizer).model_state()


def zero_optimizer_state(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's part of the optimizer state by FQN in the flattened form every disttrain checkpoint stores
    (``checkpoint.flatten_optimizer``: ``"state.<fqn>.exp_avg"``, ``"param_groups.<fqn>.lr"``), for ``dcp.save``:
    moments as ShardedTensors over this rank's partitions. No collective and no copy."""
    return _layout(module, _zero_optimizer(optimizer)).optimizer_state()


def _is_moment(stored: Any, shape: Sequence[int], key: str) -> bool:
    """A stored optimizer entry with one value per element of a parameter of ``shape`` (exp_avg); otherwise a
    scalar shared by the group (step), or a plain value."""
    size = getattr(stored, "size", None)
    return size is not None and tuple(size) == tuple(shape) and not (len(size) == 0 and key == "step")


def _scalar_target(stored: Any) -> Any:
    size = getattr(stored, "size", None)
    return torch.empty(size, dtype=stored.properties.dtype) if size is not None else None


@torch.no_grad()
def load_zero_state(path: Union[str, os.PathLike], module: torch.nn.Module, optimizer: Any, model_key: str,
                    optim_key: Optional[str], strict: bool = True, reader: Any = None,
                    stored: Optional[set[str]] = None, left_out: Collection[str] = ()) -> None:
    """Load a disttrain checkpoint folder of any strategy and world size into a DeepSpeed ZeRO model (and, with
    ``optim_key``, the optimizer state): every rank reads only the stored chunks that overlap its partitions,
    directly into DeepSpeed's memory. ``optimizer``: the ZeRO optimizer holding the fp32 master weights (None for a
    model without one). ``reader``/``stored``: another storage and its tensor names (a pretrained folder).
    ``left_out``: model keys the checkpoint does not hold because the model already has them (a frozen pretrained
    base, :mod:`disttrain.parallel.checkpoint.frozen`). Collective."""
    from disttrain.parallel.checkpoint.io import CheckpointError, load_into, stored_entries

    path = Path(path)
    stored = stored if stored is not None else stored_entries(path)
    layout = _layout(module, optimizer)
    for key in filter(None, (model_key, optim_key)):
        if not any(k.startswith(f"{key}.") for k in stored):
            raise CheckpointError(f"checkpoint {str(path)!r} has no {key!r} (it holds"
                                  f" {sorted({k.split('.', 1)[0] for k in stored})}); pass the same state keys that"
                                  " were saved")
    in_file = {k[len(model_key) + 1:] for k in stored if k.startswith(f"{model_key}.")}
    expected = set(module.state_dict()) - set(left_out)
    missing, unexpected = sorted(expected - in_file), sorted(in_file - expected)
    if strict and (missing or unexpected):
        differences = ", ".join(f"{what} {keys[:5]}" for what, keys in zip(("missing", "unexpected"),
                                                                            (missing, unexpected)) if keys)
        raise CheckpointError(f"checkpoint {str(path)!r} does not match the model: {differences}; pass strict=False"
                              " to load the common keys")
    targets: dict[str, Any] = {model_key: layout.model_state(keys=expected & in_file)}
    apply_optimizer: Callable[[], None] = lambda: None
    if optim_key is not None:
        if layout.zero is None:
            raise TypeError("loading optimizer state needs DeepSpeed's ZeRO optimizer; pass the optimizer that"
                            " fabric.setup returned")
        targets[optim_key], apply_optimizer = _optimizer_targets(layout, optim_key, stored, path)
    with layout.around_load(), _sharded_tensors_allowed():
        load_into(path, targets, strict=strict, reader=reader)
        for commit in layout.pending:
            commit()
        apply_optimizer()
        layout.after_load()


@contextmanager
def _partitions_only(module: torch.nn.Module, zero: Any) -> Iterator[None]:
    """Around a load, which writes only the partitions: DeepSpeed keeps small ("persistent") parameters gathered
    between steps, so release every gathered copy first and gather the persistent ones again from the new
    partitions afterwards, as DeepSpeed's own load_checkpoint does."""
    if zero is not None:
        zero.checkpoint_event_prologue()
        yield
        zero.checkpoint_event_epilogue()
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    gathered = [p for p in module.parameters() if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
    if gathered:
        gathered[0].partition(gathered)
    yield
    persistent = [p for p in module.parameters() if getattr(p, "ds_persist", False)]
    if persistent:
        persistent[0].all_gather(persistent)


def _optimizer_targets(layout: _Layout, optim_key: str, stored: dict[str, Any],
                       path: Path) -> tuple[dict[str, Any], Callable[[], None]]:
    """The load targets of the optimizer entries the checkpoint holds for this model's parameters, and what puts
    the loaded scalars and hyper-parameters in place afterwards."""
    from disttrain.parallel.checkpoint.io import CheckpointError

    names = layout.names()
    prefix = f"{optim_key}."
    entries: dict[str, dict[str, Any]] = {}  # "state.<fqn>" / "param_groups.<fqn>" -> {key: stored metadata}
    for k, md in stored.items():
        if k.startswith(prefix):
            owner, key = k[len(prefix):].rsplit(".", 1)
            entries.setdefault(owner, {})[key] = md
    targets: dict[str, Any] = {}
    scalars: list[tuple[int, str, str]] = []  # (sub-group, key, target name)
    hypers: list[tuple[int, str, str]] = []
    for i, params in enumerate(layout.groups()):
        for param in params:
            fqn = names[id(param)]
            for key, md in entries.get(f"state.{fqn}", {}).items():
                name = f"state.{fqn}.{key}"
                if _is_moment(md, layout.shape(param), key):
                    targets[name] = layout.sharded(layout.moment(param, key), param)
                elif getattr(md, "size", None) is not None and len(md.size) > 0:
                    raise CheckpointError(f"checkpoint {str(path)!r}: {prefix}{name} has shape {list(md.size)} but"
                                          f" the parameter has shape {list(layout.shape(param))}; it was saved for"
                                          " another model")
                else:
                    targets[name] = _scalar_target(md)
                    scalars.append((i, key, name))
        if params:  # a flat group's parameters share hyper-parameters: take its first parameter's
            fqn = names[id(params[0])]
            for key in entries.get(f"param_groups.{fqn}", {}):
                targets[f"param_groups.{fqn}.{key}"] = None
                hypers.append((i, key, f"param_groups.{fqn}.{key}"))

    def apply() -> None:
        for i, key, name in scalars:
            layout.zero.optimizer.state[layout.flat(i)][key] = targets[name]
        for i, key, name in hypers:
            layout.zero.optimizer.param_groups[i][key] = targets[name]

    return targets, apply


def _split_zero_state(state: dict[str, Any]) -> tuple[Optional[tuple[str, torch.nn.Module]], Optional[tuple[str, Any]],
                                                       dict[str, Any]]:
    model = optimizer = None
    rest: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            if model is not None:
                raise ValueError(f"checkpoint state must hold exactly one model, found {model[0]!r} and {key!r}")
            model = (key, value)
        elif zero_stage_of(value) is not None or isinstance(value, torch.optim.Optimizer):
            optimizer = (key, value)
        else:
            rest[key] = value
    return model, optimizer, rest


def _master(model: torch.nn.Module, optimizer: Optional[tuple[str, Any]]) -> Any:
    """The ZeRO optimizer that holds the model's fp32 master weights: the one in the state, else the engine's."""
    if optimizer is not None:
        return _zero_optimizer(optimizer[1])
    engine_optimizer = getattr(model, "optimizer", None)
    return engine_optimizer if zero_stage_of(engine_optimizer) is not None else None


def save_zero_tensors(path: Union[str, os.PathLike], tensors: dict[str, Any], metadata: dict[str, Any]) -> Path:
    """Write ``tensors`` (``{key: zero_model_state(...) | zero_optimizer_state(...)}``) and ``metadata`` as one
    DCP checkpoint folder, atomically, each rank writing only its partitions. Collective."""
    from disttrain.parallel.checkpoint.io import save_sharded

    with _sharded_tensors_allowed():
        return save_sharded(path, tensors, metadata)


def load_zero_checkpoint(path: Union[str, os.PathLike], state: dict[str, Any], strict: bool = True,
                         weights_only: bool = True, master: Any = None, source: Any = None) -> dict[str, Any]:
    """Restore a ZeRO model/optimizer (and stateful objects of ``state``) from a disttrain DCP checkpoint of any
    strategy and world size, each rank reading only what its partitions need; returns the metadata ``state`` did
    not ask for. ``master``: the engine's ZeRO optimizer when ``state`` holds the model but not the optimizer
    (its fp32 master weights are what training continues from). ``source``: a checkpoint another library wrote,
    seen in the one layout (``reader``, ``metadata``, ``stored``), read in place of ``path``. Collective."""
    from disttrain.parallel.checkpoint.frozen import left_out, pop_record
    from disttrain.parallel.checkpoint.io import FORMAT_KEY, check_checkpoint, read_meta

    model, optimizer, rest = _split_zero_state(state)
    if model is None:
        raise ValueError("load_checkpoint needs state={'model': model, ...} naming at least the model to restore")
    if source is None:
        path = check_checkpoint(path)
        metadata, reader, stored = read_meta(path, weights_only), None, None
    else:
        metadata, reader, stored = dict(source.metadata), source.reader, source.stored
        metadata.pop(FORMAT_KEY, None)
    module = getattr(model[1], "module", model[1])
    skipped = left_out(path, metadata, model[0], model[1])
    pop_record(metadata)
    load_zero_state(path, module, _master(model[1], optimizer) or master, model[0],
                     optimizer[0] if optimizer else None, strict=strict, reader=reader, stored=stored,
                     left_out=skipped)
    loaded = {model[0]} | ({optimizer[0]} if optimizer else set())
    return restore_rest(state, loaded, metadata)
