"""Any Hugging Face model whose config declares its own parallel plans: tensor parallel from
``config.base_model_tp_plan`` (and the model class's ``_tp_plan``, e.g. the LM head), expert parallel from
``base_model_ep_plan``, pipeline stages from ``base_model_pp_plan``. transformers ships these with 164 model types
(130 with a pipeline plan, 72 with an expert plan), so Phi-3, GPT-NeoX, Gemma-2, Qwen2-MoE, Mixtral, Qwen3-MoE and
most other decoders train under ``disttrain_megatron`` without a family file here.

The styles are applied by transformers' own ``transformers.distributed`` code (the one ``from_pretrained(tp_plan=...,
distributed_config=...)`` uses): each style string (``colwise``, ``rowwise``, ``packed_colwise`` for fused
``gate_up_proj`` experts, ``colwise_gather_output`` for Phi-3's fused ``qkv_proj``, ``replicated_with_grad_allreduce``
for Qwen3's per-head q/k norms, ``embedding_rowwise``, ``grouped_gemm`` + ``ep_dispatch_experts`` for experts) makes
the parameters DTensors over the tensor- (or expert-) parallel mesh, with placements that describe the model's own
layout (a fused weight is a strided shard), so DCP checkpoints and ``export_full`` keep the library's layout with no
reordering of ours. Expert parallelism dispatches each (token, expert) pair to the expert's rank and back with
all-to-all (dropless).

Pipeline stages run the model's own forward on every stage: the layers of other stages are skipped, a non-first
stage's received activations replace the input of its first layer (whatever the model does between its embedding and
its layers, e.g. Gemma's scaling, happens on the first stage only), and a non-last stage hands on the output of its
last layer. The Llama family (:mod:`~disttrain.parallel.families.llama`), GPT-2, BERT and timm's ViT keep their own
files: context parallelism, the planner's formulas and their pipeline stages are written for them.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch
from torch import nn

from disttrain.parallel.families.base import count, keep_blocks
from disttrain.parallel.families.hf import HFFamily


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def declared_plans(model: nn.Module) -> tuple[dict, dict, dict]:
    """The model's own ``(tp_plan, ep_plan, pp_plan)`` as transformers collects them (module paths with ``*`` for
    the layer number; styles as strings); empty where it declares none."""
    plans = []
    for name in ("tp_plan", "ep_plan", "pp_plan"):
        plan = getattr(model, name, None)
        plans.append(dict(plan) if isinstance(plan, dict) else {})
    return plans[0], plans[1], plans[2]


def resolved_plans(model: nn.Module, tp: int, ep: int) -> tuple[dict[str, str], dict[str, str]]:
    """The tensor- and expert-parallel plans expanded to this model's modules and parameters
    (``model.layers.3.mlp.up_proj``), as transformers resolves them (a module with an expert rule keeps no tensor
    rule). Parameters tied to another (an LM head sharing the embedding) appear once: the embedding's rule shards the
    shared weight, the head keeps its forward hook."""
    from transformers.distributed.configuration_utils import DistributedConfig

    # fsdp_size only satisfies DistributedConfig's check that ep divides fsdp * tp; its FSDP plan is not used.
    config = DistributedConfig(tp_size=tp, ep_size=ep, fsdp_size=max(1, ep // math.gcd(ep, tp)))
    tp_plan, ep_plan, _ = model._resolve_parallel_plans(config)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())

    def keep(plan: dict[str, str]) -> dict[str, str]:
        return {name: style for name, style in plan.items() if name in params or name in modules}

    return keep(tp_plan), keep(ep_plan)


def _owners(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter's owners ``(module, attribute)``: more than one where weights are tied."""
    modules = dict(model.named_modules(remove_duplicate=False))
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        owners.setdefault(id(param), []).append((modules[module_name], attr))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Give every owner of a tied weight the parameter that sharding put in its first owner's place (the plans
    replace a module's parameter by a DTensor; its other owners would keep the old one)."""
    for group in groups:
        first, attr = group[0]
        for module, name in group[1:]:
            module._parameters[name] = first._parameters[attr]


