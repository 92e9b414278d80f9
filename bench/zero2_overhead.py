"""Step time of disttrain_zero2 against a raw DeepSpeed stage-2 loop (``deepspeed.initialize``, then
``engine(ids)``, ``engine.backward``, ``engine.step``) on the same model, data and config, in one run.

    python bench/zero2_overhead.py                                # 2 CPU processes (gloo), fp32, 5 rounds
    python bench/zero2_overhead.py --device cuda --devices 1 --precision bf16-mixed --hidden 2048 --layers 8
    python bench/zero2_overhead.py --smoke                        # tiny sizes: checks that it runs

Each round is one launch (fresh processes) holding every engine at once: the raw loop and disttrain_zero2,
disttrain_zero1 and disttrain_zero2_offload through Fabric take their steps in turn, in a new order every step, so
the load of a shared machine hits them alike; then the Trainer's disttrain_zero2 runs between two runs of the raw
loop. Rows: the median step time over all rounds, its ratio to the raw loop's (target <= 1.05 for disttrain_zero2),
and the spread of that ratio over the rounds (each round's median against the raw loop's of the same round).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    add_model_args,
    batches,
    build_model,
    count_params,
    deepspeed_rank,
    parse_smoke,
    run_variants,
    sync,
    timed_loop,
    trainer_step_times,
)
from tables import write_table  # noqa: E402

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
RAW = "raw deepspeed stage 2"
FABRIC = ("disttrain_zero2", "disttrain_zero1", "disttrain_zero2_offload")
TRAINER = "disttrain_zero2 (Trainer)"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(rounds=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (after 3 warm-up steps)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # set for the child processes
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parse_smoke(p, hidden=64, layers=2, seq=32, batch=2, rounds=1, steps=1)


def raw_step(args, device):
    """DeepSpeed's own loop at stage 2, with the config disttrain_zero2 builds."""
    import deepspeed

    from disttrain.parallel.engines.deepspeed import ZeroOptions, zero_config

    config = zero_config(ZeroOptions(stage=2), precision=args.precision, micro_batch_size=args.batch,
                         accumulation=1, world_size=dist.get_world_size(), gradient_clipping=None,
                         device_type=device.type)
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False,
                                      args=argparse.Namespace(device_rank=device.index or int(os.environ["LOCAL_RANK"])))

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    return step


def fabric_step(args, device, strategy: str):
    import lightning as L
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import disttrain

    defaults = STRATEGY_REGISTRY[strategy]["init_params"]
    fabric = L.Fabric(accelerator=device.type, devices=args.devices, precision=args.precision,
                      strategy=disttrain.fabric.ZeroStrategy(micro_batch_size=args.batch, **defaults))
    fabric.launch()
    with fabric.init_module(empty_init=True):  # built as usual below stage 3
        model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = fabric.setup(model, opt)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()

    return step


def child(args: argparse.Namespace) -> None:
    """One round on this process group; rank 0 writes every engine's step times."""
    device = deepspeed_rank(args)
    data = batches(args, device)
    steps = {RAW: raw_step(args, device), **{name: fabric_step(args, device, name) for name in FABRIC}}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i, ids in enumerate(data):
        # A new order every step (the same on every rank): no engine always follows the same one, whose memory
        # traffic it would inherit.
        for name in random.Random(i).sample(list(steps), len(steps)):
            sync(device)
            t0 = time.perf_counter()
            steps[name](ids)
            sync(device)
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    around = timed_loop(steps[RAW], data, device)
    times[TRAINER] = trainer_step_times(args, device, data, "disttrain_zero2")
    around += timed_loop(steps[RAW], data, device)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"times": times, "raw_around_trainer": around}, f)
    dist.barrier()


def main() -> None:
    args = parse_args()
    if args.variant is not None:
        return child(args)
    rounds = run_variants(__file__, ["all engines"], "--variant", args.devices, args.rounds)["all engines"]
    n_params = count_params(args)
    setup = (f"{args.devices} x {args.device}, Llama {args.layers}x{args.hidden} ({n_params / 1e6:.1f}M params), "
             f"micro batch {args.batch}x{args.seq}, {args.precision}, {args.rounds} rounds x {args.steps} timed steps,"
             " each round in fresh processes")
    print(f"\nzero2_overhead: {setup}")
    rows = []
    for name in (RAW, *FABRIC, TRAINER):
        label = name if name in (RAW, TRAINER) else f"{name} (Fabric)"
        raw = "raw_around_trainer" if name == TRAINER else None
        mine = [t for r in rounds for t in r["times"][name]]
        base = [t for r in rounds for t in (r[raw] if raw else r["times"][RAW])]
        per_round = [statistics.median(r["times"][name]) / statistics.median(r[raw] if raw else r["times"][RAW])
                     for r in rounds]
        ratio, spread = statistics.median(mine) / statistics.median(base), f"{min(per_round):.3f}-{max(per_round):.3f}"
        rows.append([label, statistics.median(mine) * 1e3, ratio, spread])
        print(f"  {label:<34} {statistics.median(mine) * 1e3:8.1f} ms/step  ratio {ratio:.3f}  per round {spread}")
    print("  (target: ratio <= 1.05 for disttrain_zero2; per round: each round's median over the raw loop's; the"
          " Trainer against the raw loop run just before and after it)")
    write_table("zero2_overhead", "disttrain_zero2 against a raw DeepSpeed stage-2 loop", setup,
                ["variant", "ms/step", "ratio", "ratio per round (min-max)"], rows, bars=("ms/step", "ratio"),
                reference={"ratio": 1.0}, fmt={"ms/step": ".1f", "ratio": ".3f"},
                notes=["ratio: median step time over the raw DeepSpeed stage-2 loop's in the same processes (target"
                       " <= 1.05 for disttrain_zero2); the Fabric rows and the raw loop take their steps in turn",
                       "ratio per round: each round's median over the raw loop's median of the same round",
                       "the Trainer row: against the raw loop run just before and after the Trainer"],
                out_dir=args.out_dir)


if __name__ == "__main__":
    main()
