"""Bytes sent to reduce gradients per step and step time, with gradient compression against without, for
disttrain_fsdp and disttrain_ddp, in one run.

    python bench/compressed_traffic.py              # 2 CPU processes (gloo), fp32, Llama hidden 256 x 4 layers
    python bench/compressed_traffic.py --smoke      # tiny sizes, a few steps

Prints, per strategy and ``gradient_compression`` (None, "bf16", "int8"): the bytes each rank sent per step (counted
by the strategy: ``strategy.engine.comm_bytes()``) and the median step time, each as a ratio against the same
strategy uncompressed (target: bytes <= 0.5x). The variants are interleaved (``--rounds``) in one pair of processes,
so that machine noise hits them alike. On CPU, gloo over loopback is not the bottleneck that a network is: the step
time shows the cost of quantising, not the saving of a slow link.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_model_args, batches, build_model, sync, torchrun  # noqa: E402
from tables import write_table  # noqa: E402

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
VARIANTS = [(strategy, kind) for strategy in ("disttrain_fsdp", "disttrain_ddp") for kind in (None, "bf16", "int8")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (after 2 warm-up steps)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps: checks the bench runs")
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # set for the child processes
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.seq, args.batch, args.steps, args.rounds = 64, 2, 32, 2, 3, 1
    return args


def run_variant(args, strategy: str, kind: str | None) -> dict:
    """One variant in a fresh Fabric on the existing process group: median step seconds and bytes per step."""
    import lightning as L

    import disttrain

    cls = disttrain.fabric.FSDPStrategy if strategy == "disttrain_fsdp" else disttrain.fabric.DDPStrategy
    fabric = L.Fabric(accelerator=args.device, devices=args.devices, strategy=cls(gradient_compression=kind),
                      precision=args.precision)
    fabric.launch()  # under torchrun: joins (the first time, creates) the process group
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    data = batches(args, fabric.device)
    warmup, times = 2, []
    for step in range(warmup + args.steps):
        if step == warmup:
            sent = fabric.strategy.engine.comm_bytes()
        ids = data[step % len(data)]
        fabric.barrier()
        start = time.perf_counter()
        fabric.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        sync(fabric.device)
        fabric.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {"seconds": times, "bytes": (fabric.strategy.engine.comm_bytes() - sent) / args.steps}


def child(args) -> None:
    import torch.distributed as dist

    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for strategy, kind in VARIANTS:
            got = run_variant(args, strategy, kind)
            mine = results.setdefault(f"{strategy}:{kind}", {"seconds": [], "bytes": got["bytes"]})
            mine["seconds"] += got["seconds"]
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)


def main() -> None:
    args = parse_args()
    if args.result is not None:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        torchrun([os.path.abspath(__file__), *sys.argv[1:], "--result", result], args.devices)
        with open(result) as f:
            results = json.load(f)
    rows = []
    for strategy, kind in VARIANTS:
        run, base = results[f"{strategy}:{kind}"], results[f"{strategy}:None"]
        ms, base_ms = statistics.median(run["seconds"]) * 1e3, statistics.median(base["seconds"]) * 1e3
        rows.append([strategy, kind or "none", run["bytes"] / 1e6, run["bytes"] / base["bytes"], ms, ms / base_ms])
    setup = (f"{args.devices} x {args.device}, {args.precision}, Llama hidden {args.hidden} x {args.layers} layers, "
             f"seq {args.seq}, batch {args.batch}/rank; {args.steps} steps x {args.rounds} rounds")
    columns = ["strategy", "compression", "MB sent/step/rank", "bytes ratio", "ms/step", "time ratio"]
    print(f"compressed gradient traffic ({setup}); target: bytes ratio <= 0.5")
    print(" | ".join(columns))
    for r in rows:
        print(f"{r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f}x | {r[4]:.1f} | {r[5]:.2f}x")
    write_table("compressed_traffic", "Gradient bytes and step time, compressed vs not", setup, columns, rows,
                bars=["bytes ratio"], fmt={"MB sent/step/rank": ".3f", "bytes ratio": ".3f", "ms/step": ".1f",
                                           "time ratio": ".2f"},
                out_dir=args.out_dir)


if __name__ == "__main__":
    main()
