"""HF Llama-style decoders (Llama, Qwen2, Qwen3, Mistral; causal LM or base model): tensor parallel over each
decoder layer, pipeline stages for the causal LM, and the planner's analytic counts (``LlamaConfig`` keywords).

Their attention has separate ``q_proj``/``k_proj``/``v_proj`` Linears and reshapes with ``-1`` heads, so torch's own
column/row styles split them by heads with no reordering; with GQA each rank keeps ``num_key_value_heads / tp``
key/value heads and the same group size.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.families.base import (
    Plan,
    Schema,
    block_activations,
    check_heads,
    count,
    has_module,
    keep_blocks,
    per_head_norm,
    with_head_norms,
)
from disttrain.parallel.families.hf import HFFamily
from disttrain.parallel.families.spec import ModelSpec, attention_kind, count_params, transformer_flops_per_token

QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def llama_plan(qk_norm: bool = False) -> Plan:
    """One decoder layer: q/k/v/gate/up column-wise, o/down row-wise (one all-reduce each for attention and MLP).
    ``qk_norm`` (Qwen3): the per-head q/k RMSNorms run on (B, T, heads, head_dim), heads on dim 2."""
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
        **({norm: per_head_norm(2) for norm in QK_NORMS} if qk_norm else {}),
    }


class LlamaStage(nn.Module):
    """Embeddings (first stage), decoder layers [start, end), final norm and LM head (last stage)."""

    def __init__(self, lm: nn.Module, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        base = lm.model
        self.config = base.config
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[str(i)] for i in layer_ids})
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, H)
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # The cache argument is positional: transformers renamed it (past_key_values -> cache) between 5.17 and 5.24.
        mask = create_causal_mask(self.config, hidden, None, None, position_ids=position_ids)
        rotary = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))  # (B, T, vocab)
        return hidden


def _need(mapping: Mapping[str, Any], key: str) -> Any:
    if key not in mapping:
        raise ValueError(f"the Llama config lacks {key!r}; add it to the `model:` mapping")
    return mapping[key]


def llama_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    """A Llama-family decoder (transformers ``LlamaConfig`` keywords; its defaults where a key is absent)."""
    h = int(_need(cfg, "hidden_size"))
    layers = int(_need(cfg, "num_hidden_layers"))
    heads = int(_need(cfg, "num_attention_heads"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    f = int(cfg.get("intermediate_size", 11008))
    vocab = int(cfg.get("vocab_size", 32000))
    if h % heads:
        raise ValueError(f"hidden_size={h} is not a multiple of num_attention_heads={heads}")
    d = int(cfg.get("head_dim") or h // heads)
    bias = 1 if cfg.get("attention_bias", False) else 0
    mlp_bias = 1 if cfg.get("mlp_bias", False) else 0
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + bias * (heads * d + 2 * kv * d + h)
    mlp = 3 * h * f + mlp_bias * (2 * f + h)
    layer = attn + mlp + 2 * h  # two RMSNorm weights
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = vocab * h * (1 if tied else 2) + layers * layer + h
    tokens = int(cfg.get("max_position_embeddings", 2048))
    return ModelSpec("llama", params, layers=layers, layer_params=layer, hidden=h, ffn=f, heads=heads, kv_heads=kv,
                     vocab=vocab, tokens=tokens, attention=attention_kind(cfg.get("attn_implementation")),
                     extra={"tied": tied, "head_dim": d, "tensor_parallel": True, "pipeline": True,
                            "context_parallel": True, "lm_logits": True})


class LlamaFamily(HFFamily):
    name = "llama"
    analytic = True
    model_types = ("llama", "qwen2", "qwen3", "mistral")

    def reads_config(self, mapping: Mapping[str, Any]) -> bool:
        return self.reads_model_type(mapping.get("model_type")) or \
            ("model_type" not in mapping and "hidden_size" in mapping)

    # -- tensor parallel --------------------------------------------------------------------------------------
    def check_tp(self, model: nn.Module, tp: int, plan: Plan) -> None:
        if "self_attn.q_proj" in plan:
            config = model.config
            check_heads(tp, num_attention_heads=config.num_attention_heads,
                        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    def tp_plan(self, model: Optional[nn.Module] = None) -> Plan:
        return llama_plan(qk_norm=model is not None and has_module(model, QK_NORMS[0]))

    def adapt_plan(self, block: nn.Module, plan: Plan) -> Plan:
        return with_head_norms(plan, block, "self_attn.q_proj", QK_NORMS, heads_dim=2)

    # -- pipeline ---------------------------------------------------------------------------------------------
    def _check_pp(self, model: nn.Module) -> None:
        if not (hasattr(model, "model") and isinstance(getattr(model, "lm_head", None), nn.Module)):
            raise ValueError(f"pipeline parallelism splits Llama-family causal LMs (e.g. LlamaForCausalLM, a model"
                             f" that computes its loss from labels), not {type(model).__name__}; use tensor"
                             " parallelism or disttrain_fsdp for it")

    def pipeline_sizes(self, model: nn.Module) -> tuple[list[int], int, int]:
        self._check_pp(model)
        # The embedding is a lookup: its parameters cost memory but no compute.
        return [count(layer) for layer in model.model.layers], 0, count(model.model.norm) + count(model.lm_head)

    def split(self, model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
        self._check_pp(model)
        stages, keep, first, last = keep_blocks(plan, pp_rank)
        base = model.model
        base.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers) if i in keep})
        if not first:
            base.embed_tokens = None
        if not last:
            base.norm = None
            model.lm_head = None
        return [LlamaStage(model, range(*plan.bounds[s]), s == 0, s == plan.num_stages - 1) for s in stages]

    # -- planner ----------------------------------------------------------------------------------------------
    def config_schema(self, mapping: Mapping[str, Any]) -> Schema:
        """``LlamaConfig`` arguments and attributes (those of the config class of ``model_type``, when given)."""
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[mapping.get("model_type") or "llama"]
        # rope_theta is a legacy argument transformers 5 still takes (it moves into rope_parameters).
        arguments = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
        return dict.fromkeys(sorted(set(cls().to_dict()) | arguments | {"rope_theta"}))

    def spec_from_config(self, mapping: Mapping[str, Any]) -> ModelSpec:
        return llama_spec({k: v for k, v in mapping.items() if k != "model_type"})

    def spec_from_hf_config(self, config: Any, module: Optional[nn.Module] = None) -> ModelSpec:
        cfg = config.to_dict()
        cfg.setdefault("attn_implementation", getattr(config, "_attn_implementation", None))
        # exact, whatever the model adds to the Llama layout (Qwen3's q/k norms)
        return replace(llama_spec(cfg), params=count_params(module if module is not None else _meta_lm(config)))

    def spec_from_module(self, module: nn.Module) -> ModelSpec:
        return self.spec_from_hf_config(module.config, module)

    def meta_model(self, mapping: Mapping[str, Any]) -> nn.Module:
        from transformers import AutoConfig

        settings = {k: v for k, v in mapping.items() if k != "model_type"}
        return _meta_lm(AutoConfig.for_model(mapping.get("model_type") or "llama", **settings))

    def activation_bytes(self, spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int,
                         activation_checkpointing: bool, dims: ParallelDims) -> int:
        b, s, t = micro_batch, seq_len, dims.tp
        tokens = s // dims.cp  # context parallelism: each rank computes its share of every sequence (s divides)
        h, f, a, kv = spec.hidden, spec.ffn, spec.heads, spec.kv_heads
        d = spec.extra.get("head_dim", spec.head_dim)
        # Replicated under TP: the two RMSNorms' input, output and 1/rms. Split across TP ranks: q/k/v and their
        # rotary copies, attention output, o_proj input, and the MLP's gate, up, act(gate) and product (4 f). Under
        # context parallelism (all-to-all) a rank holds a/cp heads over all s tokens inside attention: the same bytes
        # as a heads over s/cp tokens, so every term scales with the rank's tokens.
        replicated = 4 * h + 2
        if spec.attention == "sdpa":
            split = 4 * h + 4 * f + 2 * kv * d + a  # a: SDPA's log-sum-exp per head
        else:
            split = 6 * h + 4 * f + a * s  # repeat_kv copies of k and v; the softmax output (a x s per token)
        per_layer = b * tokens * (replicated + split / t) * compute_bytes
        # Outside the blocks: final norm (3h + 1), log-softmax of the logits (V, split by a vocab-parallel head),
        # token ids and labels (int64), and the rotary cos/sin of the whole sequence (2 s d).
        base = b * tokens * ((3 * h + 1) * compute_bytes + spec.vocab / t * 4 + 16) + 2 * s * d * 4
        return block_activations(spec, b, tokens, compute_bytes, per_layer, base, activation_checkpointing)

    def flops_per_sample(self, spec: ModelSpec, seq_len: int) -> float:
        no_embedding = spec.params - spec.vocab * spec.hidden
        return transformer_flops_per_token(no_embedding, spec.layers, spec.hidden, seq_len) * seq_len


def _meta_lm(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


LLAMA = LlamaFamily()
