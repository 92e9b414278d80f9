"""Tensor parallelism (Megatron-style head/MLP split) written as plans: dicts from a block's module path to a
``torch.distributed.tensor.parallel`` style, applied to every block of the model.

Plans exist for the HF Llama family (Llama, Qwen2, Qwen3, Mistral), timm's VisionTransformer, and the families in
:mod:`disttrain.parallel.families` (HF GPT-2, BERT-style encoders); a user can pass their own plan (paths relative
to one repeated block: it applies to the blocks that contain them). Embeddings, norms and the output head stay
replicated over the tensor-parallel group (FSDP shards them over the data-parallel one). Encoder-decoder models
(T5, BART) are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from disttrain.parallel.blocks import BlockSpec, find_blocks
from disttrain.parallel.families import family_named, family_of, unsupported_reason

Plan = dict[str, ParallelStyle]

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")


def per_head_norm(heads_dim: int) -> ParallelStyle:
    """A norm over each head's features (Qwen3's and timm's q/k norm) inside the split attention: its parameters
    are replicated DTensors and its input is marked sharded along the heads dimension, so their gradients, which
    each rank computes from its own heads only, are summed over the tensor-parallel ranks in backward (a plain
    replicated norm would drift apart on every rank). torch's ``SequenceParallel`` does exactly that for any
    dimension."""
    return SequenceParallel(sequence_dim=heads_dim, use_local_output=True)


def llama_plan(qk_norm: bool = False) -> Plan:
    """One HF Llama-family decoder layer: q/k/v/gate/up column-wise, o/down row-wise (one all-reduce each for
    attention and MLP). HF's attention reshapes with ``-1`` heads, so each rank runs its own heads unchanged;
    with GQA each rank keeps ``num_key_value_heads / tp`` key/value heads and the same group size. ``qk_norm``
    (Qwen3): the per-head q/k RMSNorms run on (B, T, heads, head_dim), heads on dim 2."""
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
        **({"self_attn.q_norm": per_head_norm(2), "self_attn.k_norm": per_head_norm(2)} if qk_norm else {}),
    }


def vit_plan(qk_norm: bool = False) -> Plan:
    """One timm ViT block. ``attn.qkv`` is one fused Linear whose rows are [q heads | k heads | v heads]; its rows
    are reordered first (:func:`qkv_rank_major`) so that the column-wise split gives each rank q, k and v of its
    own heads. ``qk_norm=True`` models: the per-head q/k norms run on (B, heads, N, head_dim), heads on dim 1."""
    return {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
        **({"attn.q_norm": per_head_norm(1), "attn.k_norm": per_head_norm(1)} if qk_norm else {}),
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
    """'llama' for an HF Llama-family causal LM or base model, 'vit' for a timm VisionTransformer, the name of a
    :mod:`disttrain.parallel.families` family (``"gpt2"``, ``"bert"``), else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in LLAMA_FAMILY:
        return "llama"
    if type(model).__name__ == "VisionTransformer" and type(model).__module__.startswith("timm."):
        return "vit"
    family = family_of(model)
    return family.name if family is not None else None


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
    """What :func:`apply_tp` changed beyond sharding: fused weights whose rows were reordered (path -> order),
    needed to give exports the model's own layout back. ``weight_dims``: the weight dimension an order applies to
    where it is not 0 (HF Conv1D stores its output features on dim 1); biases are always reordered on dim 0."""

    reordered: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_dims: dict[str, int] = field(default_factory=dict)


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
    """Shard every block of ``model`` over ``tp_mesh`` with ``plan`` (paths relative to one repeated block; it is
    applied to the blocks that contain them). Without a plan, the plan of the model's family is used; anything
    else needs a plan. Encoder-decoder models are refused."""
    tp = tp_mesh.size()
    result = TPResult()
    found = find_model(model)
    family = model_family(found[1]) if found else None
    other = family_named(family) if family else None
    if found is None and (reason := unsupported_reason(model)):
        raise ValueError(f"tensor parallelism: {reason}")
    if plan is None:
        if family is None:
            raise ValueError(f"no tensor-parallel plan for {type(model).__name__}: built-in plans cover the HF Llama"
                             " family, GPT-2, BERT-style encoders and timm's VisionTransformer; pass tp_plan="
                             "{'block.path': ColwiseParallel(), ...} with paths relative to one repeated block")
        inner = found[1]
        if family == "llama":
            plan = llama_plan(qk_norm=_has_module(inner, "self_attn.q_norm"))
            config = inner.config
            check_heads(tp, num_attention_heads=config.num_attention_heads,
                        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        elif family == "vit":
            plan = vit_plan(qk_norm=_has_module(inner, "attn.q_norm"))
            check_heads(tp, num_heads=inner.blocks[0].attn.num_heads)
        else:
            plan = other.tp_plan()
    elif family in ("llama", "vit"):
        plan = _with_head_norms(plan, family, found[1])
    if other is not None:
        other.check_tp(found[1], tp)
    prefix = {id(m): n for n, m in model.named_modules()}
    for block in plan_blocks(model, plan, wrap_classes):
        if family == "vit" and "attn.qkv" in plan:  # a naive column split of the fused qkv would mix heads
            result.reordered[f"{prefix[id(block)]}.attn.qkv"] = _reorder_vit_qkv(block, tp)
        block_plan = plan
        if other is not None:
            block_plan = other.adapt_plan(block, plan)
            _record(result, prefix[id(block)], other.prepare_block(block, tp, block_plan))
        parallelize_module(block, tp_mesh, block_plan)
    return result


def _with_head_norms(plan: Plan, family: str, model: nn.Module) -> Plan:
    """A user's plan that splits the heads of a model with per-head q/k norms keeps those norms' gradients summed
    over the tensor-parallel ranks too (without them each rank's copy would drift)."""
    split, norms, dim = ("self_attn.q_proj", ("self_attn.q_norm", "self_attn.k_norm"), 2) if family == "llama" else \
        ("attn.qkv", ("attn.q_norm", "attn.k_norm"), 1)
    if split not in plan or not _has_module(model, norms[0]):
        return plan
    return {**{norm: per_head_norm(dim) for norm in norms}, **plan}


def _has_module(model: nn.Module, suffix: str) -> bool:
    """Whether some submodule's path ends with ``suffix`` and it does something (timm puts ``nn.Identity`` where
    an option is off)."""
    return any(name.endswith(suffix) and not isinstance(m, nn.Identity) for name, m in model.named_modules())


def _record(result: TPResult, block_path: str, reorders: dict) -> None:
    for path, reorder in reorders.items():
        result.reordered[f"{block_path}.{path}"] = reorder.order
        if reorder.weight_dim:
            result.weight_dims[f"{block_path}.{path}"] = reorder.weight_dim


def plan_blocks(model: nn.Module, plan: Plan, wrap_classes: BlockSpec = None) -> list[nn.Module]:
    """The blocks a plan applies to: of the blocks found (``find_blocks``), those in which every path of the plan
    exists (an HF encoder's blocks include its embeddings, where a layer's paths do not exist)."""
    blocks = find_blocks(model, wrap_classes)
    chosen = [b for b in blocks if all(_has(b, path) for path in plan)]
    if not chosen:
        by_class: dict[str, nn.Module] = {}
        for block in blocks:
            by_class.setdefault(type(block).__name__, block)
        examples = "; ".join(f"{name}: {[n for n, _ in block.named_modules() if n][:6]}"
                             for name, block in by_class.items())
        raise ValueError(f"tp_plan paths {sorted(plan)} do not all exist in any block of {type(model).__name__};"
                         f" paths are relative to one repeated block ({examples or 'no blocks found'})")
    return chosen


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def restore_rows(state: dict[str, torch.Tensor], reordered: dict[str, torch.Tensor],
                 prefix: str = "", weight_dims: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Undo :func:`qkv_rank_major` in a full state dict, so exports have the model's own layout. ``weight_dims``
    (``TPResult.weight_dims``) names weights reordered along another dimension than 0."""
    for path, order in reordered.items():
        inverse = torch.argsort(order)
        for suffix in ("weight", "bias"):
            key = f"{prefix}{path}.{suffix}"
            if key in state:
                dim = (weight_dims or {}).get(path, 0) if suffix == "weight" else 0
                state[key] = state[key].index_select(dim, inverse)
    return state
