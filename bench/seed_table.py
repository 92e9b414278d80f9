"""The shape of the published comparison "DDP / FSDP, standard attention / FlashAttention-2" (a 10B model on 32
A100s), on CPU, in one run.

    python bench/seed_table.py                         # 2 CPU processes (gloo), Llama 3x1024, seq 2048, ~2 min
    python bench/seed_table.py --seq 4096 --layers 2   # a longer sequence
    python bench/seed_table.py --smoke                 # tiny sizes: checks that it runs
    python bench/seed_table.py --device cuda --devices 8 --precision bf16-mixed --hidden 2048 --heads 16 --layers 16 --seq 8192 --vocab 32000

Rows, all through Lightning Fabric with the registered strategies, same model, data and AdamW:
  DDP + standard attention       disttrain_ddp,  HF Llama with attn_implementation="eager"
  FSDP + standard attention      disttrain_fsdp, the same eager model (built on the meta device, sharded)
  FSDP + FlashAttention (SDPA)   disttrain_fsdp, switched by disttrain.callbacks.attention.apply_fast_attention
                                 (SDPA on CPU; flash-attn / SDPA's FlashAttention-2 kernel on a GPU)
Per-rank peak memory and step time are printed as ratios to the DDP row, next to the published figures (32 A100s,
10B model: 38 / 22 / 16 GB per card, speed 1x / 1.2x / 2.1x). Only the shape can match: here the model is tiny,
so the sequence (attention) dominates memory, while at 10B parameters the sharded state does.
Each row runs in fresh processes, so one row's freed-but-resident memory cannot inflate the next one's peak.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_model_args, each_variant, parse_smoke, run_variants, sync  # noqa: E402
from tables import write_table  # noqa: E402

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

ROWS = {  # row -> (strategy, fast attention)
    "DDP + standard attention": ("disttrain_ddp", False),
    "FSDP + standard attention": ("disttrain_fsdp", False),
    "FSDP + FlashAttention (SDPA)": ("disttrain_fsdp", True),
}
PUBLISHED = {"DDP + standard attention": (38, 1.0), "FSDP + standard attention": (22, 1.2),
           "FSDP + FlashAttention (SDPA)": (16, 2.1)}  # GB per card, training speed


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(hidden=1024, layers=3, seq=2048, batch=1, rounds=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2, help="timed steps per round (after 1 warm-up step)")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # set for the child processes
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parse_smoke(p, hidden=64, layers=1, seq=64, heads=2, vocab=128, steps=1)


# Why the kernel's resident high-water mark: torch keeps no peak statistic for CPU memory and tracemalloc does not
# see its allocations. VmHWM is reset (clear_refs) once Fabric and the process group are up, and the baseline RSS
# taken then, so a rank's peak counts what the row itself holds: model state, activations, communication buffers.
def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_llama(args):
    """A small Llama whose sharded state weighs next to its attention activations (wide layers, few heads, a small
    vocabulary so the logits do not dominate), as in the 10B model of the published figures; on 2 CPU cores it must
    stay small."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         intermediate_size=int(args.hidden * 8 / 3) // 64 * 64, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


def count_params(args) -> int:
    with torch.device("meta"):  # sizes only: nothing allocated
        return sum(p.numel() for p in build_llama(args).parameters())


def child(args: argparse.Namespace) -> None:
    """The row(s) on a fresh process group; rank 0 writes every rank's peak memory and its step times to each row's
    result."""
    for row, result in each_variant(args.row, args.result):
        run_row(args, row, result)


