"""Check 4: fp16 mixed precision with the sharded gradient scaler (``MixedPrecision("fp16")`` under
``disttrain_fsdp``): no NaN or inf in the losses and weights, and every step the scaler skips is counted.

After a normal first step the loss scale is raised far beyond what fp16 gradients can hold, so the following
steps overflow until the scaler has halved its way back down: those steps must leave the weights untouched and be
exactly the ones ``MixedPrecision.skipped_steps`` counts; training then goes on with finite losses."""

from __future__ import annotations

import math

import torch

from gpu_checks.common import Context, Row, build_llama, fabric, free_memory, learnable_batches, model_args
from gpu_checks.training import train_step

CHECK = "4 fp16 + sharded scaler"
FORCED_SCALE = 2.0 ** 24  # a gradient of 0.004 already overflows fp16 (max 65504) at this scale
STEPS = 30


def _checksum(model: torch.nn.Module) -> float:
    """A number that changes whenever any weight changes (the local shard of every parameter)."""
    total = 0.0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += float(local.detach().double().abs().sum())
    return total


def run(ctx: Context) -> list[Row]:
    import disttrain
    from disttrain.callbacks import MixedPrecision

    args = model_args("configs/nlp/dialogue_1b.yaml", dry=ctx.dry)
    seq, batch, steps = (32, 2, 14) if ctx.dry else (2048, 1, STEPS)
    mp = MixedPrecision("fp16")
    f = fabric(ctx, disttrain.fabric.FSDPStrategy(), plugins=[mp.fabric_plugin(ctx.accelerator)])
    scaler = getattr(f.strategy.precision, "scaler", None)
    model = build_llama(args, ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
    model, optimizer = f.setup(model, optimizer)
    batches = learnable_batches(args["vocab_size"], batch, seq, steps, ctx.device)
    losses, unchanged, scales = [], [], []
    for i, ids in enumerate(batches):
        before = _checksum(model)
        losses.append(train_step(f, model, optimizer, [ids]).item())
        mp.update(f)
        unchanged.append(_checksum(model) == before)
        scales.append(float(scaler.get_scale()) if scaler is not None else math.nan)
        if i == 0 and scaler is not None:
            scaler.update(FORCED_SCALE)  # public API: the next step runs at this scale
            mp.loss_scale = FORCED_SCALE  # the counter compares against the scale it last saw
    weights_finite = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                         for p in model.parameters())
    del model, optimizer, f
    free_memory()
    # The callback learns the scale from its first update, so a skip in the very first step cannot be counted; the
    # forced overflows all come after it.
    observed = sum(unchanged[1:])
    finite = all(math.isfinite(x) for x in losses)
    sharded = type(scaler).__name__ == "ShardedGradScaler"
    learned = losses[-1] < losses[0]
    ok = sharded and finite and weights_finite and observed >= 1 and mp.skipped_steps == observed and learned
    problems = [text for bad, text in ((not sharded, f"the scaler is {type(scaler).__name__}, not ShardedGradScaler"),
                                       (not finite, "a loss is NaN or inf"),
                                       (not weights_finite, "a weight is NaN or inf"),
                                       (observed == 0, "no step overflowed at the forced scale"),
                                       (mp.skipped_steps != observed,
                                        f"counted {mp.skipped_steps} skipped steps, but {observed} steps after the "
                                        f"first left the weights unchanged"),
                                       (not learned, "the loss did not fall after the skipped steps")) if bad]
    figure = (f"{mp.skipped_steps} skipped steps counted, {observed} later steps left the weights unchanged; loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}, all finite: {finite and weights_finite}; final scale "
              f"{scales[-1]:.0f}" + ("; the first step was skipped too (uncountable)" if unchanged[0] else ""))
    item = f"{'tiny [dry: CPU fp16]' if ctx.dry else 'dialogue_1b'}, {steps} steps of {batch} x {seq}, scale forced " \
           f"to 2^24 after step 1"
    return [Row(CHECK, item, figure, "no NaN/inf; skipped steps counted = steps that left the weights unchanged; "
                "training goes on", ok, "; ".join(problems), value=float(mp.skipped_steps),
                details={"losses": losses, "scales": scales, "unchanged": unchanged,
                         "scaler": type(scaler).__name__})]
