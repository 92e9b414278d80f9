"""What the planner knows of a model (:class:`ModelSpec`), as the family modules and the planner build it, and the
counts they share."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """The structure of a model, as far as memory and communication go.

    ``params`` counts every parameter; ``layer_params`` one repeated block (0 when the model has none);
    ``root_params`` what is outside the blocks (embeddings, head, final norm): FSDP's root unit. ``tokens`` is the
    sequence length of one sample (ViT: patches + class token), ``hidden``/``ffn``/``heads``/``kv_heads`` the
    block's widths. DeepFM keeps its tables (rows per table) apart from the dense part (``dense_params``).
    ``attention`` is "sdpa" (stores no seq x seq scores) or "eager" (stores the softmax output).
    ``family`` names the :mod:`disttrain.parallel.families` family whose formulas count it, or says what was
    measured (an HF ``model_type``, "timm ResNet", "module"). ``extra["activations"]`` (models outside the analytic
    families): the model measured on the meta device; ``extra["tensor_parallel"]``/``extra["pipeline"]``: whether
    disttrain_megatron can split it.
    """

    family: str
    params: int
    layers: int = 0
    layer_params: int = 0
    hidden: int = 0
    ffn: int = 0
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    tokens: int = 0
    attention: str = "sdpa"
    image_size: int = 0
    in_chans: int = 3
    num_classes: int = 0
    embedding_dim: int = 0
    table_rows: tuple[int, ...] = ()
    dense_params: int = 0
    dense_in_features: int = 0
    mlp_widths: tuple[int, ...] = ()  # DeepFM: bottom and deep MLP widths (their activations)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def root_params(self) -> int:
        return max(0, self.params - self.layers * self.layer_params)  # blocks of unequal size: the largest counted

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.heads else 0

    @property
    def table_params(self) -> int:
        return sum(self.table_rows) * self.embedding_dim

    @property
    def largest_unit(self) -> int:
        """Parameters of the largest FSDP unit: a block, the root, or (DeepFM) the largest table."""
        table = max(self.table_rows, default=0) * self.embedding_dim
        return max(self.layer_params, self.root_params if self.layers else 0, table) or self.params

    def with_tokens(self, tokens: int) -> ModelSpec:
        return replace(self, tokens=tokens)


def count_params(module: nn.Module) -> int:
    """Parameters of ``module`` (DeepSpeed-partitioned ones by their full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def attention_kind(impl: Any) -> str:
    """``ModelSpec.attention`` of an attention implementation name: "eager" stores the softmax output."""
    return "eager" if impl == "eager" else "sdpa"


def transformer_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int,
                                causal: bool = False) -> float:
    """Training FLOPs (forward + backward) per token of a decoder transformer: ``6 * n_params + 12 * n_layers *
    hidden * seq_len`` (PaLM, Chowdhery et al. 2022, appendix B: "6N + 12LHQT").

    ``6N``: every parameter does one multiply-add (2 FLOPs) per token forward and two backward. The second term is
    the attention scores and the weighted sum (``Q K^T`` and ``A V``: 2 matmuls x 2 FLOPs x ``seq_len x hidden``
    per token forward, x3 with backward), which ``N`` does not see. ``n_params`` should leave out the input
    embedding (a lookup, not a matmul); ``hidden`` is the attention width, heads x head dim. The default counts the
    whole score matrix, the convention of PaLM, Megatron-LM and torchtitan, so MFUs compare with published ones;
    ``causal=True`` counts only the unmasked half, what a causal FlashAttention kernel computes.
    """
    attention = 12 * n_layers * hidden * seq_len
    return 6 * n_params + (attention / 2 if causal else attention)
