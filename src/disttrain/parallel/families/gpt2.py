"""HF GPT-2 (``GPT2LMHeadModel``, ``GPT2Model`` and its other heads): tensor parallel over HF's ``Conv1D``, the
fused ``c_attn`` split per head, and pipeline stages for the causal LM.

GPT-2's projections are ``transformers.pytorch_utils.Conv1D``: a Linear whose weight is stored transposed,
``[in_features, out_features]``. Torch's Colwise/RowwiseParallel only take ``nn.Linear``; the styles below shard
Conv1D's weight along its own output/input dimension instead, so parameters, checkpoints and exports keep GPT-2's
layout (no transposed copy to undo anywhere).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from disttrain.parallel.families.base import Plan, check_heads, count, keep_blocks
from disttrain.parallel.families.hf import HFFamily
from disttrain.parallel.families.layout import Reorder, qkv_rank_major


def is_conv1d(module: nn.Module) -> bool:
    """An HF ``Conv1D`` (checked without importing transformers: no model can hold one before it is imported)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def _shard_params(placements: dict[str, Any], src_data_rank: int | None, name: str, module: nn.Module,
                  mesh: Any) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [placements[pname]], src_data_rank=src_data_rank)
        module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))


class Conv1DColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` that also takes HF's ``Conv1D``: its weight ``[in, out]`` is sharded on dim 1 (the
    output features), its bias on dim 0. ``nn.Linear`` and ``nn.Embedding`` are handled as torch does."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, partial(_shard_params, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` that also takes HF's ``Conv1D``: its weight ``[in, out]`` is sharded on dim 0 (the input
    features), its bias replicated (added once, after the partial sums are reduced)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, partial(_shard_params, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def conv1d_aware(block: nn.Module, plan: Plan) -> Plan:
    """``plan`` with torch's plain Colwise/RowwiseParallel on a ``Conv1D`` replaced by the Conv1D-aware styles (the
    same layouts), so a user's plan written with torch's styles works on GPT-2."""
    out = dict(plan)
    for path, style in plan.items():
        if type(style) not in (ColwiseParallel, RowwiseParallel) or not is_conv1d(block.get_submodule(path)):
            continue
        cls = Conv1DColwiseParallel if type(style) is ColwiseParallel else Conv1DRowwiseParallel
        out[path] = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                        use_local_output=style.use_local_output)
    return out


class GPT2Stage(nn.Module):
    """Token and position embeddings (first stage), blocks [start, end), final norm and LM head (last stage)."""

    def __init__(self, lm: nn.Module, block_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        base = lm.transformer
        self.config = base.config
        self.wte = base.wte if first else None
        self.wpe = base.wpe if first else None
        self.drop = base.drop if first else None
        self.layers = nn.ModuleDict({str(i): base.h[str(i)] for i in block_ids})
        self.ln_f = base.ln_f if last else None
        self.lm_head = lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        hidden = self.drop(self.wte(x) + self.wpe(position_ids)) if self.wte is not None else x  # (B, T, H)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        for block in self.layers.values():
            hidden = block(hidden, None, mask, None, use_cache=False, position_ids=position_ids)
        if self.lm_head is not None:
            hidden = self.lm_head(self.ln_f(hidden))  # (B, T, vocab)
        return hidden


class GPT2Family(HFFamily):
    name = "gpt2"
    model_types = ("gpt2",)

    def check_tp(self, model: nn.Module, tp: int, plan: Plan) -> None:
        config = model.config
        if getattr(config, "add_cross_attention", False):
            raise ValueError("tensor parallel GPT-2 with add_cross_attention=True is not supported (its cross-"
                             "attention projects encoder states of another width); build it without cross-attention"
                             " or train it with disttrain_fsdp")
        inner = config.n_inner or 4 * config.n_embd
        check_heads(tp, n_head=config.n_head)
        if inner % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP width n_inner={inner}")

    def tp_plan(self, model: nn.Module | None = None) -> Plan:
        """One GPT-2 block: the fused ``attn.c_attn`` and ``mlp.c_fc`` column-wise, both ``c_proj`` row-wise."""
        return {
            "attn.c_attn": Conv1DColwiseParallel(),
            "attn.c_proj": Conv1DRowwiseParallel(),
            "mlp.c_fc": Conv1DColwiseParallel(),
            "mlp.c_proj": Conv1DRowwiseParallel(),
        }

    def adapt_plan(self, block: nn.Module, plan: Plan) -> Plan:
        return conv1d_aware(block, plan)

    @torch.no_grad()
    def prepare_block(self, block: nn.Module, tp: int, plan: Plan) -> dict[str, Reorder]:
        """``c_attn``'s output columns are [q heads | k heads | v heads]; reorder them rank-major so the column split
        gives each rank q, k and v of its own heads, and let the attention split its local third."""
        if "attn.c_attn" not in plan:
            return {}
        attn = block.attn
        order = qkv_rank_major(attn.embed_dim, tp)
        attn.c_attn.weight.data = attn.c_attn.weight.data[:, order]  # Conv1D: [in, out], the columns are outputs
        attn.c_attn.bias.data = attn.c_attn.bias.data[order]
        # GPT-2 splits c_attn's output with split_size (= embed_dim) and reshapes with -1 heads.
        attn.split_size = attn.embed_dim // tp
        attn.num_heads //= tp
        return {"attn.c_attn": Reorder(order, weight_dim=1)}

    # -- pipeline ---------------------------------------------------------------------------------------------
    def _check_pp(self, model: nn.Module) -> None:
        if not (hasattr(model, "transformer") and isinstance(getattr(model, "lm_head", None), nn.Module)):
            raise ValueError(f"pipeline parallelism splits GPT2LMHeadModel (a causal LM that computes its loss from"
                             f" labels), not {type(model).__name__}; use tensor parallelism or disttrain_fsdp for it")

    def pipeline_sizes(self, model: nn.Module) -> tuple[list[int], int, int]:
        self._check_pp(model)
        base = model.transformer
        # The embeddings are lookups: their parameters cost memory but no compute.
        return [count(b) for b in base.h], 0, count(base.ln_f) + count(model.lm_head)

    def split(self, model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
        self._check_pp(model)
        stages, keep, first, last = keep_blocks(plan, pp_rank)
        base = model.transformer
        base.h = nn.ModuleDict({str(i): block for i, block in enumerate(base.h) if i in keep})
        if not first:
            base.wte = base.wpe = None
        if not last:
            base.ln_f = None
            model.lm_head = None
        return [GPT2Stage(model, range(*plan.bounds[s]), s == 0, s == plan.num_stages - 1) for s in stages]

    # -- planner ----------------------------------------------------------------------------------------------
    def widths(self, config: Any) -> dict[str, int]:
        h = config.n_embd
        return {"hidden": h, "heads": config.n_head, "kv_heads": config.n_head, "ffn": config.n_inner or 4 * h,
                "layers": config.n_layer, "vocab": config.vocab_size, "tokens": config.n_positions}


GPT2 = GPT2Family()
