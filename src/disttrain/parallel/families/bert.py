"""BERT-style encoders from HF (BERT, RoBERTa, XLM-RoBERTa, CamemBERT; base model or with a head): tensor
parallel over each ``BertLayer``-shaped block, and pipeline stages for sequence classification.

Their attention has separate ``query``/``key``/``value`` Linears and reshapes with ``-1`` heads, so torch's own
column/row styles split them by heads with no reordering.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from disttrain.parallel.families.base import Plan, check_heads, count, keep_blocks
from disttrain.parallel.families.hf import HFFamily
from disttrain.parallel.families.layout import Reorder


class EncoderStage(nn.Module):
    """Embeddings (first stage), layers [start, end), and the classification head (last stage: BERT's pooler,
    dropout and classifier, or RoBERTa's classification head on the sequence)."""

    def __init__(self, model: nn.Module, block_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        base = getattr(model, model.base_model_prefix)
        self.embeddings = base.embeddings if first else None
        self.layers = nn.ModuleDict({str(i): base.encoder.layer[str(i)] for i in block_ids})
        self.pooler = base.pooler if last else None
        self.dropout = getattr(model, "dropout", None) if last else None
        self.classifier = model.classifier if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids=x) if self.embeddings is not None else x  # (B, T, H)
        for layer in self.layers.values():
            hidden = layer(hidden, None)  # no padding mask: every token attends to every token
        if self.classifier is not None:
            if self.pooler is not None:  # BERT: tanh-pooled first token, dropout, Linear
                hidden = self.classifier(self.dropout(self.pooler(hidden)))
            else:  # RoBERTa: its head takes the sequence and picks the first token itself
                hidden = self.classifier(hidden)
        return hidden  # (B, labels) on the last stage


class BertFamily(HFFamily):
    name = "bert"
    model_types = ("bert", "roberta", "xlm-roberta", "camembert")

    def check_tp(self, model: nn.Module, tp: int, plan: Plan) -> None:
        config = model.config
        if getattr(config, "add_cross_attention", False):
            raise ValueError(f"tensor parallel {type(model).__name__} with add_cross_attention=True is not supported;"
                             " build it without cross-attention or train it with disttrain_fsdp")
        check_heads(tp, num_attention_heads=config.num_attention_heads)
        if config.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size="
                             f"{config.intermediate_size}")

    def tp_plan(self, model: Optional[nn.Module] = None) -> Plan:
        """One encoder layer: query/key/value and the MLP's first Linear column-wise, the attention output and the
        MLP's second Linear row-wise (one all-reduce each for attention and MLP; LayerNorms stay whole)."""
        return {
            "attention.self.query": ColwiseParallel(),
            "attention.self.key": ColwiseParallel(),
            "attention.self.value": ColwiseParallel(),
            "attention.output.dense": RowwiseParallel(),
            "intermediate.dense": ColwiseParallel(),
            "output.dense": RowwiseParallel(),
        }

    def prepare_block(self, block: nn.Module, tp: int, plan: Plan) -> dict[str, Reorder]:
        attention = getattr(getattr(block, "attention", None), "self", None)
        if attention is not None and "attention.self.query" in plan:  # the count HF keeps for its own bookkeeping
            attention.num_attention_heads //= tp
            attention.all_head_size //= tp
        return {}

    # -- pipeline: sequence classification --------------------------------------------------------------------
    def _check_pp(self, model: nn.Module) -> None:
        if not (type(model).__name__.endswith("ForSequenceClassification") and hasattr(model, "classifier")):
            raise ValueError(f"pipeline parallelism splits {self.name}-style encoders for sequence classification"
                             f" (e.g. BertForSequenceClassification), not {type(model).__name__}; use tensor"
                             " parallelism or disttrain_fsdp for it")
        if getattr(model.config, "is_decoder", False):
            raise ValueError(f"pipeline parallelism splits {type(model).__name__} as an encoder; build it with"
                             " is_decoder=False")

    def pipeline_sizes(self, model: nn.Module) -> tuple[list[int], int, int]:
        self._check_pp(model)
        base = getattr(model, model.base_model_prefix)
        head = count(base.pooler) + count(model.classifier)
        return [count(layer) for layer in base.encoder.layer], 0, head

    def split(self, model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
        self._check_pp(model)
        stages, keep, first, last = keep_blocks(plan, pp_rank)
        base = getattr(model, model.base_model_prefix)
        base.encoder.layer = nn.ModuleDict({str(i): l for i, l in enumerate(base.encoder.layer) if i in keep})
        if not first:
            base.embeddings = None
        if not last:
            base.pooler = None
            model.classifier = None
        return [EncoderStage(model, range(*plan.bounds[s]), s == 0, s == plan.num_stages - 1) for s in stages]

    def loss(self, model: nn.Module, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """HF's sequence-classification loss: regression (MSE) for one label, cross-entropy for integer labels,
        BCE-with-logits otherwise (or as ``config.problem_type`` says)."""
        config, n = model.config, model.config.num_labels
        problem = config.problem_type or ("regression" if n == 1 else "single_label_classification"
                                          if labels.dtype in (torch.long, torch.int) else "multi_label_classification")
        if problem == "regression":
            return F.mse_loss(output.squeeze(), labels.squeeze()) if n == 1 else F.mse_loss(output, labels)
        if problem == "single_label_classification":
            return F.cross_entropy(output.view(-1, n), labels.view(-1))
        return F.binary_cross_entropy_with_logits(output, labels)

    def wrap_output(self, loss: Optional[torch.Tensor], output: Optional[torch.Tensor]) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(loss=loss, logits=output)

    # -- planner ----------------------------------------------------------------------------------------------
    def widths(self, config: Any) -> dict[str, int]:
        return {"hidden": config.hidden_size, "heads": config.num_attention_heads,
                "kv_heads": config.num_attention_heads, "ffn": config.intermediate_size,
                "layers": config.num_hidden_layers, "vocab": config.vocab_size,
                "tokens": config.max_position_embeddings}


BERT = BertFamily()
