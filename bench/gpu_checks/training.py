"""A one-device training loop on a Fabric-wrapped causal LM, and the profile of one of its steps: shared by the
MFU, FP8, fp16, offload and planner checks."""

from __future__ import annotations

import re
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from gpu_checks.common import sync

# Kernel families by name, for the profile's summary (cuBLAS/CUTLASS GEMMs on Hopper are "sm90_xmma", "nvjet",
# "cutlass"; torch's FlashAttention-2 kernels are "flash_fwd"/"flash_bwd"; the fused optimizer "multi_tensor").
KERNEL_FAMILIES = (("matmul", r"gemm|xmma|cutlass|nvjet|wgmma|matmul|_mm_"),
                   ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
                   ("optimizer", r"adam|multi_tensor|foreach"),
                   ("copy/cast", r"copy|cast|convert|memcpy|to_copy"))


def train_step(fabric: Any, model: Any, optimizer: Any, micro_batches: list[torch.Tensor],
               sync_control: bool = True) -> torch.Tensor:
    """One optimizer step over ``micro_batches`` (gradient accumulation: no gradient sync on all but the last
    micro-step), loss = the model's own causal-LM loss of each micro-batch. Returns the step's mean loss (a
    tensor on the device: reading it is the caller's choice, since ``.item()`` waits for the device)."""
    n = len(micro_batches)
    total = torch.zeros((), device=micro_batches[0].device)
    for i, ids in enumerate(micro_batches):
        skip_sync = sync_control and n > 1 and i < n - 1
        with fabric.no_backward_sync(model, enabled=True) if skip_sync else nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
            fabric.backward(loss / n if n > 1 else loss)
        total += loss.detach().float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / n


def kernel_time_us(event: Any) -> float:
    """Self device time of a profiler event: ``self_device_time_total`` (torch >= 2.4); older releases called it
    ``self_cuda_time_total``."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _is_device_event(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).upper().endswith("CUDA")


def profile(step: Callable[[], Any], device: torch.device, top: int = 10) -> dict[str, Any]:
    """Run ``step()`` once under ``torch.profiler`` and say where the time went: the ``top`` kernels by device
    time (CPU ops on a CPU dry run), the share of each kernel family, and how busy the device was over the step's
    wall time (an idle device points at launch overhead or host work, not at slow kernels)."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        step()
        sync(device)
    wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.key_averages()
    if cuda:
        kernels = [(e.key, kernel_time_us(e), e.count) for e in events if _is_device_event(e)]
    else:
        kernels = [(e.key, float(e.self_cpu_time_total), e.count) for e in events]
    kernels = [k for k in kernels if k[1] > 0]
    kernels.sort(key=lambda k: -k[1])
    busy = sum(t for _, t, _ in kernels)
    families: dict[str, float] = {}
    for name, t, _ in kernels:
        family = next((f for f, pattern in KERNEL_FAMILIES if re.search(pattern, name, re.I)), "other")
        families[family] = families.get(family, 0.0) + t
    return {
        "what": "CUDA kernels by device time" if cuda else "CPU ops by self CPU time (dry run)",
        "wall_ms": wall_us / 1e3,
        "busy_ms": busy / 1e3,
        "busy_fraction": busy / wall_us if wall_us else 0.0,
        "families": {f: t / busy for f, t in sorted(families.items(), key=lambda kv: -kv[1])} if busy else {},
        "top": [{"name": name[:110], "ms": t / 1e3, "share": t / busy if busy else 0.0, "calls": count}
                for name, t, count in kernels[:top]],
    }


def profile_summary(prof: dict[str, Any]) -> str:
    families = ", ".join(f"{f} {share:.0%}" for f, share in prof["families"].items())
    return (f"device busy {prof['busy_fraction']:.0%} of the step's wall time ({prof['busy_ms']:.0f} of "
            f"{prof['wall_ms']:.0f} ms); by family: {families}")


def steps_needed(measured: int) -> int:
    """Optimizer steps to run for ``measured`` steps in Throughput's window: its first step only starts the clock."""
    return measured + 1


def optional_import(name: str) -> Optional[str]:
    """None when ``name`` imports, else the reason it does not (one line)."""
    try:
        __import__(name)
        return None
    except Exception as e:  # noqa: BLE001  (any failure to import means: not usable here)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