def run_row(args: argparse.Namespace, row: str, result: str) -> None:
    import lightning as L

    import disttrain  # noqa: F401  (registers disttrain_ddp / disttrain_fsdp)
    from disttrain.callbacks.attention import apply_fast_attention, format_report

    strategy, fast = ROWS[row]
    fabric = L.Fabric(accelerator=args.device, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()  # processes exist already (torchrun): this only connects Fabric to them
    cuda = fabric.device.type == "cuda"
    g = torch.Generator().manual_seed(100 + fabric.global_rank)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps + 1)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _status_mib("VmRSS")
        _reset_peak()
    # FSDP builds on the meta device so that no rank ever holds the whole model (the point of FSDP)
    with fabric.init_module(empty_init=strategy == "disttrain_fsdp"):
        model = build_llama(args)  # "standard attention": eager softmax(QK^T/sqrt(d))V, (T, T) scores held
    if fast:
        report = apply_fast_attention(model, device=fabric.device)
        if fabric.global_rank == 0:
            print(format_report(report, fabric.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = fabric.setup(model, opt)

    times = []
    for i, ids in enumerate(data):
        ids = fabric.to_device(ids)
        sync(fabric.device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        sync(fabric.device)
        if i:  # the first step is a warm-up (optimizer state allocation, kernel selection)
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _status_mib("VmHWM") - before
    peaks = [None] * fabric.world_size
    dist.all_gather_object(peaks, peak)
    if fabric.global_rank == 0:
        with open(result, "w") as f:
            json.dump({"times": times, "peaks": peaks}, f)
    dist.barrier()


def main() -> None:
    args = parse_args()
    if args.row is not None:
        return child(args)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.devices))}
    runs = run_variants(__file__, list(ROWS), "--row", args.devices, args.rounds, env=env, smoke_together=True)
    times = {row: [t for out in outs for t in out["times"]] for row, outs in runs.items()}
    peaks = {row: [max(rank) for rank in zip(*(out["peaks"] for out in outs))] for row, outs in runs.items()}
    base = "DDP + standard attention"
    base_mem, base_time = max(peaks[base]), statistics.median(times[base])
    print(f"\nseed_table: {args.devices} x {args.device}, Llama {args.layers}x{args.hidden}, {args.heads} heads, vocab {args.vocab} "
          f"({count_params(args) / 1e6:.1f}M params), seq {args.seq}, micro batch {args.batch} per rank, "
          f"{args.precision}, AdamW, {args.rounds} round(s) x {args.steps} timed steps, each row in fresh processes")
    unit = "device peak MiB" if args.device == "cuda" else "peak MiB (RSS)"
    print(f"  {'row':<30} | {unit + ' per rank':>28} {'vs DDP':>7} | {'ms/step':>8} {'speed':>6} "
          f"| published: GB/card (vs DDP), speed")
    table = []
    for row in ROWS:
        mem, t = max(peaks[row]), statistics.median(times[row])
        gb, speed = PUBLISHED[row]
        per_rank = ", ".join(f"{p:.0f}" for p in peaks[row])
        print(f"  {row:<30} | {per_rank:>28} {mem / base_mem:>6.2f}x | {t * 1e3:>8.0f} {base_time / t:>5.2f}x "
              f"| {gb} GB ({gb / PUBLISHED[base][0]:.2f}x), {speed}x")
        table.append([row, per_rank, mem / base_mem, t * 1e3, base_time / t, f"{gb} GB ({gb / PUBLISHED[base][0]:.2f}x)",
                      speed])
    write_table("seed_table", "DDP / FSDP / FlashAttention beside the published 10B figures",
                f"{args.devices} x {args.device}, Llama {args.layers}x{args.hidden}, seq {args.seq}, micro batch"
                f" {args.batch} per rank, {args.precision}", ["row", unit + " per rank", "memory vs DDP", "ms/step",
                                                              "speed vs DDP", "published memory", "published speed"],
                table, bars=("memory vs DDP", "speed vs DDP"), reference={"memory vs DDP": 1.0, "speed vs DDP": 1.0},
                fmt={"memory vs DDP": ".2f", "ms/step": ".0f", "speed vs DDP": ".2f"},
                notes=["memory: the larger rank's peak over the memory before the model was built; speed: DDP's step"
                       " time divided by the row's"], out_dir=args.out_dir)
    print("  (memory: the larger rank's peak over the memory before the model was built; speed: DDP's step time "
          "divided by the row's)")


if __name__ == "__main__":
    main()
