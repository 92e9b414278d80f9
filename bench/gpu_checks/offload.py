"""Check 5: CPU offload. ``disttrain_fsdp_offload`` against ``disttrain_fsdp`` (and, when DeepSpeed is carried,
``disttrain_zero3_offload`` against ``disttrain_zero3``) on the 1B config: step time, the device's peak allocation
during training and the host's resident-set peak, next to the planner's estimate of both."""

from __future__ import annotations

import statistics
from typing import Any, Iterator

import torch

from gpu_checks.common import (Context, DevicePeak, HostPeak, Row, build_llama, fabric, free_memory, gib, guarded,
                               learnable_batches, model_args, skipped, timed)
from gpu_checks.training import optional_import, train_step

CHECK = "5 offload"
DEVICE_RATIO = 0.5  # offloading the model states (16 bytes per parameter) must at least halve the device peak


def _strategy(name: str) -> Any:
    import disttrain

    if name == "disttrain_fsdp":
        return disttrain.fabric.FSDPStrategy()
    if name == "disttrain_fsdp_offload":
        return disttrain.fabric.FSDPStrategy(cpu_offload=True)
    # DeepSpeed's CPU Adam needs a JIT build of minutes on a fresh machine: the offloaded optimizer is torch's AdamW.
    offload = {"offload_optimizer": "cpu", "offload_parameters": "cpu", "cpu_adam": False} if name.endswith(
        "_offload") else {}
    return disttrain.fabric.ZeroStrategy(micro_batch_size=1, **offload)


def measure(ctx: Context, name: str, args: dict[str, Any], batches: list[torch.Tensor], warmup: int) -> dict:
    from disttrain.planner import estimate

    zero = name.startswith("disttrain_zero3")
    with HostPeak() as host:
        f = fabric(ctx, _strategy(name), "bf16-mixed")
        with f.init_module(empty_init=True):  # meta device (FSDP) or zero.Init (ZeRO-3): never whole on a device
            model = build_llama(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = f.setup(model, optimizer)
        times = []
        with DevicePeak(ctx.device) as device_peak:
            for ids in batches:
                times.append(timed(lambda: train_step(f, model, optimizer, [ids], sync_control=not zero), ctx.device))
    e = estimate(args, name, world_size=1, micro_batch=batches[0].shape[0], seq_len=batches[0].shape[1],
                 precision="bf16-mixed")
    return {"step_s": statistics.median(times[warmup:]), "device_peak": device_peak.above_start,
            "host_peak": host.above_start, "host_method": host.method, "estimate_device": e.device,
            "estimate_host": e.host}


def run(ctx: Context) -> Iterator[Row]:
    args = model_args("configs/nlp/dialogue_1b.yaml", dry=ctx.dry)
    seq, steps, warmup = (32, 3, 1) if ctx.dry else (2048, 3, 1)
    batches = learnable_batches(args["vocab_size"], 1, seq, steps, ctx.device)
    target = f"device peak with offload <= {DEVICE_RATIO:.0%} of without; the host holds more"
    pairs = [("disttrain_fsdp", "disttrain_fsdp_offload"), ("disttrain_zero3", "disttrain_zero3_offload")]
    for plain, offloaded in pairs:
        item = f"{offloaded} vs {plain}, {'tiny [dry]' if ctx.dry else 'dialogue_1b'}, 1 x {seq} tokens, bf16-mixed"
        if plain.startswith("disttrain_zero3"):
            missing = optional_import("deepspeed")
            if missing:
                yield skipped(CHECK, item, target, f"DeepSpeed cannot be imported ({missing}); carry it: make "
                                                   "gpu-wheels")
                continue
        yield from guarded(CHECK, item, target, lambda: compare(ctx, plain, offloaded, args, batches, warmup, item,
                                                                target))


def compare(ctx: Context, plain: str, offloaded: str, args: dict[str, Any], batches: list[torch.Tensor], warmup: int,
            item: str, target: str) -> Row:
    a = measure(ctx, plain, args, batches, warmup)
    free_memory()  # the first variant's model and optimizer are gone before the second is built
    b = measure(ctx, offloaded, args, batches, warmup)
    free_memory()
    if a["device_peak"] is None:  # CPU dry run: no device allocator to read
        ratio, ok = None, True
    else:
        ratio = b["device_peak"] / max(a["device_peak"], 1)
        ok = ratio <= DEVICE_RATIO and b["host_peak"] > a["host_peak"]
    figure = (f"step {b['step_s']:.2f} s vs {a['step_s']:.2f} s ({b['step_s'] / a['step_s']:.1f}x); device peak "
              f"{gib(b['device_peak'])} vs {gib(a['device_peak'])}; host RSS peak {gib(b['host_peak'])} vs "
              f"{gib(a['host_peak'])} (planner: device {gib(b['estimate_device'])} vs "
              f"{gib(a['estimate_device'])}, host {gib(b['estimate_host'])})")
    reason = "" if ok else f"device peak with offload is {ratio:.0%} of without, or the host holds no more"
    return Row(CHECK, item, figure, target, ok, reason, kind="device", value=ratio, details={plain: a, offloaded: b})
