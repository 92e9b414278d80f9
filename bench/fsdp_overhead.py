"""Step time of disttrain_fsdp against a hand-written FSDP2 loop on the same model and data, in one run.

    python bench/fsdp_overhead.py                       # 2 CPU processes (gloo), fp32
    python bench/fsdp_overhead.py --device cuda --devices 1 --precision bf16-mixed --hidden 2048 --layers 8
    python bench/fsdp_overhead.py --smoke               # tiny sizes: checks that it runs

Prints median ms/step of: the hand-written loop (fully_shard per decoder layer + root, AdamW), disttrain_fsdp
through Fabric, and disttrain_fsdp through the Trainer; each ratio against the hand-written loop (target
<= 1.05); and per-rank parameter + gradient + optimizer bytes against the ideal 1/N of the unsharded total.
The three are interleaved (two rounds) so that machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    add_model_args,
    batches,
    build_model,
    count_params,
    parse_smoke,
    timed_loop,
    torchrun,
    trainer_step_times,
)
from tables import write_table  # noqa: E402

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=12, help="timed steps per round (after 3 warm-up steps)")
    return parse_smoke(p, hidden=64, layers=2, seq=32, batch=2, rounds=1, steps=1)


def hand_written(args, device, data) -> tuple[list[float], int]:
    """What a user writes without disttrain: fully_shard each decoder layer, then the root; plain loop."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(args).to(device)
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if args.precision == "bf16-mixed" else {}
    for layer in model.model.layers:
        fully_shard(layer, **mp)
    fully_shard(model, **mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    times = timed_loop(step, data, device)
    return times, 0


def with_fabric(args, device, data) -> tuple[list[float], int]:
    import lightning as L

    import disttrain  # noqa: F401
    from disttrain.parallel import rank_state_bytes

    fabric = L.Fabric(accelerator=device.type, devices=args.devices, strategy="disttrain_fsdp",
                      precision=args.precision)
    fabric.launch()  # processes exist already (torchrun): this only connects Fabric to them
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = fabric.setup(model, opt)
    measured = {}

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        if not measured:
            measured.update(rank_state_bytes(model, opt))  # grads still held: params + grads + optimizer
        opt.zero_grad()

    times = timed_loop(step, data, device)
    return times, measured["total"]


def with_trainer(args, device, data) -> tuple[list[float], int]:
    return trainer_step_times(args, device, data, "disttrain_fsdp"), 0


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # launch ourselves on N processes
        torchrun([os.path.abspath(__file__), *sys.argv[1:]], args.devices)
        return
    device = torch.device(args.device, int(os.environ["LOCAL_RANK"])) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    data = batches(args, device)
    runs = {"hand-written FSDP2": hand_written, "disttrain_fsdp (Fabric)": with_fabric,
            "disttrain_fsdp (Trainer)": with_trainer}
    times: dict[str, list[float]] = {name: [] for name in runs}
    state_bytes = 0
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t, total = fn(args, device, data)
            times[name] += t
            state_bytes = total or state_bytes
    n_params = count_params(args)
    full_state = 4 * 4 * n_params  # fp32 params + grads + AdamW's two moments
    per_rank = [0] * dist.get_world_size()
    dist.all_gather_object(per_rank, state_bytes)
    if dist.get_rank() == 0:
        setup = (f"{args.devices} x {device.type}, Llama {args.layers}x{args.hidden} ({n_params / 1e6:.1f}M params), "
                 f"micro batch {args.batch}x{args.seq}, {args.precision}, {args.rounds} rounds x {args.steps} timed"
                 " steps")
        print(f"\nfsdp_overhead: {setup}")
        base = statistics.median(times["hand-written FSDP2"])
        rows = []
        for name, t in times.items():
            med = statistics.median(t)
            rows.append([name, med * 1e3, med / base])
            print(f"  {name:<26} {med * 1e3:8.1f} ms/step   ratio {med / base:.3f}"
                  + ("   (target <= 1.05)" if name != "hand-written FSDP2" else ""))
        ideal = full_state / args.devices
        notes = ["ratio: median step time over the hand-written FSDP2 loop's in the same run (target <= 1.05)"]
        for rank, b in enumerate(per_rank):
            print(f"  rank {rank} params+grads+optimizer {b / 2**20:8.2f} MiB   ideal 1/{args.devices} of "
                  f"{full_state / 2**20:.2f} MiB = {ideal / 2**20:.2f} MiB   ratio {b / ideal:.3f}")
            notes.append(f"rank {rank} params+grads+optimizer {b / 2**20:.2f} MiB = {b / ideal:.3f} x the ideal"
                         f" 1/{args.devices} of {full_state / 2**20:.2f} MiB")
        write_table("fsdp_overhead", "disttrain_fsdp against hand-written FSDP2", setup, ["variant", "ms/step", "ratio"],
                    rows, bars=("ms/step", "ratio"), reference={"ratio": 1.0}, fmt={"ms/step": ".1f", "ratio": ".3f"},
                    notes=notes, out_dir=args.out_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
