"""Peak memory and time of PyTorch SDPA against eager attention, measured side by side in one run.

    python bench/attention.py                      # CPU: forward + backward, seq 1k..8k, ~1-2 min on 2 cores
    python bench/attention.py --forward-only       # CPU: forward only (no_grad)
    python bench/attention.py --seqs 1024 4096     # other sequence lengths
    python bench/attention.py --smoke              # tiny sizes: checks that it runs

Eager is ``softmax(Q K^T / sqrt(d)) V`` written in torch (causal mask, as in a decoder); SDPA is
``F.scaled_dot_product_attention(q, k, v, is_causal=True)``. Shapes: batch 1, 8 heads, head dim 64, fp32 on CPU.
The memory figure is the extra peak resident memory of the attention call(s) over the inputs (and their
gradients' buffers), in MiB; the target is >= 10x less for SDPA at 8k.

On a machine with CUDA the same table is printed for the GPU (bf16): SDPA restricted to its flash backend
(FlashAttention-2 inside PyTorch, via ``torch.nn.attention.sdpa_kernel``) and, when the flash-attn package is
installed, ``flash_attn_func`` itself, against eager; memory from ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_smoke  # noqa: E402
from tables import write_table  # noqa: E402

HEADS, HEAD_DIM = 8, 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--forward-only", action="store_true", help="no backward (under torch.no_grad)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per measurement after one warm-up (1 from 4k up on CPU, to stay near 2 min)")
    p.add_argument("--skip-cuda", action="store_true")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG tables go (default: bench/out)")
    p.add_argument("--one", nargs=2, metavar=("IMPL", "SEQ"), help=argparse.SUPPRESS)  # a child measurement
    return parse_smoke(p, seqs=[256], repeats=1)


def eager_attention(q, k, v):
    T = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T, T): the memory SDPA never holds
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def sdpa_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def inputs(seq: int, device, dtype, grad: bool):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, HEADS, seq, HEAD_DIM, generator=g, device=device, dtype=dtype).requires_grad_(grad)
            for _ in range(3)]


def run_once(fn, qkv, backward: bool) -> None:
    if backward:
        fn(*qkv).sum().backward()
    else:
        with torch.no_grad():
            fn(*qkv)


# ---------------------------------------------------------------------------------------------- CPU (subprocess)
# Why RSS and a fresh process per measurement: torch's CPU allocations are invisible to tracemalloc (they are not
# made through Python's allocator), and torch keeps no CPU peak statistic. The kernel does: VmHWM, the resident
# high-water mark. Each measurement runs in its own process so no earlier run's freed-but-resident pages hide
# (or add to) its peak; inside it, the high-water mark is reset (`echo 5 > /proc/self/clear_refs`) once the inputs
# exist, so the peak counts only what the attention calls allocate. Without clear_refs (not Linux, or not
# permitted), ru_maxrss of the fresh process is the fallback, measured against the RSS before the calls.

def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(impl: str, seq: int, backward: bool, repeats: int) -> None:
    fn = {"eager": eager_attention, "sdpa": sdpa_attention}[impl]
    qkv = inputs(seq, "cpu", torch.float32, backward)
    if backward:  # allocate the input gradients first: they are the same for both and not attention's cost
        for t in qkv:
            t.grad = torch.zeros_like(t)
    before = _rss_mib("VmRSS")
    exact = _reset_peak()
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        run_once(fn, qkv, backward)
        if i:  # the first call is a warm-up (thread pool, kernel selection)
            times.append(time.perf_counter() - t0)
    peak = _rss_mib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mib": peak - before, "time_s": statistics.median(times), "exact": exact}))


def cpu_table(args) -> None:
    backward = not args.forward_only
    rows = []
    for seq in args.seqs:
        out = {}
        for impl in ("eager", "sdpa"):  # both in the same run, each in a fresh process
            cmd = [sys.executable, os.path.abspath(__file__), "--one", impl, str(seq), "--repeats",
                   str(args.repeats if seq < 4096 else 1)] + (["--forward-only"] * (not backward))
            res = subprocess.run(cmd, check=True, capture_output=True, text=True)
            out[impl] = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append((seq, out))
    how = "forward + backward" if backward else "forward only"
    exact = all(o[i]["exact"] for _, o in rows for i in o)
    print(f"\nattention on CPU ({torch.get_num_threads()} threads), batch 1 x {HEADS} heads x head dim {HEAD_DIM}, "
          f"fp32, causal, {how}; peak = extra resident memory over the inputs "
          f"({'VmHWM after clear_refs' if exact else 'ru_maxrss'}), fresh process per cell")
    print(f"  {'seq':>6} | {'eager MiB':>10} {'sdpa MiB':>9} {'mem ratio':>9} | {'eager ms':>9} {'sdpa ms':>8} "
          f"{'speed-up':>8}")
    table = []
    for seq, o in rows:
        e, s = o["eager"], o["sdpa"]
        print(f"  {seq:>6} | {e['peak_mib']:>10.0f} {s['peak_mib']:>9.1f} {e['peak_mib'] / max(s['peak_mib'], 0.1):>8.1f}x"
              f" | {e['time_s'] * 1e3:>9.0f} {s['time_s'] * 1e3:>8.0f} {e['time_s'] / s['time_s']:>7.2f}x")
        table.append([f"seq {seq}", e["peak_mib"], s["peak_mib"], e["peak_mib"] / max(s["peak_mib"], 0.1),
                      e["time_s"] * 1e3, s["time_s"] * 1e3, e["time_s"] / s["time_s"]])
    last_seq, last = rows[-1]
    ratio = last["eager"]["peak_mib"] / max(last["sdpa"]["peak_mib"], 0.1)
    target = f"target: >= 10x less memory at {last_seq}: {'met' if ratio >= 10 else 'NOT met'} ({ratio:.1f}x)"
    print(f"  {target}")
    write_table("attention_cpu", "SDPA against eager attention (CPU)",
                f"{torch.get_num_threads()} threads, batch 1 x {HEADS} heads x head dim {HEAD_DIM}, fp32, causal, {how};"
                " fresh process per cell", ["sequence", "eager MiB", "sdpa MiB", "memory ratio", "eager ms", "sdpa ms",
                                            "speed-up"], table, bars=("memory ratio", "speed-up"),
                reference={"memory ratio": 10.0, "speed-up": 1.0}, out_dir=args.out_dir,
                fmt={"eager MiB": ".0f", "sdpa MiB": ".1f", "memory ratio": ".1f", "eager ms": ".0f",
                     "sdpa ms": ".0f", "speed-up": ".2f"},
                notes=[target, "memory: extra peak resident memory over the inputs ("
                       + ("VmHWM after clear_refs" if exact else "ru_maxrss") + ")"])


# ------------------------------------------------------------------------------------------------ CUDA (in process)

def cuda_table(args) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device, dtype = torch.device("cuda"), torch.bfloat16
    impls = {"eager": eager_attention}

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # only FlashAttention-2: fail rather than fall back
            return sdpa_attention(q, k, v)

    impls["sdpa flash (FA-2 in torch)"] = sdpa_flash
    try:
        from flash_attn import flash_attn_func

        # flash-attn takes (B, T, H, D)
        impls["flash-attn package"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    except ImportError:
        pass
    backward = not args.forward_only
    print(f"\nattention on {torch.cuda.get_device_name()}, batch 1 x {HEADS} heads x head dim {HEAD_DIM}, bf16, causal, "
          f"{'forward + backward' if backward else 'forward only'}; peak = torch.cuda.max_memory_allocated over inputs")
    names = list(impls)
    print("  " + f"{'seq':>6} | " + " ".join(f"{n + ' MiB':>28}" for n in names) + " | "
          + " ".join(f"{n + ' ms':>28}" for n in names))
    for seq in args.seqs:
        mem, ms = {}, {}
        for name, fn in impls.items():
            qkv = inputs(seq, device, dtype, backward)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run_once(fn, qkv, backward)  # warm-up, and the peak
            torch.cuda.synchronize()
            mem[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                run_once(fn, qkv, backward)
            end.record()
            torch.cuda.synchronize()
            ms[name] = start.elapsed_time(end) / args.repeats
            del qkv
            torch.cuda.empty_cache()
        e = names[0]
        print("  " + f"{seq:>6} | " + " ".join(f"{mem[n]:>14.0f} ({mem[e] / max(mem[n], 1e-3):>6.1f}x less)"
                                              for n in names) + " | "
              + " ".join(f"{ms[n]:>14.2f} ({ms[e] / ms[n]:>5.2f}x faster)" for n in names))


def main() -> None:
    args = parse_args()
    if args.one is not None:
        return child(args.one[0], int(args.one[1]), not args.forward_only, args.repeats)
    cpu_table(args)
    if torch.cuda.is_available() and not args.skip_cuda:
        cuda_table(args)


if __name__ == "__main__":
    main()
