"""FSDP2 (``fully_shard``): one unit per block, then the root."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from disttrain.parallel.engines.precision import mixed_precision_policy
from disttrain.parallel.split.ac import apply_ac
from disttrain.parallel.split.blocks import BlockSpec, find_blocks
from disttrain.parallel.split.compile import compile_blocks
from disttrain.parallel.split.compress import Traffic, install_reduce_scatter


@dataclass
class FSDPOptions:
    """What a user can set on ``disttrain_fsdp`` (the same names on the Trainer and Fabric strategies).

    wrap_classes: block class(es) or class name(s) to shard one unit each; default: found automatically.
    activation_checkpointing: recompute each block's activations in backward.
    cpu_offload: keep parameters, gradients and optimizer state on the CPU between uses.
    reshard_after_forward: free gathered parameters after forward (True, ZeRO-3) or keep them until backward
        (False, ZeRO-2 style: more memory, one all-gather less), or an int: reshard to that smaller group size.
    empty_init: build the model on the meta device when the Trainer/Fabric does not say (``configure_model`` /
        ``init_module()``), so no rank ever holds the whole model; shards are initialised after sharding.
    save_distributed_checkpoint: sharded (torch.distributed.checkpoint) checkpoints; False writes one full file.
    async_checkpoint: write sharded checkpoints in the background: a save copies the tensors to host memory and
        training goes on while they are written (the same folder, manifest and checksums; at most one save in flight;
        the run's end waits for the last one).
    hybrid_shard: HSDP on a 2D mesh: shard within a group of ``shard_size`` ranks (default: the processes of one
        node), replicate across groups (nodes): all-gathers stay on the fast intra-node links, only the gradient
        all-reduce crosses nodes.
    shard_size: ranks per shard group under ``hybrid_shard``; must divide the world size.
    broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the data-parallel ranks: the first
        rank's after every training forward, as DDP's ``broadcast_buffers=True`` does; False lets each rank keep
        its own.
    sync_batchnorm: BatchNorm layers as SyncBatchNorm over the data-parallel ranks (GPU only, as under DDP); the
        Trainer's ``sync_batchnorm=True`` does the same.
    gradient_compression: None (gradients reduce-scattered in fp32, whatever the precision), "bf16" (in bf16: half
        the bytes) or "int8" (a quarter: a scale per chunk of 256 elements, error feedback).
    compile: ``torch.compile`` each block (after activation checkpointing, before sharding; FSDP's hooks stay outside
        the graph); the compiled code is cached under ``TORCHINDUCTOR_CACHE_DIR`` for the next run.
    """

    wrap_classes: BlockSpec = None
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    reshard_after_forward: Union[bool, int] = True
    empty_init: bool = False
    save_distributed_checkpoint: bool = True
    async_checkpoint: bool = False
    hybrid_shard: bool = False
    shard_size: Optional[int] = None
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    gradient_compression: Optional[str] = None
    compile: bool = False

    def __post_init__(self) -> None:
        if self.gradient_compression is not None and self.gradient_compression not in COMPRESSIONS:
            raise ValueError(f"gradient_compression={self.gradient_compression!r} is not offered by FSDP; choose None"
                             f" or one of {', '.join(COMPRESSIONS)} (fp16 and powersgd are disttrain_ddp's)")
        if self.gradient_compression == "int8" and self.hybrid_shard:
            raise ValueError("gradient_compression='int8' compresses the reduce-scatter within a shard group only;"
                             " under hybrid_shard=True the all-reduce across groups would stay fp32: use"
                             " gradient_compression='bf16' (both in bf16), or hybrid_shard=False")
        if self.async_checkpoint and not self.save_distributed_checkpoint:
            raise ValueError("async_checkpoint=True writes sharded checkpoints in the background, but"
                             " save_distributed_checkpoint=False writes one full file from rank 0; set"
                             " save_distributed_checkpoint=True, or remove async_checkpoint")

    @property
    def reduce_dtype(self) -> Optional[torch.dtype]:
        """The dtype FSDP2 reduces gradients in (None: its default, fp32 here). int8 quantises from fp32."""
        return torch.bfloat16 if self.gradient_compression == "bf16" else None


COMPRESSIONS = ("bf16", "int8")


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    if not cpu_offload:
        return OffloadPolicy()
    # Pinned host memory needs the CUDA driver; on CPU-only machines pinning would fail (and gains nothing).
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    options: FSDPOptions,
    precision: str = "32-true",
    device: torch.device | None = None,
    traffic: Traffic | None = None,
    dynamic: Optional[bool] = None,
) -> list[nn.Module]:
    """Shard ``model`` in place: activation checkpointing and ``fully_shard`` per block, then per sub-network (see
    :func:`sub_networks`), then the root; gradients reduced as ``options.gradient_compression`` says, their bytes
    counted into ``traffic`` when given.

    Returns the FSDP units of the blocks (or their checkpoint wrappers). ``mesh`` is the data-parallel mesh;
    ``dynamic``: torch.compile's, under ``compile``.
    """
    device = device or torch.device(mesh.device_type)
    blocks = shard_blocks(model, find_blocks(model, options.wrap_classes), mesh, options, precision, device, dynamic)
    # A sub-network is an entry point like the root (its outputs feed a loss computed outside it): fp32 outputs.
    for child in sub_networks(model, blocks):
        shard_root(child, mesh, options, precision, device)
    shard_root(model, mesh, options, precision, device)
    if traffic is not None or options.gradient_compression == "int8":
        install_reduce_scatter([m for m in model.modules() if isinstance(m, FSDPModule)],
                               options.gradient_compression, traffic or Traffic())
    guard_sharded_calls(model, blocks, mesh)
    return blocks


def shard_blocks(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, options: FSDPOptions,
                 precision: str, device: torch.device, dynamic: Optional[bool] = None) -> list[nn.Module]:
    """Activation checkpointing and ``torch.compile`` (when the options ask) and one FSDP unit per block of
    ``model``, in order; the blocks compute in half precision under ``*-mixed``. Returns the units (the checkpoint
    wrappers under AC); ``dynamic``: torch.compile's, under ``compile``."""
    if options.activation_checkpointing:
        blocks = apply_ac(model, blocks)
    if options.compile:
        compile_blocks(blocks, dynamic=dynamic)
    policy = mixed_precision_policy(precision, reduce_dtype=options.reduce_dtype)
    common = dict(mesh=mesh, offload_policy=offload_policy(options.cpu_offload, device),
                  **({"mp_policy": policy} if policy else {}))
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: resharding them is wasted work.
        reshard = options.reshard_after_forward if i < len(blocks) - 1 else False
        _shard(block, reshard_after_forward=reshard, **common)
    return blocks


def _shard(module: nn.Module, **kwargs: Any) -> None:
    """``fully_shard``, keeping what transformers records from the module's forward. fully_shard gives the module a
    class of its own (``FSDPMixtralModel``), and transformers looks up which outputs a model records (an MoE
    router's logits, from which its auxiliary loss is computed) by the class's name: without the entry copied to the
    new class an MoE model trained with output_router_logits=True would silently lose its auxiliary loss."""
    cls = type(module)
    fully_shard(module, **kwargs)
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # an older transformers records by class reference, which fully_shard keeps as a base
        return
    flags = dict.get(_CAN_RECORD_REGISTRY, str(cls))
    if flags:
        dict.__setitem__(_CAN_RECORD_REGISTRY, str(type(module)), flags)


def shard_root(module: nn.Module, mesh: DeviceMesh, options: FSDPOptions, precision: str,
               device: torch.device) -> None:
    """One FSDP unit for ``module``'s parameters outside the units inside it: an entry point (the model, a
    sub-network, a pipeline stage) whose outputs stay fp32 under ``*-mixed``, for a loss computed outside it."""
    policy = mixed_precision_policy(precision, root=True, reduce_dtype=options.reduce_dtype)
    _shard(module, mesh=mesh, reshard_after_forward=options.reshard_after_forward,
           offload_policy=offload_policy(options.cpu_offload, device), **({"mp_policy": policy} if policy else {}))


def sub_networks(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The direct children of ``model`` that get an FSDP unit of their own: those holding parameters outside the
    blocks, unless they share one with another part of the model (tied weights must stay in one unit).

    The root unit's parameters are gathered only around the root's forward (the model's ``forward``, a
    LightningModule's ``training_step``) and are resharded by the first backward inside it, so a sub-network
    called on its own would see shards: a GAN's generator and discriminator with a backward after each, the parts
    of a container set up by one ``fabric.setup``, ``module.model(x)`` after ``trainer.fit``. A unit of its own
    gathers around each of its calls, any number per step; with one forward per step its parameters are gathered
    for the span the root's would be.
    """
    block_ids = {id(b) for b in blocks}
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    children = list(_callable_children(model))
    holders: dict[int, set[str]] = {}  # parameter -> names of the children holding it ("" for the root itself)
    for p in model.parameters(recurse=False):
        holders.setdefault(id(p), set()).add("")
    for name, child in children:
        for p in child.parameters():
            holders.setdefault(id(p), set()).add(name)
    chosen = []
    for name, child in children:
        params = list(child.parameters())
        if id(child) in block_ids or all(id(p) in in_blocks for p in params):
            continue  # already a unit, or nothing of its own to gather
        if all(holders[id(p)] == {name} for p in params):
            chosen.append(child)
    return chosen


def unit_count(model: nn.Module, wrap_classes: BlockSpec = None) -> int:
    """The FSDP units :func:`apply_fsdp` makes of ``model`` (a module on any device, meta too): one per block, one
    per sub-network, and the root. Each gathers and reduce-scatters on its own, so each costs a collective's
    latency per gather."""
    blocks = find_blocks(model, wrap_classes)
    return len(blocks) + len(sub_networks(model, blocks)) + 1


def _callable_children(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The children of ``module`` that can be called, looking through containers that cannot (a ModuleDict or
    ModuleList has no forward: fully_shard refuses them, and their parts are what gets called, e.g. litgpt's
    ``transformer.wte`` and ``transformer.ln_f``)."""
    for name, child in module.named_children():
        if type(child).forward is nn.Module.forward:
            yield from _callable_children(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child


def guard_sharded_calls(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh) -> None:
    """Replace torch's ``aten.addmm.default got mixed torch.Tensor and DTensor`` by one line naming the fix when a
    layer outside the blocks (embedding, head, norm) is called while its unit holds only shards: called on its own,
    outside the forward of the unit that gathers it. Only those few layers get the check (the blocks' layers would
    add a hook call per layer per step); a unit's own gather hook runs before it, so calls inside a forward pass."""
    fsdp_dims = set(mesh.mesh_dim_names or ())
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    units = {id(m): name for name, m in model.named_modules() if isinstance(m, FSDPModule)}

    def unit_of(name: str) -> str:
        parts = name.split(".")
        for end in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:end])
            if id(model.get_submodule(prefix)) in units:
                return prefix
        return ""

    for name, module in model.named_modules():
        if id(module) in in_blocks or id(module) in units or not any(True for _ in module.parameters(recurse=False)):
            continue
        module.register_forward_pre_hook(_refuse_shards(name, unit_of(name), fsdp_dims))


def _refuse_shards(name: str, unit: str, fsdp_dims: set[str]):
    def check(module: nn.Module, args: Any) -> None:
        for p in module.parameters(recurse=False):
            if isinstance(p, DTensor) and fsdp_dims & set(p.device_mesh.mesh_dim_names or ()):
                raise RuntimeError(
                    f"{type(module).__name__} '{name}' holds FSDP shards here: it was called outside the forward of"
                    f" {repr(unit) if unit else 'the model'}, which gathers its parameters; call"
                    f" {repr(unit) if unit else 'the model'} itself on every rank, or gather the whole model first:"
                    " `with trainer.strategy.full_model(): ...` (Fabric: `fabric.strategy.full_model(model)`)")
    return check


def shard_elements(shapes: Iterable[Sequence[int]], rank: int, n: int) -> int:
    """Elements FSDP2 keeps on ``rank`` of ``n`` for parameters of these shapes: each parameter is chunked on dim 0
    with ``torch.chunk`` (``ceil(rows / n)`` rows per rank, the last ranks fewer or none), so the first ranks hold
    the most; dividing the element count by ``n`` misses that padding, which grows with ``n``."""
    total = 0
    for shape in shapes:
        rows = shape[0] if len(shape) else 1
        per = math.ceil(rows / n)
        total += max(0, min(per, rows - rank * per)) * math.prod(shape[1:])
    return total


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP2's reduce-scatter off for the non-final micro-steps of gradient accumulation."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled, recurse=False)


def claim_root(model: nn.Module) -> None:
    """Make ``model`` the root of its FSDP units now, as its first forward would. FSDP2 otherwise picks as root the
    first unit called: after a sub-network was called directly (``pair.generator(z)`` under Fabric), a later call of
    the whole model would fail with "requires running forward through the root module first". torch has no public
    call for this; the attribute check keeps a torch without it on the lazy path."""
    state = model._get_fsdp_state() if isinstance(model, FSDPModule) else None
    if state is not None and hasattr(state, "_lazy_init"):
        state._lazy_init()


@contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Collective (every rank enters): every FSDP unit of ``model`` holds its full parameters until the block ends,
    and calls of ``model`` or any part of it inside run without communication, on any rank (e.g. on rank 0 only),
    under ``torch.no_grad()``. Parameters are resharded on exit. The memory of the whole model is needed meanwhile.

    ``state_dict()`` inside gives the full parameters as plain tensors (in the dtype the model computes in), so
    ``save_pretrained`` (transformers, peft) and ``safetensors`` work on rank 0 alone. Those tensors are the gathered
    parameters themselves: their memory is freed on exit (``.clone()`` what must outlive the block). Loading into the
    model inside the block is not supported (the gathered copies are dropped on exit; load into the sharded model).

    FSDP2 has no ``summon_full_params``: unshard every unit and stop the units from resharding after their forward
    (restored exactly on exit, an int ``reshard_after_forward`` included, hence the saved per-group setting). FSDP2
    also reshards a unit before its ``state_dict()`` (a pre-hook per parameter group, so that a state dict holds
    shards); that hook is lifted for the block and registered again on exit.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()
    groups = [group for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups]
    saved = [(group, group.post_forward_mesh_info) for group in groups]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()  # the first unshard also registers the state-dict hooks (FSDP's lazy init)
        for group in groups:
            _lift_state_dict_resharding(group)
        with torch.no_grad():
            yield model
    finally:
        for group, info in saved:
            group.post_forward_mesh_info = info
        for group in groups:
            _restore_state_dict_resharding(group)
        for unit in units:
            unit.reshard()


def _lift_state_dict_resharding(group: Any) -> None:
    for handle in group._module_to_pre_save_state_dict_hook_handle.values():
        handle.remove()
    group._module_to_pre_save_state_dict_hook_handle.clear()


def _restore_state_dict_resharding(group: Any) -> None:
    """FSDP registers its save and load hooks together (and only when neither is registered): drop the load hooks
    too and let it register both again."""
    if group._module_to_pre_save_state_dict_hook_handle:
        return
    for handle in group._module_to_pre_load_state_dict_hook_handle.values():
        handle.remove()
    group._module_to_pre_load_state_dict_hook_handle.clear()
    group._register_state_dict_hooks()
