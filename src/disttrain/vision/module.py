"""``ViTClassifier``: image classification with a timm VisionTransformer, for the Trainer and for Fabric."""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from disttrain.vision.config import TrainConfig, build_vit, read_yaml, train_config
from disttrain.vision.data import DataConfig, data_config, mixup_fn


class ViTClassifier(L.LightningModule):
    """A timm VisionTransformer classifier.

    Pass ``model_args`` (timm ``VisionTransformer`` keyword arguments: a config's ``model:`` section) and optionally
    ``train`` (:class:`disttrain.vision.config.TrainConfig`: optimiser, schedule, activation checkpointing, SDPA)
    and ``data`` (:class:`disttrain.vision.data.DataConfig`: mixup and label smoothing are applied here), or use
    :meth:`from_config` with a YAML path. The timm model is built in :meth:`configure_model` (on the meta device
    under ``empty_init``, so no rank ever holds the whole 2B model) and lives in ``self.model``.

    ``training_step`` returns the loss; validation accumulates top-1 accuracy (torchmetrics) and loss, read with
    :meth:`validation_metrics` (the Trainer logs them as ``val_acc`` / ``val_loss`` every validation epoch).
    ``total_steps`` sizes the cosine schedule; the Trainer's estimate is used when it is None.
    """

    def __init__(self, model_args: dict[str, Any], train: Optional[TrainConfig] = None,
                 data: Optional[DataConfig] = None, total_steps: Optional[int] = None) -> None:
        super().__init__()
        self.model_args = dict(model_args)
        self.train_config = train or TrainConfig()
        self.data_config = data or DataConfig()
        self.total_steps = total_steps
        self.num_classes = int(self.model_args.get("num_classes", 1000))
        self.model: Any = None
        self.mixup = mixup_fn(self.data_config, self.num_classes)
        # Kept out of the module tree (a plain dict, not submodules): strategies rebuild the tree's tensors
        # (meta-device materialisation uses to_empty, DeepSpeed casts) and would leave the counts as garbage.
        self.val_metrics = {"val_acc": MulticlassAccuracy(num_classes=self.num_classes, average="micro"),  # top-1
                            "val_loss": MeanMetric()}

    @classmethod
    def from_config(cls, path: Union[str, os.PathLike], **data_overrides: Any) -> "ViTClassifier":
        """The classifier a recipe YAML describes (``model:``, ``train:``, ``data:`` sections)."""
        config = read_yaml(path)
        return cls(config["model"], train_config(config.get("train")),
                   data_config(config.get("data"), **data_overrides))

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = build_vit(self.model_args)
        if self.train_config.activation_checkpointing:
            self.model.set_grad_checkpointing(True)  # timm recomputes each block in backward (non-reentrant)
        if self.train_config.sdpa:
            from disttrain.callbacks.attention import apply_fast_attention

            apply_fast_attention(self.model)  # timm's fused_attn: F.scaled_dot_product_attention
        else:
            for module in self.model.modules():
                if isinstance(getattr(module, "fused_attn", None), bool):
                    module.fused_attn = False

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)  # (B, num_classes)

    def loss_fn(self, logits: Tensor, target: Tensor) -> Tensor:
        """The loss of a batch from the model's output: cross-entropy for class indices (with
        ``train.label_smoothing``), soft-target cross-entropy for the (B, num_classes) targets mixup makes.

        This is the pipeline-parallel hook: ``disttrain_megatron`` with ``pipeline_parallel_size > 1`` hands it to
        the last stage, which is why ``training_step`` computes exactly ``self.loss_fn(self.model(images), target)``
        and nothing else between the model and the loss.
        """
        logits = logits.float()  # the loss in fp32 whatever the compute precision
        if target.is_floating_point():  # (B, C) soft targets
            return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()
        return F.cross_entropy(logits, target, label_smoothing=self.train_config.label_smoothing)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, target = batch
        if self.mixup is not None:
            images, target = self.mixup(images, target)
        loss = self.loss_fn(self.model(images), target)
        if self._trainer is not None:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, target = batch
        logits = self.model(images)
        loss = self.loss_fn(logits, target)
        for metric in self.val_metrics.values():
            if metric.device != logits.device:  # outside the module tree: nobody else moves them
                metric.to(logits.device)
        self.val_metrics["val_acc"].update(logits.detach(), target)
        self.val_metrics["val_loss"].update(loss.detach(), weight=target.shape[0])
        return loss

    def validation_metrics(self) -> dict[str, float]:
        """Top-1 accuracy and mean loss over every rank's validation batches since the last call (collective)."""
        values = {name: metric.compute().item() for name, metric in self.val_metrics.items()}
        for metric in self.val_metrics.values():
            metric.reset()
        return values

    def on_validation_epoch_end(self) -> None:  # Trainer only
        # Already reduced over ranks by torchmetrics: every rank logs the same values (ModelCheckpoint can monitor).
        self.log_dict(self.validation_metrics(), prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW without weight decay on biases, norms, position embedding and class token (timm's groups); linear
        warm-up, then cosine decay to ``lr * min_lr_ratio``, stepped every optimizer step."""
        from timm.optim import param_groups_weight_decay

        cfg = self.train_config
        no_decay = {f"model.{name}" for name in self.model.no_weight_decay()}
        groups = param_groups_weight_decay(self, cfg.weight_decay, no_weight_decay_list=no_decay)
        # foreach also on the CPU, where torch steps tensor by tensor by default: one dispatch per list of (D)Tensors
        # instead of one per tensor takes a fifth off the tiny ViT's step on 2 CPU processes (GPUs: torch's default).
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), foreach=True)
        total = self.total_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, total,
                                                                               cfg.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Any:
    """The LR multiplier at a step: linear from ~0 to 1 over ``warmup_steps``, then cosine down to ``min_ratio``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor
