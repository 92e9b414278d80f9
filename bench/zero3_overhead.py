"""Step time of disttrain_zero3 against a raw ``deepspeed.initialize`` loop on the same model, data and config,
in one run; per-rank device and host memory with and without offload.

    python bench/zero3_overhead.py                                # 2 CPU processes (gloo), fp32
    python bench/zero3_overhead.py --device cuda --devices 1 --precision bf16-mixed --hidden 2048 --layers 8
    python bench/zero3_overhead.py --smoke                        # tiny sizes: checks that it runs

Rows: raw DeepSpeed loop (engine(ids), engine.backward, engine.step), disttrain_zero3 through Fabric and through
the Trainer (ratios against the raw loop; target <= 1.05), and disttrain_zero3_offload through Fabric (memory).
Each variant runs in fresh processes (so one engine's leftovers do not inflate the next one's memory), and the
variants are interleaved over rounds so that machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys

import psutil
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    add_model_args,
    batches,
    build_model,
    count_params,
    deepspeed_rank,
    each_variant,
    parse_smoke,
    run_variants,
    timed_loop,
    trainer_step_times,
)
from tables import write_table  # noqa: E402

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (after 3 warm-up steps)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # set for the child processes
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parse_smoke(p, hidden=64, layers=2, seq=32, batch=2, rounds=1, steps=1)


def memory(device) -> dict[str, float]:
    out = {"host_rss_mib": psutil.Process().memory_info().rss / 2**20}
    if device.type == "cuda":
        out["device_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
    return out


def raw_deepspeed(args, device, data):
    import deepspeed

    from disttrain.parallel.engines.deepspeed import ZeroOptions, import_dynamo_before_zero_init, zero3_config

    import_dynamo_before_zero_init()  # the model's lazy transformers import reaches torch._dynamo: not inside zero.Init
    # Llama's classes defined before zero.Init, as a raw DeepSpeed user must: a class first defined inside loses its
    # decorators when zero.Init closes (transformers' kernel decorator: AttributeError _kernel_funcs in forward).
    import transformers.models.llama.modeling_llama  # noqa: F401
    config = zero3_config(ZeroOptions(), precision=args.precision, micro_batch_size=args.batch, accumulation=1,
                          world_size=dist.get_world_size(), gradient_clipping=None, device_type=device.type)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False,
                                      args=argparse.Namespace(device_rank=device.index or int(os.environ["LOCAL_RANK"])))

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    return timed_loop(step, data, device), memory(device)


def fabric_run(strategy: str):
    def run(args, device, data):
        import lightning as L

        import disttrain  # noqa: F401

        fabric = L.Fabric(accelerator=device.type, devices=args.devices, precision=args.precision,
                          strategy=disttrain.fabric.ZeroStrategy(micro_batch_size=args.batch, **(
                              {"offload_optimizer": "cpu", "offload_parameters": "cpu"} if "offload" in strategy
                              else {})))
        fabric.launch()
        with fabric.init_module(empty_init=True):  # under zero.Init
            model = build_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = fabric.setup(model, opt)

        def step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()

        return timed_loop(step, data, device), memory(device)

    return run


def trainer_run(args, device, data):
    return trainer_step_times(args, device, data, "disttrain_zero3"), memory(device)


RUNS = {"raw deepspeed.initialize": raw_deepspeed, "disttrain_zero3 (Fabric)": fabric_run("disttrain_zero3"),
        "disttrain_zero3 (Trainer)": trainer_run,
        "disttrain_zero3_offload (Fabric)": fabric_run("disttrain_zero3_offload")}


def child(args: argparse.Namespace) -> None:
    """The variant(s) on this process group; rank 0 writes times and every rank's memory to each one's result."""
    device = deepspeed_rank(args)
    data = batches(args, device)
    for variant, result in each_variant(args.variant, args.result):
        times, mem = RUNS[variant](args, device, data)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mem)
        if dist.get_rank() == 0:
            with open(result, "w") as f:
                json.dump({"times": times, "memory": gathered}, f)
        dist.barrier()


def main() -> None:
    args = parse_args()
    if args.variant is not None:
        return child(args)
    runs = run_variants(__file__, list(RUNS), "--variant", args.devices, args.rounds, smoke_together=True)
    times = {name: [t for out in outs for t in out["times"]] for name, outs in runs.items()}
    memory_of = {name: outs[-1]["memory"] for name, outs in runs.items()}
    n_params = count_params(args)
    setup = (f"{args.devices} x {args.device}, Llama {args.layers}x{args.hidden} ({n_params / 1e6:.1f}M params), "
             f"micro batch {args.batch}x{args.seq}, {args.precision}, {args.rounds} rounds x {args.steps} timed steps,"
             " each variant in fresh processes")
    print(f"\nzero3_overhead: {setup}")
    base = statistics.median(times["raw deepspeed.initialize"])
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        mems = "  ".join(f"rank{r} " + ", ".join(f"{k} {v:.0f}" for k, v in m.items())
                         for r, m in enumerate(memory_of[name]))
        rows.append([name, med * 1e3, med / base, mems])
        print(f"  {name:<34} {med * 1e3:8.1f} ms/step  ratio {med / base:.3f}   {mems}")
    print("  (target: ratio <= 1.05 for disttrain_zero3; host RSS is each process's total after its run)")
    write_table("zero3_overhead", "disttrain_zero3 against a raw deepspeed.initialize loop", setup,
                ["variant", "ms/step", "ratio", "memory per rank"], rows, bars=("ms/step", "ratio"),
                reference={"ratio": 1.0}, fmt={"ms/step": ".1f", "ratio": ".3f"},
                notes=["ratio: median step time over the raw DeepSpeed loop's in the same run (target <= 1.05 for"
                       " disttrain_zero3)", "host RSS is each process's total after its run"], out_dir=args.out_dir)


if __name__ == "__main__":
    main()
