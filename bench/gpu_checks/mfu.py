"""Check 1: MFU of the dialogue LLM's 1B config and of a full-width slice of its 10B config, as ``Throughput``
reports it, under ``disttrain_fsdp`` on one device with bf16-mixed and SDPA attention. Below the target, one
step is profiled and the report says what the time is spent on."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from gpu_checks.common import Context, Row, build_llama, fabric, guarded, learnable_batches, model_args, recipe
from gpu_checks.training import profile, profile_summary, steps_needed, train_step

CHECK = "1 MFU"
TARGET = 0.45  # torchtitan reports ~40-50% MFU for Llama models of this scale on Hopper (bf16, FSDP2)
SLICE_LAYERS = 4  # the issue allows 2-4; more blocks weigh the embedding and LM head (a lookup, a 32k-wide GEMM) less
MAX_ACCUMULATION = 8  # micro-steps per optimizer step on one GPU; the configs' global batches need more (time)
MEASURED_STEPS = 4
DRY_PEAK = 1e12  # a CPU has no datasheet peak: the dry run divides by this nominal figure (its MFU is not judged)


def cases(dry: bool) -> list[dict[str, Any]]:
    """The two models, each with the sequence length, micro-batch and accumulation of its config."""
    out = []
    for item, config, layers in (("dialogue_1b (22 layers, seq 2048)", "configs/nlp/dialogue_1b.yaml", None),
                                 (f"dialogue_10b {SLICE_LAYERS}-layer slice, full width (seq 4096)",
                                  "configs/nlp/dialogue_10b.yaml", SLICE_LAYERS)):
        if dry:
            out.append({"item": item + " [dry: tiny]", "args": model_args(config, 2, dry=True), "seq": 32, "micro": 2,
                        "accumulation": 2, "steps": 2})
            continue
        train, data = recipe(config)["train"], recipe(config)["data"]
        micro = int(train["micro_batch_size"])
        out.append({"item": item, "args": model_args(config, layers), "seq": int(data["seq_len"]), "micro": micro,
                    "accumulation": max(1, min(MAX_ACCUMULATION, int(train["global_batch_size"]) // micro)),
                    "steps": MEASURED_STEPS})
    return out


def measure(ctx: Context, case: dict[str, Any]) -> Row:
    import disttrain
    from disttrain.callbacks import Throughput, apply_fast_attention

    device = ctx.device
    f = fabric(ctx, disttrain.fabric.FSDPStrategy(), "bf16-mixed")
    model = build_llama(case["args"], device)
    attention = sorted(set(apply_fast_attention(model, device=device).values()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    model, optimizer = f.setup(model, optimizer)
    seq, micro, acc = case["seq"], case["micro"], case["accumulation"]
    tp = Throughput(transformer=model.module.config, every_n_steps=steps_needed(case["steps"]),
                    seq_len=seq, peak_flops=DRY_PEAK if ctx.dry else None)
    data = learnable_batches(case["args"]["vocab_size"], micro, seq, acc, device)
    losses = []
    for _ in range(steps_needed(case["steps"])):
        losses.append(train_step(f, model, optimizer, data).item())
        tp.step(f, tokens=micro * seq * acc, samples=micro * acc)
    metrics = dict(tp.metrics)
    mfu = metrics.get("throughput/mfu")
    details: dict[str, Any] = {
        "tokens_per_step": micro * seq * acc, "micro_batch": micro, "seq_len": seq, "accumulation": acc,
        "measured_steps": case["steps"], "attention": attention, "losses": losses,
        "tokens_per_s": metrics.get("throughput/tokens_per_s"),
        "tflops_per_device": metrics.get("throughput/tflops_per_device"),
        "peak_memory_mib": metrics.get("memory/peak_mib"),
        "peak_flops": DRY_PEAK if ctx.dry else "H200/H100 dense bf16 from Throughput's table",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    ok = mfu is not None and mfu >= TARGET
    reason = ""
    if mfu is None:
        reason = "Throughput reported no MFU (no peak FLOP/s for this device in its table)"
    elif not ok or ctx.dry:
        one_step = learnable_batches(case["args"]["vocab_size"], micro, seq, min(acc, 2), device, seed=1)
        prof = profile(lambda: train_step(f, model, optimizer, one_step), device)
        details["profile"] = prof
        if not ok:
            reason = (f"{TARGET - mfu:.1%} short of {TARGET:.0%}; profile of one step ({len(one_step)} micro-steps): "
                      f"{profile_summary(prof)}")
    figure = "-" if mfu is None else (f"MFU {mfu:.1%}, {metrics['throughput/tflops_per_device']:.0f} TFLOP/s, "
                                      f"{metrics['throughput/tokens_per_s']:,.0f} tokens/s, peak "
                                      f"{metrics['memory/peak_mib'] / 1024:.1f} GiB")
    return Row(CHECK, case["item"], figure, f"MFU >= {TARGET:.0%} (bf16-mixed, SDPA, disttrain_fsdp, 1 device)",
               ok if mfu is not None else False, reason, kind="device", value=mfu, details=details)


def run(ctx: Context) -> Iterator[Row]:
    for case in cases(ctx.dry):
        yield from guarded(CHECK, case["item"], f"MFU >= {TARGET:.0%}", lambda: measure(ctx, case))
