"""timm's ``VisionTransformer``: tensor parallel over each block (the fused ``attn.qkv`` reordered so each rank holds
q, k and v of its own heads), pipeline stages, the planner's analytic counts (``VisionTransformer`` keywords), and
the export timm loads (a state dict: ``timm.models.load_checkpoint``)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.families.base import (
    TORCH_EXPORT,
    ExportFormat,
    Family,
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
from disttrain.parallel.families.layout import Reorder, qkv_rank_major
from disttrain.parallel.families.spec import ModelSpec, count_params, transformer_flops_per_token

QK_NORMS = ("attn.q_norm", "attn.k_norm")


def vit_plan(qk_norm: bool = False) -> Plan:
    """One timm ViT block. ``attn.qkv`` is one fused Linear whose rows are [q heads | k heads | v heads]; its rows
    are reordered first (:func:`qkv_rank_major`) so that the column-wise split gives each rank q, k and v of its
    own heads. ``qk_norm=True`` models: the per-head q/k norms run on (B, heads, N, head_dim), heads on dim 1."""
    return {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
        **({norm: per_head_norm(1) for norm in QK_NORMS} if qk_norm else {}),
    }


class ViTStage(nn.Module):
    """Patch embedding and position embedding (first stage), blocks [start, end), norm and head (last stage).

    timm keeps ``cls_token``/``pos_embed`` on the model itself; the first stage calls the model's own
    ``_pos_embed`` for them, so they are replicated over data parallel rather than FSDP-sharded (see
    ``Pipeline.stray_parameters``)."""

    def __init__(self, vit: nn.Module, block_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.__dict__["vit"] = vit  # not a child: the stage must not own the other stages' parameters
        self.patch_embed = vit.patch_embed if first else None
        self.layers = nn.ModuleDict({str(i): vit.blocks[str(i)] for i in block_ids})
        head_parts = ("norm", "attn_pool", "fc_norm", "head_drop", "head")
        self.head_parts = nn.ModuleDict({n: getattr(vit, n) for n in head_parts
                                         if last and isinstance(getattr(vit, n, None), nn.Module)})
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vit = self.vit
        if self.first:
            x = self.patch_embed(x)  # (B, N, D)
            x = vit.norm_pre(vit.patch_drop(vit._pos_embed(x)))
        for block in self.layers.values():
            x = block(x)
        if self.last:
            return vit.forward_head(vit.norm(x))  # (B, classes)
        return x.contiguous()  # sent to the next stage: point-to-point sends take contiguous tensors only


def write_timm(state: Mapping[str, torch.Tensor], output: Path, checkpoint: Path, config: Any) -> Path:
    """A state dict for ``timm.models.load_checkpoint``: safetensors when ``output`` ends in .safetensors, else a
    ``torch.save`` file (.pth)."""
    from disttrain.parallel.families.base import SAFETENSORS_EXPORT

    writer = SAFETENSORS_EXPORT if output.suffix == ".safetensors" else TORCH_EXPORT
    return writer.write(state, output, checkpoint, config)


TIMM_EXPORT = ExportFormat("timm", write_timm)


def vit_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    """A timm ``VisionTransformer`` (its keyword defaults where a key is absent: class token, qkv bias, mlp 4.0)."""
    img = cfg.get("img_size", 224)
    img = int(img[0] if isinstance(img, (list, tuple)) else img)
    patch = int(cfg.get("patch_size", 16))
    chans = int(cfg.get("in_chans", 3))
    h = int(cfg.get("embed_dim", 768))
    depth = int(cfg.get("depth", 12))
    heads = int(cfg.get("num_heads", 12))
    classes = int(cfg.get("num_classes", 1000))
    if h % heads:
        raise ValueError(f"embed_dim={h} is not a multiple of num_heads={heads}")
    if img % patch:
        raise ValueError(f"img_size={img} is not a multiple of patch_size={patch}")
    f = int(h * float(cfg.get("mlp_ratio", 4.0)))
    qkv_bias = 1 if cfg.get("qkv_bias", True) else 0
    cls = 1 if cfg.get("class_token", True) else 0
    tokens = (img // patch) ** 2 + cls
    layer = 2 * h + 3 * h * h + qkv_bias * 3 * h + h * h + h + 2 * h + h * f + f + f * h + h
    head = h * classes + classes if classes else 0
    params = chans * patch * patch * h + h + cls * h + tokens * h + depth * layer + 2 * h + head
    return ModelSpec("vit", params, layers=depth, layer_params=layer, hidden=h, ffn=f, heads=heads, kv_heads=heads,
                     tokens=tokens, image_size=img, in_chans=chans, num_classes=classes,
                     attention="eager" if cfg.get("fused_attn") is False else "sdpa",
                     extra={"patch_size": patch, "tensor_parallel": True, "pipeline": True})


def vit_arguments() -> set[str]:
    """The keyword arguments of timm's ``VisionTransformer``: what a ViT recipe's ``model:`` section may hold."""
    from timm.models.vision_transformer import VisionTransformer

    return set(inspect.signature(VisionTransformer.__init__).parameters) - {"self"}


class ViTFamily(Family):
    name = "vit"
    analytic = True
    export_format = TIMM_EXPORT

    def matches(self, model: nn.Module) -> bool:
        # DeiT's distilled ViT has the same blocks (tensor parallel); its pipeline stages are refused in split
        return type(model).__name__ in ("VisionTransformer", "VisionTransformerDistilled") and \
            type(model).__module__.startswith("timm.")

    def reads_config(self, mapping: Mapping[str, Any]) -> bool:
        return "model_type" not in mapping and ("patch_size" in mapping or "embed_dim" in mapping)

    # -- tensor parallel --------------------------------------------------------------------------------------
    def check_tp(self, model: nn.Module, tp: int, plan: Plan) -> None:
        if "attn.qkv" in plan:
            check_heads(tp, num_heads=model.blocks[0].attn.num_heads)

    def tp_plan(self, model: Optional[nn.Module] = None) -> Plan:
        return vit_plan(qk_norm=model is not None and has_module(model, QK_NORMS[0]))

    def adapt_plan(self, block: nn.Module, plan: Plan) -> Plan:
        return with_head_norms(plan, block, "attn.qkv", QK_NORMS, heads_dim=1)

    @torch.no_grad()
    def prepare_block(self, block: nn.Module, tp: int, plan: Plan) -> dict[str, Reorder]:
        """A naive column split of the fused qkv would mix heads: its rows go rank-major first."""
        if "attn.qkv" not in plan:
            return {}
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
        return {"attn.qkv": Reorder(order)}

    # -- pipeline: the loss function comes from the caller ----------------------------------------------------
    def _check_pp(self, model: nn.Module) -> None:
        if getattr(model, "dist_token", None) is not None:
            raise ValueError(f"pipeline parallelism does not split {type(model).__name__} (DeiT's distillation token"
                             " and second head); use tensor parallelism, disttrain_fsdp or disttrain_zero3 for it")

    def pipeline_sizes(self, model: nn.Module) -> tuple[list[int], int, int]:
        self._check_pp(model)
        tokens = ("cls_token", "pos_embed", "reg_token")
        first = count(model.patch_embed) + sum(getattr(model, n).numel() for n in tokens
                                               if getattr(model, n, None) is not None)
        return [count(b) for b in model.blocks], first, count(model.norm) + count(model.head)

    def split(self, model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
        self._check_pp(model)
        stages, keep, first, last = keep_blocks(plan, pp_rank)
        model.blocks = nn.ModuleDict({str(i): block for i, block in enumerate(model.blocks) if i in keep})
        if not first:
            model.patch_embed = None
            for name in ("cls_token", "reg_token", "pos_embed"):
                if getattr(model, name, None) is not None:
                    setattr(model, name, None)
        if not last:
            for name in ("norm", "attn_pool", "fc_norm", "head"):
                if isinstance(getattr(model, name, None), nn.Module):
                    setattr(model, name, nn.Identity() if name != "attn_pool" else None)
        return [ViTStage(model, range(*plan.bounds[s]), s == 0, s == plan.num_stages - 1) for s in stages]

    # -- planner ----------------------------------------------------------------------------------------------
    def config_schema(self, mapping: Mapping[str, Any]) -> Schema:
        return dict.fromkeys(sorted(vit_arguments()))

    def spec_from_config(self, mapping: Mapping[str, Any]) -> ModelSpec:
        return vit_spec(mapping)

    def spec_from_module(self, module: nn.Module) -> ModelSpec:
        block = module.blocks[0]
        h = module.embed_dim if hasattr(module, "embed_dim") else block.norm1.normalized_shape[0]
        img = module.patch_embed.img_size
        patch = module.patch_embed.patch_size
        cfg = {"img_size": img[0] if isinstance(img, (tuple, list)) else img,
               "patch_size": patch[0] if isinstance(patch, (tuple, list)) else patch,
               "in_chans": module.patch_embed.proj.in_channels, "embed_dim": h, "depth": len(module.blocks),
               "num_heads": block.attn.num_heads, "num_classes": getattr(module, "num_classes", 0),
               "mlp_ratio": block.mlp.fc1.out_features / h, "fused_attn": getattr(block.attn, "fused_attn", True),
               "class_token": getattr(module, "cls_token", None) is not None}
        return replace(vit_spec(cfg), params=count_params(module), layer_params=count_params(block))

    def meta_model(self, mapping: Mapping[str, Any]) -> nn.Module:
        from timm.models.vision_transformer import VisionTransformer

        with torch.device("meta"):
            return VisionTransformer(**mapping)

    def activation_bytes(self, spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int,
                         activation_checkpointing: bool, dims: ParallelDims) -> int:
        b, s, t = micro_batch, seq_len, dims.tp
        h, f, a = spec.hidden, spec.ffn, spec.heads
        # Per block: LayerNorms (input, output, mean, rstd), qkv, attention output, projection input (8 h), fc1
        # output and GELU output (2 f), SDPA's log-sum-exp (a); eager attention keeps the a x n x n softmax.
        replicated = 4 * h + 4
        split = 4 * h + 2 * f + (a if spec.attention == "sdpa" else a * s)
        per_layer = b * s * (replicated + split / t) * compute_bytes
        # Patch embedding input (the image), patch tokens with position embedding, final norm, class logits.
        base = b * ((spec.in_chans * spec.image_size ** 2 + 2 * s * h + 2 * s + spec.num_classes + 13)
                    * compute_bytes)
        return block_activations(spec, b, s, compute_bytes, per_layer, base, activation_checkpointing)

    def flops_per_sample(self, spec: ModelSpec, seq_len: int) -> float:
        return transformer_flops_per_token(spec.params, spec.layers, spec.hidden, seq_len) * seq_len


VIT = ViTFamily()
