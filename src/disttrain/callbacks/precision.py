"""Precision callbacks: real fp16 (also on CPU), bf16, and FP8 training through torchao float8."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch import nn

from disttrain.callbacks.accumulation import layout_of
from disttrain.parallel.engines.layout import Precision

_PRECISION = {"fp16": "16-mixed", "bf16": "bf16-mixed"}


class MixedPrecision(L.Callback):
    """fp16 with dynamic loss scaling, or bf16, under every disttrain strategy — on CPU too.

    Lightning silently turns ``precision="16-mixed"`` into bf16 on CPU; ``MixedPrecision("fp16")`` keeps fp16 there
    (torch's CPU autocast and GradScaler do fp16). Under ``disttrain_fsdp`` the scaler is FSDP's sharded one
    (every rank skips the same steps); under ``disttrain_zero3`` DeepSpeed scales the loss itself.
    Logged each step: ``precision/loss_scale``, ``precision/skipped_steps`` (optimizer steps skipped because the
    fp16 gradients overflowed); also kept in ``self.loss_scale`` and ``self.skipped_steps``.

    Trainer: ``Trainer(callbacks=[MixedPrecision("fp16")])`` (leave ``precision`` at its default).
    Fabric: ``Fabric(plugins=[MixedPrecision("fp16").fabric_plugin("cpu")])`` (DeepSpeed: ``precision="16-mixed"``),
    then ``mp.update(fabric)`` after each optimizer step for the counters.
    """

    def __init__(self, dtype: str = "bf16") -> None:
        if dtype not in _PRECISION:
            raise ValueError(f"MixedPrecision(dtype={dtype!r}) is not supported; choose 'fp16' or 'bf16'"
                             " (FP8 is disttrain.callbacks.FP8)")
        self.dtype = dtype
        self.precision = _PRECISION[dtype]
        self.loss_scale: Optional[float] = None
        self.skipped_steps = 0

    # -- Trainer -------------------------------------------------------------------------------------------
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        trainer.strategy.precision_plugin = self.trainer_plugin(trainer.strategy)

    def trainer_plugin(self, strategy: Any) -> Any:
        """The Trainer plugin for ``strategy``; disttrain's FSDP strategy turns it into its FSDP2 plugin."""
        from lightning.pytorch.plugins.precision import DeepSpeedPrecision
        from lightning.pytorch.plugins.precision import MixedPrecision as AMP

        if _deepspeed_precision(strategy):
            return DeepSpeedPrecision(self.precision)
        device = strategy.root_device.type if strategy.parallel_devices else "cpu"
        return AMP(self.precision, device, scaler=self._scaler(device))

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "deepspeed_engine", None) if _deepspeed_precision(trainer.strategy) \
            else None
        if engine is not None:
            self.skipped_steps = int(engine.skipped_steps)
            self.loss_scale = float(getattr(engine.optimizer, "loss_scale", 1.0)) if self.dtype == "fp16" else None
        else:
            self._from_scaler(getattr(trainer.strategy.precision_plugin, "scaler", None))
        if self.loss_scale is not None:
            pl_module.log("precision/loss_scale", self.loss_scale, rank_zero_only=True)
        pl_module.log("precision/skipped_steps", float(self.skipped_steps), rank_zero_only=True)

    # -- Fabric --------------------------------------------------------------------------------------------
    def fabric_plugin(self, accelerator: str = "cpu") -> Any:
        from lightning.fabric.plugins.precision import MixedPrecision as AMP

        device = "cuda" if accelerator in ("gpu", "cuda") else accelerator
        return AMP(self.precision, device, scaler=self._scaler(device))

    def update(self, fabric: "L.Fabric") -> None:
        """Refresh the counters after an optimizer step (Fabric)."""
        self._from_scaler(getattr(fabric.strategy.precision, "scaler", None))

    # -- shared --------------------------------------------------------------------------------------------
    def _scaler(self, device: str) -> Optional[torch.amp.GradScaler]:
        return torch.amp.GradScaler(device) if self.dtype == "fp16" else None

    def _from_scaler(self, scaler: Optional[torch.amp.GradScaler]) -> None:
        if scaler is None or not scaler.is_enabled():
            return
        scale = float(scaler.get_scale())
        if self.loss_scale is not None and scale < self.loss_scale:
            self.skipped_steps += 1  # GradScaler halves the scale exactly when it skips the step for inf/nan
        self.loss_scale = scale


