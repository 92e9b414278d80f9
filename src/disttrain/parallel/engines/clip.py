"""Gradient-norm clipping over sharded, tensor-parallel and pipeline-split parameters.

``torch.nn.utils.clip_grad_norm_`` handles FSDP2's DTensor gradients when they all live on one mesh. Under
``disttrain_megatron`` they do not: tensor-parallel weights sit on the (dp, tp) mesh and the rest (norms,
embeddings) on the dp mesh, which makes torch's norm fail ("All operands in aten.stack.default must have the same
mesh"), and under pipeline parallelism each rank holds only its stages' gradients, so each stage would clip by its
own partial norm and training would drift from the one-process run without any error. Here the norm is taken per
mesh (torch's own ``get_total_norm``), made global with ``full_tensor``, combined, then summed over the pipeline
stages; the scaling itself is torch's ``clip_grads_with_norm_``-rule on each gradient.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0,
                    pp_group: dist.ProcessGroup | None = None,
                    uncounted: Collection[torch.Tensor] = ()) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients of the whole model, equal on every rank (a plain tensor).
    ``pp_group``: the pipeline group, whose ranks hold disjoint parts of the model; ``uncounted``: copies of a
    weight whose gradient another rank counts (the last stage's copy of a tied embedding)."""
    norm_type = float(norm_type)
    skip = {id(p) for p in uncounted}
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None and id(p) not in skip:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    # A stage may hold no gradient (pruned, frozen): it still joins the pipeline group's reduction.
    device = norms[0].device if norms else _group_device(pp_group)
    norms_t = torch.stack([n.to(device) for n in norms]) if norms else torch.zeros(1, device=device)
    if math.isinf(norm_type):
        total = norms_t.max()
        if pp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        return total
    powered = norms_t.pow(norm_type).sum()
    if pp_group is not None:
        dist.all_reduce(powered, group=pp_group)
    return powered.pow(1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = True, pp_group: dist.ProcessGroup | None = None,
                    uncounted: Collection[torch.Tensor] = ()) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (total + 1e-6))`` as torch does; returns the total norm."""
    parameters = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(parameters, norm_type, pp_group, uncounted)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}: some gradient "
                           "is nan or inf; pass error_if_nonfinite=False to clip anyway")
    coefficient = float(max_norm) / (total.item() + 1e-6)
    if coefficient < 1.0:
        for p in parameters:
            p.grad.mul_(coefficient)  # a Python float: the same scaling for a DTensor and a plain tensor
    return total


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
