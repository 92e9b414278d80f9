"""Model families: one module each holds what disttrain knows about a family (how to recognise it, its
tensor-parallel plan and fused-weight layout, its pipeline stages, its widths for the planner).

``family_of(model)`` finds the family of a model; :class:`Family` is what each module provides. The HF Llama family
and timm's VisionTransformer are handled in ``tp.py``/``pipeline.py`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

Plan = dict[str, ParallelStyle]


@dataclass(frozen=True)
class Reorder:
    """A fused weight whose slices were permuted for tensor parallelism: ``order`` applies along ``weight_dim`` of
    the weight (and along dim 0 of the bias); ``argsort(order)`` gives the library's own layout back."""

    order: torch.Tensor
    weight_dim: int = 0


class Family:
    """One model family. Subclasses set ``name`` and ``model_types`` (HF ``config.model_type`` values) and override
    what the family supports; the defaults refuse with a message naming the family."""

    name = ""
    model_types: tuple[str, ...] = ()
    # The model computes its own loss from ``labels`` (``model(input_ids=..., labels=...).loss``), which is the
    # contract the pipeline keeps.
    hf_loss = True

    # -- recognising ------------------------------------------------------------------------------------------
    def matches(self, model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        return getattr(config, "model_type", None) in self.model_types and self.is_whole_model(model)

    def is_whole_model(self, model: nn.Module) -> bool:
        """True for the family's models themselves (an HF ``PreTrainedModel``, base or with a head), not for their
        submodules (HF attention modules keep the config too)."""
        return hasattr(model, "base_model_prefix")

    # -- tensor parallel --------------------------------------------------------------------------------------
    def check_tp(self, model: nn.Module, tp: int) -> None:
        """Raise when ``model`` cannot be split ``tp`` ways (head counts, unsupported options)."""

    def tp_plan(self) -> Plan:
        raise ValueError(f"no tensor-parallel plan for the {self.name} family")

    def adapt_plan(self, block: nn.Module, plan: Plan) -> Plan:
        """The plan as it applies to this family's modules (e.g. styles for layers torch's styles do not know)."""
        return plan

    def prepare_block(self, block: nn.Module, tp: int, plan: Plan) -> dict[str, Reorder]:
        """Changes one block needs before ``parallelize_module`` (fused weights reordered so each rank holds its
        own heads, head counts divided); returns the reordered weights by path relative to the block."""
        return {}

    # -- pipeline parallel ------------------------------------------------------------------------------------
    def pipeline_sizes(self, model: nn.Module) -> tuple[list[int], int, int]:
        """Parameters per block, of the first stage's embeddings and of the last stage's head."""
        raise ValueError(f"pipeline parallelism does not split {type(model).__name__} ({self.name} family)")

    def split(self, model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
        """Prune ``model`` in place to the stages of ``pp_rank`` (a ``pipeline.StagePlan``) and return their stage
        modules in stage order; they hold references to the model's own submodules."""
        raise ValueError(f"pipeline parallelism does not split {type(model).__name__} ({self.name} family)")

    def loss(self, model: nn.Module, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss the model itself computes from ``labels`` (on the last stage's output)."""
        raise NotImplementedError

    def wrap_output(self, loss: Optional[torch.Tensor], output: Optional[torch.Tensor]) -> Any:
        """What the pipelined ``model(...)`` returns: the HF output class the model returns."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=output)

    # -- planner ----------------------------------------------------------------------------------------------
    def widths(self, config: Any) -> dict[str, int]:
        """``hidden``, ``heads``, ``kv_heads``, ``ffn``, ``layers``, ``vocab``, ``tokens`` from an HF config."""
        return {}


def registered() -> tuple[Family, ...]:
    """Every family module's :class:`Family` (imported on first use: the modules import ``tp``, which imports
    this package)."""
    from disttrain.parallel.families.bert import BERT
    from disttrain.parallel.families.gpt2 import GPT2

    return (GPT2, BERT)


def family_of(model: nn.Module) -> Optional[Family]:
    """The :class:`Family` of ``model`` itself (not of a submodule), or None."""
    for family in registered():
        if family.matches(model):
            return family
    return None


def family_named(name: str) -> Optional[Family]:
    return next((f for f in registered() if f.name == name), None)


def family_for_model_type(model_type: Optional[str]) -> Optional[Family]:
    return next((f for f in registered() if model_type in f.model_types), None)


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why tensor/pipeline parallelism refuses a model found inside ``model`` (encoder-decoders), or None."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            where = f" (at {name!r})" if name else ""
            return (f"{type(module).__name__}{where} is an encoder-decoder model ({config.model_type}): tensor and"
                    " pipeline parallelism split decoder-only and encoder-only stacks, not an encoder and a decoder"
                    " with cross-attention; train it with disttrain_fsdp or disttrain_zero3")
    return None
