"""Meta-device models: build without memory, shard, then allocate and initialise only each rank's shard."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _own_init(module: nn.Module):
    """The whole-model init a library gives a module, if any: HF ``initialize_weights``, timm ``init_weights``."""
    if callable(getattr(module, "initialize_weights", None)) and hasattr(module, "config"):
        def hf_init() -> None:
            for sub in module.modules():  # to_empty left garbage behind the flags HF uses to skip modules
                if hasattr(sub, "_is_hf_initialized"):
                    del sub._is_hf_initialized
            module.initialize_weights()
            _zero_padding_rows(module)
            if callable(getattr(module, "tie_weights", None)):
                module.tie_weights()
        return hf_init
    # fully_shard swaps a module's class for a generated subclass ("FSDPVisionTransformer") defined in torch: the
    # timm class is found in its bases.
    if callable(getattr(module, "init_weights", None)) and any(
            cls.__module__.startswith("timm.") for cls in type(module).__mro__):
        return module.init_weights
    return None


def _zero_padding_rows(module: nn.Module) -> None:
    """The padding row of each sharded embedding set to zero, as HF's init means it to be: its
    ``weight[padding_idx].zero_()`` on a DTensor zeroes a gathered copy, not the shard that holds the row."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # no public equivalent

    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if not isinstance(sub, nn.Embedding) or sub.padding_idx is None or not isinstance(weight, DTensor):
            continue
        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        row = sub.padding_idx % weight.shape[0] - offset[0]
        if 0 <= row < shape[0]:
            weight.to_local()[row].zero_()


@contextmanager
def _rank_distinct_rng(device: torch.device) -> Iterator[None]:
    """DTensor random ops keep one mesh-wide RNG stream only on accelerators; on CPU every rank would draw the
    same numbers and the shards of a weight would be copies of each other. Give each rank its own stream there
    (restored afterwards) and silence DTensor's warning about it."""
    if device.type != "cpu" or not dist.is_initialized():
        yield
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        torch.manual_seed(torch.initial_seed() + 7919 * dist.get_rank())
        yield


def parameters_home(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where a meta-device model's parameters are allocated: on the host under CPU offload, whatever device the model
    computes on (FSDP2 refuses offloaded parameters anywhere else, the root's embeddings and final norm included),
    else on ``device``."""
    return torch.device("cpu") if cpu_offload else device


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, cpu_offload: bool = False) -> None:
    """Allocate a (sharded) meta-device module on ``device`` and initialise it with the model's own init.

    HF models (anywhere in the tree, e.g. inside a LightningModule): ``initialize_weights``, which also
    recomputes rotary ``inv_freq`` buffers. timm models: ``init_weights``. Every other module that holds tensors:
    ``reset_parameters``; modules without one are reported. ``cpu_offload``: parameters on the host
    (:func:`parameters_home`), buffers on ``device``, where the forward reads them.
    """
    if not has_meta_tensors(module):
        return
    home = parameters_home(device, cpu_offload)
    module.to_empty(device=home)
    uninitialized: set[str] = set()

    def visit(sub: nn.Module) -> None:
        init = _own_init(sub)
        if init is not None:
            init()
            return
        if any(True for _ in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
            else:
                uninitialized.add(type(sub).__name__)
        for child in sub.children():
            visit(child)

    with _rank_distinct_rng(home):
        visit(module)
    if home != device:
        for sub in module.modules():
            for name, buffer in sub.named_buffers(recurse=False):
                sub._buffers[name] = buffer.to(device)
    if uninitialized:
        warnings.warn(
            f"meta-device init: {', '.join(sorted(uninitialized))} define no reset_parameters(); their tensors hold"
            " uninitialised memory. Add reset_parameters() to them or load a checkpoint after setup.",
            stacklevel=2,
        )


@torch.no_grad()
def same_across(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give every tensor of ``module`` that ``mesh`` (one dimension) does not split the values of the mesh's first rank.

    Ranks along such a dimension each hold a copy: HSDP's replicas hold the same shards, the ranks of a
    tensor-parallel group what tensor parallelism leaves whole (a ViT's patch and position embeddings and head;
    norms). After a meta-device model is initialised each copy holds its own random draw (:func:`materialize` gives
    the ranks of a CPU run distinct streams so that shards differ), and the copies would compute with different
    weights. Called once after initialisation; DTensors sharded over ``mesh`` are left alone."""
    (dim,) = mesh.mesh_dim_names or (None,)

    def copies() -> Iterator[torch.Tensor]:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if isinstance(tensor, DTensor):
                names = tensor.device_mesh.mesh_dim_names or ()
                if dim in names and not tensor.placements[names.index(dim)].is_replicate():
                    continue
                tensor = tensor.to_local()
            yield tensor

    from_first_rank(copies(), mesh.get_group())


@torch.no_grad()
def from_first_rank(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Give each of ``tensors`` (held by every rank of ``group``) the values of the group's first rank."""
    src = dist.get_global_rank(group, 0)
    for tensor in tensors:
        _broadcast(tensor, src, group)


def _broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    """``dist.broadcast``, also of a host tensor (offloaded parameters) over a group whose backend moves device
    tensors only (NCCL): through a device copy."""
    if tensor.device.type == "cpu" and torch.cuda.is_available() and "gloo" not in str(dist.get_backend(group)):
        on_device = tensor.to(torch.cuda.current_device())
        dist.broadcast(on_device, src=src, group=group)
        tensor.copy_(on_device)
    else:
        dist.broadcast(tensor, src=src, group=group)