def _deepspeed_precision(strategy: Any) -> bool:
    """Whether the strategy's engine applies the precision with DeepSpeed's own (its loss scaler, its counters)."""
    layout = layout_of(strategy)
    return layout is not None and layout.can.precision is Precision.DEEPSPEED


@dataclasses.dataclass
class FP8Report:
    converted: list[str]
    skipped: dict[str, str]


def fp8_filter(skip_names: tuple[str, ...] = ("lm_head",)) -> Callable[[nn.Module, str], bool]:
    """Which Linear layers FP8 can take: both dimensions multiples of 16 (the FP8 matmul's tile), and not named
    in ``skip_names`` (by default the LM head, whose precision matters most)."""
    def accept(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # recurse into containers
        if any(name in fqn for name in skip_names):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return accept


def convert_to_fp8(model: nn.Module, recipe: str = "tensorwise", fp8_all_gather: bool = False,
                   skip_names: tuple[str, ...] = ("lm_head",)) -> FP8Report:
    """Swap the model's Linear layers for torchao Float8Linear, in place and before any sharding.

    ``fp8_all_gather``: FSDP2 gathers weights in float8 (half of bf16's bytes); only on NCCL — gloo has no
    float8 collectives. Returns which layers were converted and why the others were skipped.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    accept = fp8_filter(skip_names)
    skipped = {}
    for fqn, m in linears.items():
        if not accept(m, fqn):
            skipped[fqn] = "skipped by name" if any(n in fqn for n in skip_names) else \
                f"shape {m.in_features}x{m.out_features} is not a multiple of 16"
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fp8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, module_filter_fn=accept, config=config)
    return FP8Report(converted=[f for f in linears if f not in skipped], skipped=skipped)


class FP8(L.Callback):
    """FP8 training through torchao float8 (``recipe`` "tensorwise" or "rowwise"), under ``disttrain_fsdp`` and
    ``disttrain_ddp``. Linear layers are converted before the strategy shards or wraps the model; layers FP8
    cannot take are skipped and listed in ``self.report.skipped``. Float8 all-gather is used where the backend
    has it (NCCL), not on gloo. Runs on CPU too (torch has ``_scaled_mm`` there), so it is testable in CI.

    Fabric: ``report = disttrain.callbacks.convert_to_fp8(model)`` before ``fabric.setup(model, ...)``.
    """

    def __init__(self, recipe: str = "tensorwise", skip_names: tuple[str, ...] = ("lm_head",)) -> None:
        if recipe not in ("tensorwise", "rowwise"):
            raise ValueError(f"FP8(recipe={recipe!r}) is not known; choose 'tensorwise' or 'rowwise'")
        self.recipe, self.skip_names = recipe, skip_names
        self.report: Optional[FP8Report] = None

    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        layout = layout_of(trainer.strategy)
        if layout is None or not layout.can.module_transforms:
            raise ValueError(f"FP8 needs disttrain_fsdp or disttrain_ddp (got {type(trainer.strategy).__name__});"
                             " DeepSpeed ZeRO-3 keeps its own fp16/bf16 partitions")
        nccl = trainer.strategy.root_device.type == "cuda"
        # FSDP2 (also under disttrain_megatron) can gather weights in float8; gloo has no float8 collectives.
        gather = nccl and layout.can.float8_all_gather

        def convert(model: nn.Module) -> None:
            self.report = convert_to_fp8(model, self.recipe, fp8_all_gather=gather, skip_names=self.skip_names)

        trainer.strategy.add_module_transform(convert)
