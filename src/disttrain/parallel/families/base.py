"""What every family module builds on: the :class:`Family` interface (with refusing defaults), the export formats,
and the helpers several families share (head-count checks, per-head norms under TP, parameter counts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from disttrain.parallel.families.layout import Reorder
from disttrain.parallel.families.spec import ModelSpec
from disttrain.parallel.mesh import ParallelDims, divisors

Plan = dict[str, ParallelStyle]
# A schema of config keys (see :mod:`disttrain.config`): key -> None (any value) or the schema below it.
Schema = Mapping[str, Optional["Schema"]]


@dataclass(frozen=True)
class ExportFormat:
    """A format ``disttrain export --to NAME`` writes. ``write(state, output, checkpoint, config)`` writes the full
    state dict ``state`` (the model's own key names) to ``output`` and returns what it wrote; ``checkpoint`` is the
    folder it came from and ``config`` the ``--config`` value (formats without a config ignore both)."""

    name: str
    write: Callable[[Mapping[str, torch.Tensor], Path, Path, Any], Path]


def _write_torch(state: Mapping[str, torch.Tensor], output: Path, checkpoint: Path, config: Any) -> Path:
    from disttrain.parallel.checkpoint.io import save_full

    return save_full(output, {k: v.contiguous() for k, v in state.items()})


def _write_safetensors(state: Mapping[str, torch.Tensor], output: Path, checkpoint: Path, config: Any) -> Path:
    from disttrain.parallel.checkpoint.io import write_safetensors

    write_safetensors(state, output)
    return output


# Library-neutral formats: a ``model.load_state_dict(torch.load(OUT, weights_only=True))`` file, one safetensors file.
TORCH_EXPORT = ExportFormat("torch", _write_torch)
SAFETENSORS_EXPORT = ExportFormat("safetensors", _write_safetensors)


class Family:
    """One model family. A subclass sets ``name`` and overrides what the family supports; the defaults refuse
    with a message naming the family (or, for the planner hooks, return None: "measure the model instead")."""

    name = ""
    # The model computes its own loss from ``labels`` (``model(input_ids=..., labels=...).loss``), which is the
    # contract the pipeline keeps; otherwise the loss function comes from the caller.
    hf_loss = False
    # What ``disttrain export --to`` gives this family's library its model in.
    export_format: ExportFormat = TORCH_EXPORT
    # The planner counts the family's models by its formulas (``activation_bytes``, ``flops_per_sample``); other
    # families' models are measured on the meta device.
    analytic = False

    # -- recognising ------------------------------------------------------------------------------------------
    def matches(self, model: nn.Module) -> bool:
        """True for the family's models themselves, not for their submodules."""
        return False

    def reads_config(self, mapping: Mapping[str, Any]) -> bool:
        """True when ``mapping`` (a recipe's ``model:`` section) describes this family's model."""
        return False

    def reads_model_type(self, model_type: Optional[str]) -> bool:
        """True when an HF config of ``model_type`` builds this family's model."""
        return False

    # -- tensor parallel --------------------------------------------------------------------------------------
    def check_tp(self, model: nn.Module, tp: int, plan: Plan) -> None:
        """Raise when ``model`` cannot be split ``tp`` ways with ``plan`` (head counts, unsupported options)."""

    def tp_plan(self, model: Optional[nn.Module] = None) -> Plan:
        """The plan of one block (``model``: the whole model, for options that add entries, e.g. q/k norms)."""
        raise ValueError(f"no tensor-parallel plan for the {self.name} family")

    def adapt_plan(self, block: nn.Module, plan: Plan) -> Plan:
        """The plan as it applies to this block (e.g. styles for layers torch's styles do not know, per-head norms a
        user's plan leaves out)."""
        return plan

    def prepare_block(self, block: nn.Module, tp: int, plan: Plan) -> dict[str, Reorder]:
        """Changes one block needs before ``parallelize_module`` (fused weights reordered so each rank holds its
        own heads, head counts divided); returns the reordered weights by path relative to the block."""
        return {}

    # -- pipeline parallel ------------------------------------------------------------------------------------
    def pipeline_sizes(self, model: nn.Module) -> tuple[list[int], int, int]:
        """Parameters per block, of the first stage's embeddings and of the last stage's head: the weights that
        balance the stages (matmul parameters stand for compute)."""
        raise ValueError(f"pipeline parallelism does not split {type(model).__name__} ({self.name} family)")

    def split(self, model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
        """Prune ``model`` in place to the stages of ``pp_rank`` (a ``pipeline.StagePlan``) and return their stage
        modules in stage order; they hold references to the model's own submodules, their blocks in ``layers``."""
        raise ValueError(f"pipeline parallelism does not split {type(model).__name__} ({self.name} family)")

    def loss(self, model: nn.Module, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss the model itself computes from ``labels`` (on the last stage's output); ``hf_loss`` families."""
        raise NotImplementedError(f"the {self.name} family takes its loss function from the caller")

    def wrap_output(self, loss: Optional[torch.Tensor], output: Optional[torch.Tensor]) -> Any:
        """What the pipelined ``model(...)`` returns for ``hf_loss`` families: the output class the model returns."""
        raise NotImplementedError(f"the {self.name} family takes its loss function from the caller")

    # -- planner ----------------------------------------------------------------------------------------------
    def config_schema(self, mapping: Mapping[str, Any]) -> Optional[Schema]:
        """The keys a recipe's ``model:`` mapping of this family may hold (from the class that takes them)."""
        return None

    def spec_from_config(self, mapping: Mapping[str, Any]) -> ModelSpec:
        """The :class:`ModelSpec` a recipe's ``model:`` mapping describes, counted without building the model."""
        raise ValueError(f"the {self.name} family is planned from a model or an HF config, not a `model:` mapping")

    def spec_from_hf_config(self, config: Any, module: Optional[nn.Module] = None) -> Optional[ModelSpec]:
        """The spec of an HF config (and its model, when there is one) counted analytically, or None (measured)."""
        return None

    def spec_from_module(self, module: nn.Module) -> Optional[ModelSpec]:
        """The spec of one of the family's models, or None: the planner measures it."""
        return None

    def meta_model(self, mapping: Mapping[str, Any]) -> nn.Module:
        """The model a ``model:`` mapping describes, built on the meta device (to check the counts)."""
        raise ValueError(f"the {self.name} family builds no model from a `model:` mapping")

    def widths(self, config: Any) -> dict[str, int]:
        """``hidden``, ``heads``, ``kv_heads``, ``ffn``, ``layers``, ``vocab``, ``tokens`` from an HF config."""
        return {}

    def activation_bytes(self, spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int,
                         activation_checkpointing: bool, dims: ParallelDims) -> int:
        """Bytes one micro-batch's forward saves for backward, by the family's formula (``analytic`` families)."""
        raise NotImplementedError(f"the {self.name} family's models are measured, not counted by formulas")

    def flops_per_sample(self, spec: ModelSpec, seq_len: int) -> float:
        """Training FLOPs (forward + backward) of one sample, by the family's formula (``analytic`` families)."""
        raise NotImplementedError(f"the {self.name} family's models are measured, not counted by formulas")


# -- helpers the families share ---------------------------------------------------------------------------------
def _sizes(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:-1]) + (" or " if len(values) > 1 else "") + str(values[-1])


def check_heads(tp: int, **counts: int) -> None:
    """``check_heads(2, num_heads=12)``: every head count must be divisible by the tensor-parallel size."""
    for name, count in counts.items():
        if count % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={count}; choose"
                             f" {_sizes(divisors(math.gcd(*counts.values())))}")


def per_head_norm(heads_dim: int) -> ParallelStyle:
    """A norm over each head's features (Qwen3's and timm's q/k norm) inside the split attention: its parameters
    are replicated DTensors and its input is marked sharded along the heads dimension, so their gradients, which
    each rank computes from its own heads only, are summed over the tensor-parallel ranks in backward (a plain
    replicated norm would drift apart on every rank). torch's ``SequenceParallel`` does exactly that for any
    dimension."""
    return SequenceParallel(sequence_dim=heads_dim, use_local_output=True)


def with_head_norms(plan: Plan, block: nn.Module, split: str, norms: tuple[str, ...], heads_dim: int) -> Plan:
    """``plan`` plus per-head norms for ``norms`` when it splits the heads (``split`` in it) of a block that has
    them: a user's plan that splits the heads keeps those norms' gradients summed over the tensor-parallel ranks
    too (without them each rank's copy would drift)."""
    if split not in plan or not has_module(block, norms[0]):
        return plan
    return {**{norm: per_head_norm(heads_dim) for norm in norms}, **plan}


def has_module(model: nn.Module, suffix: str) -> bool:
    """Whether some submodule's path ends with ``suffix`` and it does something (timm puts ``nn.Identity`` where
    an option is off)."""
    return any(name.endswith(suffix) and not isinstance(m, nn.Identity) for name, m in model.named_modules())


def count(module: Optional[nn.Module]) -> int:
    """Parameters of ``module`` (0 for a pruned-away None)."""
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def keep_blocks(plan: Any, pp_rank: int) -> tuple[list[int], set[int], bool, bool]:
    """``(stages, blocks, first, last)`` of ``pp_rank`` under a ``pipeline.StagePlan``: its stage ids, the block
    indices they run, and whether it runs the first and the last stage."""
    stages = plan.stages_of(pp_rank)
    keep = {i for s in stages for i in range(*plan.bounds[s])}
    return stages, keep, 0 in stages, plan.num_stages - 1 in stages


def block_activations(spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int, per_layer: float,
                      base: float, activation_checkpointing: bool) -> int:
    """Activations of a stack of ``spec.layers`` equal blocks saving ``per_layer`` bytes each, plus ``base`` outside
    them. Under activation checkpointing each block keeps only its input; backward recomputes one at a time."""
    if activation_checkpointing:
        return int(spec.layers * micro_batch * seq_len * spec.hidden * compute_bytes + per_layer + base)
    return int(spec.layers * per_layer + base)
