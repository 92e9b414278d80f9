"""Check 3: FP8 training through torchao float8 (``disttrain.callbacks.convert_to_fp8``, tensorwise and rowwise)
against bf16 on the 10B config's full-width slice: at every step FP8's loss differs from bf16's by at most 1% of
bf16's first loss; and step time. The scale is the first loss, not each step's: the learnable batches drive the
loss near zero, where a relative difference per step (0.050 vs 0.049: 2%) measures noise, not FP8.

All three runs start from the same weights (same seed, built on the device) and see the same batches, under
``disttrain_fsdp`` with bf16-mixed, as the FP8 callback runs: eager, no ``torch.compile``."""

from __future__ import annotations

import statistics
from typing import Any, Optional

import torch

from gpu_checks.common import (Context, Row, build_llama, fabric, free_memory, learnable_batches,
                               max_diff_of_start, model_args, skipped, timed)
from gpu_checks.mfu import SLICE_LAYERS
from gpu_checks.training import optional_import, train_step

CHECK = "3 FP8"
STEPS = 20
WARMUP = 3  # steps left out of the step time (first-call kernel selection, optimizer state creation)
LOSS_TOLERANCE = 0.01  # of bf16's first loss, at every step
LR = 3e-4


def train(ctx: Context, args: dict[str, Any], recipe: Optional[str], batches: list[torch.Tensor]) -> dict[str, Any]:
    import disttrain
    from disttrain.callbacks import convert_to_fp8

    f = fabric(ctx, disttrain.fabric.FSDPStrategy(), "bf16-mixed")
    model = build_llama(args, ctx.device)
    converted = len(convert_to_fp8(model, recipe).converted) if recipe else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))
    model, optimizer = f.setup(model, optimizer)
    losses, times = [], []
    for ids in batches:
        box = {}
        times.append(timed(lambda: box.setdefault("loss", train_step(f, model, optimizer, [ids])), ctx.device))
        losses.append(box["loss"].item())
    return {"losses": losses, "step_s": statistics.median(times[WARMUP:]) if len(times) > WARMUP else times[-1],
            "converted_linears": converted}


def run(ctx: Context) -> list[Row]:
    target = (f"loss within {LOSS_TOLERANCE:.0%} of bf16's first loss from bf16's at each of {STEPS} steps;"
              " step time vs bf16")
    missing = optional_import("torchao.float8")
    if missing:
        return [skipped(CHECK, f"{r} vs bf16", target, f"torchao cannot be imported ({missing}); carry it: make "
                        f"gpu-wheels") for r in ("tensorwise", "rowwise")]
    args = model_args("configs/nlp/dialogue_10b.yaml", SLICE_LAYERS, dry=ctx.dry)
    seq, batch, steps = (32, 2, 6) if ctx.dry else (4096, 1, STEPS)
    batches = learnable_batches(args["vocab_size"], batch, seq, steps, ctx.device)
    bf16 = train(ctx, args, None, batches)
    free_memory()
    rows = []
    for recipe in ("tensorwise", "rowwise"):
        try:
            fp8 = train(ctx, args, recipe, batches)
            free_memory()
        except Exception as e:  # noqa: BLE001  (one recipe failing must not hide the other's result)
            free_memory()
            if ctx.dry and "only supports per-tensor scaling for CPU" in str(e):
                rows.append(skipped(CHECK, f"{recipe} vs bf16", target, f"this torch ({torch.__version__}) has no "
                                    "rowwise-scaled _scaled_mm on the CPU; the GPU run has it"))
                continue
            rows.append(Row(CHECK, f"{recipe} vs bf16", "-", target, False, f"{type(e).__name__}: {e}"[:400]))
            continue
        diff = max_diff_of_start(fp8["losses"], bf16["losses"])
        speed = bf16["step_s"] / fp8["step_s"]
        ok = diff <= LOSS_TOLERANCE
        item = (f"{recipe} vs bf16, {'tiny [dry]' if ctx.dry else f'dialogue_10b {SLICE_LAYERS}-layer slice'}, "
                f"{len(batches)} steps of {batch} x {seq}")
        figure = (f"max loss gap {diff:.2%} of the first loss {bf16['losses'][0]:.3f} (final {fp8['losses'][-1]:.3f}"
                  f" vs {bf16['losses'][-1]:.3f}); step "
                  f"{fp8['step_s'] * 1e3:.0f} ms vs {bf16['step_s'] * 1e3:.0f} ms ({speed:.2f}x)")
        reason = "" if ok else f"loss differs by {diff:.2%} of the first loss > {LOSS_TOLERANCE:.0%}"
        if ok and speed < 1:
            reason = ("slower than bf16: torchao's float8 gains need torch.compile to fuse its casts and scaling; "
                      "convert_to_fp8 leaves the model eager")
        rows.append(Row(CHECK, item, figure, target, ok, reason, value=diff,
                        details={"bf16_losses": bf16["losses"], "fp8_losses": fp8["losses"], "speed_up": speed,
                                 "converted_linears": fp8["converted_linears"]}))
    return rows
