"""Check 2: attention at 2k/4k/8k tokens, PyTorch SDPA restricted to its flash backend (FlashAttention-2 inside
PyTorch) against eager attention, forward + backward: time and peak memory. The flash-attn package is measured
too where it can run (it is never carried: see the report's list)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from gpu_checks.common import Context, DevicePeak, HostPeak, Row, free_memory, mib, skipped, timed

CHECK = "2 attention"
# The 10B config's attention (40 heads of 128) on one sequence, causal, bf16.
HEADS, HEAD_DIM = 40, 128
SEQS = (2048, 4096, 8192)
MEMORY_TARGET = 10.0  # at the longest sequence: what bench/attention.py asks of SDPA on CPU too
REPEATS = 5


def _flash(fn: Callable) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def restricted(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # FlashAttention-2 only: fail rather than fall back
            return fn(q, k, v)
    return restricted


def implementations(ctx: Context) -> dict[str, Callable]:
    from attention import eager_attention, sdpa_attention  # bench/attention.py

    impls = {"eager": eager_attention, "sdpa flash": _flash(sdpa_attention)}
    from disttrain.callbacks import flash_attn_2_missing

    if flash_attn_2_missing(ctx.device) is None:
        from flash_attn import flash_attn_func

        impls["flash-attn"] = lambda q, k, v: flash_attn_func(  # takes (B, T, H, D)
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    return impls


def measure(fn: Callable, seq: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
            repeats: int) -> tuple[float, float]:
    """(median seconds, peak bytes over the inputs) of forward + backward at ``seq`` tokens."""
    from attention import run_once  # bench/attention.py

    g = torch.Generator(device=device).manual_seed(0)
    qkv = [torch.randn(1, heads, seq, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
           for _ in range(3)]
    for t in qkv:
        t.grad = torch.zeros_like(t)  # the same for every implementation: not attention's cost
    peak = DevicePeak(device) if device.type == "cuda" else HostPeak()
    with peak:
        run_once(fn, qkv, backward=True)  # warm-up and the peak
    times = [timed(lambda: run_once(fn, qkv, backward=True), device) for _ in range(repeats)]
    return statistics.median(times), float(peak.above_start or 0)


def run(ctx: Context) -> list[Row]:
    dry = ctx.dry
    seqs = (64, 128, 256) if dry else SEQS
    heads, head_dim = (2, 16) if dry else (HEADS, HEAD_DIM)
    dtype = torch.float32 if dry else torch.bfloat16
    impls = implementations(ctx)
    rows = []
    for seq in seqs:
        results = {}
        for name, fn in impls.items():
            results[name] = measure(fn, seq, heads, head_dim, ctx.device, dtype, 2 if dry else REPEATS)
            free_memory()  # this measurement's tensors are gone before the next one's peak is taken
        (e_t, e_m), (s_t, s_m) = results["eager"], results["sdpa flash"]
        speed, less = e_t / s_t, e_m / max(s_m, 1.0)
        longest = seq == seqs[-1]
        ok = speed > 1.0 and (less >= MEMORY_TARGET if longest else less > 1.0)
        target = ("faster and >= 10x less memory than eager" if longest else "faster and less memory than eager")
        figure = (f"flash {s_t * 1e3:.2f} ms vs eager {e_t * 1e3:.2f} ms ({speed:.1f}x faster); peak {mib(s_m)} vs "
                  f"{mib(e_m)} ({less:.1f}x less)")
        extra = {name: {"ms": t * 1e3, "peak_mib": m / 2**20} for name, (t, m) in results.items()}
        if "flash-attn" in results:
            f_t, f_m = results["flash-attn"]
            figure += f"; flash-attn {f_t * 1e3:.2f} ms, {mib(f_m)}"
        rows.append(Row(CHECK, f"{seq} tokens, 1 x {heads} heads x {head_dim}, "
                               f"{'fp32 [dry: CPU]' if dry else 'bf16'}, causal, fwd+bwd",
                        figure, target, ok, "" if ok else "flash is not faster, or not enough less memory",
                        kind="device", value=speed, details=extra))
    if "flash-attn" not in impls:
        from disttrain.callbacks import flash_attn_2_missing

        rows.append(skipped(CHECK, "flash-attn package (FlashAttention-2 proper)", "measured beside SDPA flash",
                            f"{flash_attn_2_missing(ctx.device)} (PyPI has flash-attn as source only; it needs a CUDA "
                            f"build of about an hour, which cannot be carried as a wheel)"))
    return rows
