"""Tensor parallelism (Megatron-style head/MLP split) written as plans: dicts from a block's module path to a
``torch.distributed.tensor.parallel`` style, applied to every block of the model.

Plans exist for the HF Llama family (Llama, Qwen2, Mistral) and timm's VisionTransformer; a user can pass their
own plan (paths relative to one block). Embeddings, norms and the output head stay replicated over the
tensor-parallel group (FSDP shards them over the data-parallel one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from disttrain.parallel.blocks import BlockSpec, find_blocks

Plan = dict[str, ParallelStyle]

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")


def llama_plan() -> Plan:
    """One HF Llama-family decoder layer: q/k/v/gate/up column-wise, o/down row-wise (one all-reduce each for
    attention and MLP). HF's attention reshapes with ``-1`` heads, so each rank runs its own heads unchanged;
    with GQA each rank keeps ``num_key_value_heads / tp`` key/value heads and the same group size."""
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def vit_plan() -> Plan:
    """One timm ViT block. ``attn.qkv`` is one fused Linear whose rows are [q heads | k heads | v heads]; its rows
    are reordered first (:func:`qkv_rank_major`) so that the column-wise split gives each rank q, k and v of its
    own heads."""
    return {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sizes(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:-1]) + (" or " if len(values) > 1 else "") + str(values[-1])


def check_heads(tp: int, **counts: int) -> None:
    """``check_heads(2, num_heads=12)``: every head count must be divisible by the tensor-parallel size."""
    for name, count in counts.items():
        if count % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={count}; choose"
                             f" {_sizes(divisors(math.gcd(*counts.values())))}")


def model_family(model: nn.Module) -> str | None:
    """'llama' for an HF Llama-family causal LM or base model, 'vit' for a timm VisionTransformer, else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in LLAMA_FAMILY:
        return "llama"
    if type(model).__name__ == "VisionTransformer" and type(model).__module__.startswith("timm."):
        return "vit"
    return None


def find_model(root: nn.Module, family: str | None = None) -> tuple[str, nn.Module] | None:
    """The outermost submodule of ``root`` (itself included) that belongs to a known family: ``(path, module)``."""
    for name, module in root.named_modules():
        found = model_family(module)
        if found and (family is None or found == family):
            return name, module
    return None


def qkv_rank_major(dim: int, tp: int) -> torch.Tensor:
    """Row order for a fused [q | k | v] weight of ``3 * dim`` rows such that chunk r of ``tp`` equal chunks holds
    [q_r | k_r | v_r], rank r's heads of each. Its inverse restores timm's layout (``argsort``)."""
    part = dim // tp
    return torch.cat([torch.arange(p * dim + r * part, p * dim + (r + 1) * part)
                      for r in range(tp) for p in range(3)])


@dataclass
class TPResult:
    """What :func:`apply_tp` changed beyond sharding: fused weights whose rows were reordered (path -> row order),
    needed to give exports the model's own layout back."""

    reordered: dict[str, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def _reorder_vit_qkv(block: nn.Module, tp: int) -> torch.Tensor:
    attn = block.attn
    if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
        raise ValueError("tensor parallel ViT attention with scale_norm=True is not supported (its norm spans all"
                         " heads); build the model with scale_norm=False")
    order = qkv_rank_major(attn.attn_dim, tp)
    attn.qkv.weight.data = attn.qkv.weight.data[order]
    if attn.qkv.bias is not None:
        attn.qkv.bias.data = attn.qkv.bias.data[order]
    # timm reshapes with self.num_heads and self.attn_dim: each rank now runs 1/tp of the heads.
    attn.num_heads //= tp
    attn.attn_dim //= tp
    return order


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan | None = None,
             wrap_classes: BlockSpec = None) -> TPResult:
    """Shard every block of ``model`` over ``tp_mesh`` with ``plan`` (paths relative to one block). Without a plan,
    the Llama or ViT plan is picked from the model; anything else needs a plan."""
    tp = tp_mesh.size()
    result = TPResult()
    found = find_model(model)
    family = model_family(found[1]) if found else None
    if plan is None:
        if family is None:
            raise ValueError(f"no tensor-parallel plan for {type(model).__name__}: built-in plans cover the HF Llama"
                             " family and timm's VisionTransformer; pass tp_plan={'block.path': ColwiseParallel(),"
                             " ...} with paths relative to one block")
        plan = llama_plan() if family == "llama" else vit_plan()
        inner = found[1]
        if family == "llama":
            config = inner.config
            check_heads(tp, num_attention_heads=config.num_attention_heads,
                        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        else:
            check_heads(tp, num_heads=inner.blocks[0].attn.num_heads)
    blocks = find_blocks(model, wrap_classes)
    prefix = {id(m): n for n, m in model.named_modules()}
    for block in blocks:
        missing = [path for path in plan if not _has(block, path)]
        if missing:
            raise ValueError(f"tp_plan paths {missing} do not exist in block {type(block).__name__}; paths are"
                             f" relative to one block, e.g. {[n for n, _ in block.named_modules() if n][:6]}")
        if family == "vit" and "attn.qkv" in plan:  # a naive column split of the fused qkv would mix heads
            result.reordered[f"{prefix[id(block)]}.attn.qkv"] = _reorder_vit_qkv(block, tp)
        parallelize_module(block, tp_mesh, plan)
    return result


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def restore_rows(state: dict[str, torch.Tensor], reordered: dict[str, torch.Tensor],
                 prefix: str = "") -> dict[str, torch.Tensor]:
    """Undo :func:`qkv_rank_major` in a full state dict, so exports have the model's own layout."""
    for path, order in reordered.items():
        inverse = torch.argsort(order)
        for suffix in ("weight", "bias"):
            key = f"{prefix}{path}.{suffix}"
            if key in state:
                state[key] = state[key][inverse]
    return state