class _TPMeshes:
    """What transformers' styles ask of a model's ``_mesh_manager`` when disttrain, not ``from_pretrained``, applies
    a plan: the tp mesh, and the "unit" view of it that ``unit_colwise``/``unit_rowwise`` shard whole heads over
    (MiniCPM5-MoE's key/value projections, with fewer kv heads than tp ranks). transformers builds that view as a
    fresh DeviceMesh from the tp ranks alone, which every data-parallel group would create on its own; unflattening
    our tp mesh makes it from the root mesh's layout, so any dp x tp world builds it together."""

    def __init__(self, tp_mesh: Any) -> None:
        self.tp_mesh = tp_mesh
        self._units: dict[int, Any] = {}

    def get_mesh(self, dims: Any) -> Any:
        if dims not in ("tp", ("tp",)):
            raise ValueError(f"disttrain applies transformers' tensor-parallel styles on the tp mesh only, not {dims}")
        return self.tp_mesh

    def get_unit_mesh(self, unit_number: int) -> Any:
        tp = self.tp_mesh.size()
        groups = math.gcd(unit_number, tp)
        if groups not in self._units:
            self._units[groups] = self.tp_mesh._unflatten(0, (groups, tp // groups), ("tp_unit", "unit_replicate"))
        return self._units[groups]


def expert_counts(model: nn.Module) -> tuple[int, int, int]:
    """``(parameters in experts, experts per MoE layer, experts each token goes to)`` of an HF model whose config
    declares an expert plan (its ``ep_dispatch_experts`` modules); zeros for a dense model. Sharded parameters count
    at full size."""
    patterns = [name for name, style in declared_plans(model)[1].items() if style == "ep_dispatch_experts"]
    if not patterns:
        return 0, 0, 0
    match = re.compile("(?:^|\\.)(?:" + "|".join(re.escape(p).replace("\\*", "\\d+") for p in patterns) + ")$")
    params = sum(getattr(p, "ds_numel", p.numel()) for name, module in model.named_modules() if match.search(name)
                 for p in module.parameters())
    config = _text_config(model)
    top_k = next((v for k in ("num_experts_per_tok", "moe_topk", "top_k") if isinstance(v := getattr(config, k, None),
                                                                                      int)), 0)
    return params, HF_PLANS.num_experts(model), top_k


class PassThrough(nn.Module):
    """A layer of another pipeline stage: hands its input on (HF decoder layers take and return the hidden states)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class HFPlanStage(nn.Module):
    """One pipeline stage of an HF model split by its ``base_model_pp_plan``: the model's own forward, with the
    layers outside ``layer_ids`` skipped. ``layers`` holds the stage's layers (FSDP's units); ``embed`` (first stage)
    and ``norm``/``head`` (last stage) are registered so the stage owns their parameters."""

    def __init__(self, model: nn.Module, names: tuple[str, str, str], layer_ids: range, first: bool,
                 last: bool) -> None:
        super().__init__()
        embed_name, layers_name, norm_name = names
        base = getattr(model, model.base_model_prefix)
        layers = getattr(base, layers_name)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in layer_ids})
        self.embed = getattr(base, embed_name) if first else None
        self.norm = getattr(base, norm_name) if last else None
        self.head = model.get_output_embeddings() if last else None
        # Not submodules of the stage: the model (to call its forward) and this stage's view of the layer list.
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_view", nn.ModuleList([layers[i] if i in layer_ids else PassThrough()
                                                         for i in range(len(layers))]))
        self.first, self.last = first, last
        object.__setattr__(self, "first_layer", layers[layer_ids.start])
        object.__setattr__(self, "last_layer", layers[layer_ids.stop - 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, layers_name, norm_name = self._names
        base, model = self._base, self._model
        saved_layers, saved_norm = base._modules[layers_name], base._modules[norm_name]
        base._modules[layers_name] = self._view
        if not self.last:
            base._modules[norm_name] = nn.Identity()
        handles, captured = [], {}
        if not self.first:  # the received activations are the input of this stage's first layer
            def replace_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                if args:
                    return (x, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": x}

            handles.append(self.first_layer.register_forward_pre_hook(replace_input, with_kwargs=True))
        if not self.last:
            def capture(module: nn.Module, args: tuple, output: Any) -> None:
                captured["out"] = output[0] if isinstance(output, tuple) else output

            handles.append(self.last_layer.register_forward_hook(capture))
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        try:
            if self.last:
                # the class's forward: the pipeline replaced the instance's own
                return type(model).forward(model, **inputs, use_cache=False).logits
            base(**inputs, use_cache=False)
            return captured["out"]
        finally:
            for handle in handles:
                handle.remove()
            base._modules[layers_name], base._modules[norm_name] = saved_layers, saved_norm


# Model types whose declared tensor-parallel plan does not train under transformers' styles in this version (found
# by tests/dist/hf_tp_plans.py, which runs every declared plan at tp=2 against one process), and why.
TP_REFUSED = {
    "doge": "its dynamic-mask attention keeps per-head parameters the plan leaves whole",
    "inkling_text": "its attention fails inside the plan's sharded layers",
    "llama4_text": "its MoE layer modifies a view of the plan's sharded output in place",
}


class HFPlansFamily(HFFamily):
    """HF models (a ``PreTrainedModel`` with a head or a base model) whose config declares a tensor-, expert- or
    pipeline-parallel plan and that no family file here claims (:data:`~disttrain.parallel.families.FAMILIES` looks it
    up last)."""

    name = "hf_plans"

    def matches(self, model: nn.Module) -> bool:
        if not self.is_whole_model(model) or not hasattr(model, "_resolve_parallel_plans"):
            return False
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        return any(declared_plans(model))

    def reads_model_type(self, model_type: Optional[str]) -> bool:
        return False  # planned as measured HF models (disttrain.planner.generic)

    # -- tensor and expert parallel ---------------------------------------------------------------------------
    def check_tp(self, model: nn.Module, tp: int, plan: Any) -> None:
        from disttrain.parallel.families.base import check_heads

        if not declared_plans(model)[0]:
            raise ValueError(f"{type(model).__name__}'s config declares no tensor-parallel plan"
                             f" (base_model_tp_plan); pass tp_plan={{'block.path': ColwiseParallel(), ...}}")
        config = _text_config(model)
        if config.model_type in TP_REFUSED:
            raise ValueError(f"tensor parallelism does not split {type(model).__name__} with the plan its config"
                             f" declares: {TP_REFUSED[config.model_type]}; use disttrain_fsdp or disttrain_zero3")
        heads = {k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads")
                 if isinstance(getattr(config, k, None), int)}
        if heads:
            check_heads(tp, **heads)

    def tp_plan(self, model: Optional[nn.Module] = None) -> dict:
        """The declared plan of one layer in torch's styles (column- or row-split), as the planner reads it to tell
        split activations from replicated ones; training applies transformers' own styles (:meth:`apply_tp`)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if model is None:
            raise ValueError("the plan an HF config declares is read from its model")
        plan: dict = {}
        for name, style in declared_plans(model)[0].items():
            prefix, star, path = name.partition("layers.*.")
            if star and not prefix.strip(".").count("."):  # a path inside each layer
                if "colwise" in style:
                    plan[path] = ColwiseParallel()
                elif "rowwise" in style and "embedding" not in style:
                    plan[path] = RowwiseParallel()
        return plan

    def apply_tp(self, model: nn.Module, tp_mesh: Any, ep: int = 1) -> None:
        """Shard ``model`` over ``tp_mesh`` with its own resolved plan (transformers' styles)."""
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        tp_plan, _ = resolved_plans(model, tp_mesh.size(), ep)
        tied = _owners(model)
        if getattr(model, "_mesh_manager", None) is None:
            model._mesh_manager = _TPMeshes(tp_mesh)
        apply_tensor_parallelism(model, tp_mesh, tp_plan)
        _retie(tied)

    def has_ep_plan(self, model: nn.Module) -> bool:
        return bool(declared_plans(model)[1])

    def num_experts(self, model: nn.Module) -> int:
        config = _text_config(model)
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            value = getattr(config, key, None)
            if isinstance(value, int):
                return value
        return 0

    def apply_ep(self, model: nn.Module, ep_mesh: Any, tp_mesh: Any, tp: int) -> list[nn.Module]:
        """Split the experts over ``ep_mesh`` (``grouped_gemm``: whole experts per rank) and route tokens to them with
        all-to-all (``ep_dispatch_experts``); returns the experts modules (FSDP shards them apart from the rest).
        ``tp_mesh``: the ranks that hold the same tokens as this one (one rank: each dispatches its own)."""
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        if not self.has_ep_plan(model):
            raise ValueError(f"expert_parallel_size={ep_mesh.size()}: {type(model).__name__}'s config declares no"
                             " expert-parallel plan (base_model_ep_plan), so it has no experts to split; use"
                             " expert_parallel_size=1")
        experts = self.num_experts(model)
        if experts and experts % ep_mesh.size():
            from disttrain.parallel.mesh import divisors

            raise ValueError(f"expert_parallel_size={ep_mesh.size()} does not divide the model's {experts} experts;"
                             f" choose one of {', '.join(map(str, divisors(experts)))}")
        _, ep_plan = resolved_plans(model, tp, ep_mesh.size())
        apply_expert_parallelism(model, ep_mesh, tp_mesh, ep_plan, ep_implementation="all_to_all")
        modules = dict(model.named_modules())
        return [modules[name] for name, style in ep_plan.items() if style == "ep_dispatch_experts"]

    # -- pipeline ---------------------------------------------------------------------------------------------
    def _pp_names(self, model: nn.Module) -> tuple[str, str, str]:
        """(embedding, layers, final norm) attribute names of the base model, from ``base_model_pp_plan``."""
        # The base model's plan: its embedding, its layers and its final norm, in order (the model's own plan adds
        # the LM head).
        pp_plan = dict(getattr(_text_config(model), "base_model_pp_plan", None) or {})
        base_names = [name for name in pp_plan if "." not in name and name != "emb_dropout"]
        if not pp_plan or "layers" not in base_names or model.get_output_embeddings() is None:
            raise ValueError(f"pipeline parallelism splits HF causal LMs whose config declares a pipeline plan"
                             f" (base_model_pp_plan over embeddings, layers and a final norm), not"
                             f" {type(model).__name__}; use tensor parallelism or disttrain_fsdp for it")
        if getattr(_text_config(model), "output_router_logits", False):
            raise ValueError("pipeline parallelism cannot add the router's auxiliary loss of layers on other stages;"
                             " set output_router_logits=False or use expert/tensor parallelism without stages")
        return base_names[0], "layers", base_names[-1]

    def pipeline_sizes(self, model: nn.Module) -> tuple[list[int], int, int]:
        embed, layers, norm = self._pp_names(model)
        base = getattr(model, model.base_model_prefix)
        return ([count(layer) for layer in getattr(base, layers)], 0,
                count(getattr(base, norm)) + count(model.get_output_embeddings()))

    def split(self, model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
        names = self._pp_names(model)
        if plan.num_stages != plan.pp:
            raise ValueError(f"pipeline schedules with several stages per rank (interleaved_1f1b,"
                             f" interleaved_zero_bubble, zbv, dualpipev) split the Llama family, GPT-2, BERT and"
                             f" ViT; for {type(model).__name__} use pipeline_schedule='1f1b' or 'gpipe'")
        stages, keep, first, last = keep_blocks(plan, pp_rank)
        embed, layers_name, norm = names
        base = getattr(model, model.base_model_prefix)
        layers = getattr(base, layers_name)
        modules = [HFPlanStage(model, names, range(*plan.bounds[s]), s == 0, s == plan.num_stages - 1)
                   for s in stages]
        for i in range(len(layers)):  # other stages' layers leave this rank
            if i not in keep:
                layers[i] = PassThrough()
        if not first:
            setattr(base, embed, None)
        if not last:
            setattr(base, norm, nn.Identity())
            if hasattr(model, "set_output_embeddings"):
                model.set_output_embeddings(None)
        return modules


HF_PLANS = HFPlansFamily()
