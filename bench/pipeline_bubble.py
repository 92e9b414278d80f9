"""The pipeline bubble of disttrain_megatron's 1F1B schedule, measured, against the theory; and TP=2 step time
against one process. One run:

    python bench/pipeline_bubble.py                      # 2 CPU processes (gloo), p=2, m in {2, 4, 8}
    python bench/pipeline_bubble.py --device cuda --hidden 2048 --layers 8
    python bench/pipeline_bubble.py --smoke              # tiny sizes: checks that it runs

Bubble: each rank adds up the time its stages spend computing (``forward_one_chunk`` / ``backward_one_chunk``
of torch.distributed.pipelining); idle = 1 - busy / step time, averaged over ranks, next to (p-1)/(m+p-1). Every
microbatch has the same size, so the work per step grows with m, as in the theory. Stage imbalance (embeddings
on the first stage, LM head and loss on the last) and communication come on top of the theory's bubble.

TP: the same model, one process (the baseline) vs tensor_parallel_size=2 through Fabric; ratio of step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from harness import add_model_args, build_model, free_port, parse_smoke, sync  # noqa: E402
from tables import write_table  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(batch=2)  # here: samples per microbatch
    p.add_argument("--microbatches", default="2,4,8")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parse_smoke(p, hidden=64, layers=2, seq=32, batch=1, microbatches="2", steps=1)


class StageClock:
    """Adds up the compute time of pipeline stages by wrapping their forward/backward chunk methods."""

    def __init__(self) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.busy = 0.0
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            original = getattr(_PipelineStageBase, name)
            setattr(_PipelineStageBase, name, self._timed(original))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0
        return wrapper


def make_fabric(args, device, **options):
    import lightning as L

    import disttrain

    fabric = L.Fabric(accelerator=device.type, devices=dist.get_world_size() if dist.is_initialized() else 1,
                      precision=args.precision, strategy=disttrain.fabric.MegatronStrategy(**options))
    fabric.launch()
    return fabric


def train_steps(model, opt, fabric, data, device, clock=None) -> tuple[list[float], list[float]]:
    times, busy = [], []
    for i, ids in enumerate(data):
        sync(device)
        if clock is not None:
            clock.busy = 0.0
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        sync(device)
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - t0)
            busy.append(clock.busy if clock is not None else 0.0)
    return times, busy


def child_pp(args, device) -> dict:
    clock = StageClock()
    results = {}
    for m in [int(x) for x in args.microbatches.split(",")]:
        fabric = make_fabric(args, device, pipeline_parallel_size=2, microbatches=m, pipeline_schedule="1f1b")
        model = build_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = fabric.setup(model, opt)
        g = torch.Generator().manual_seed(0)
        data = [torch.randint(0, 4096, (args.batch * m, args.seq), generator=g).to(device)
                for _ in range(args.steps + 2)]
        times, busy = train_steps(model, opt, fabric, data, device, clock)
        idle = torch.tensor([1 - sum(busy) / sum(times)])
        dist.all_reduce(idle)
        results[m] = {"step_s": statistics.median(times), "idle": idle.item() / dist.get_world_size()}
    return results


def child_tp(args, device) -> dict:
    if dist.is_initialized() and dist.get_world_size() > 1:
        fabric = make_fabric(args, device, tensor_parallel_size=dist.get_world_size())
    else:
        fabric = None
    model = build_model(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if fabric is not None:
        model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 4096, (args.batch, args.seq), generator=g).to(device) for _ in range(args.steps + 2)]

    class Plain:  # the one-process baseline: a hand-written torch loop
        @staticmethod
        def backward(loss):
            loss.backward()

    times, _ = train_steps(model, opt, fabric or Plain, data, device)
    return {"step_s": statistics.median(times)}


def launch(args, mode: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.abspath(__file__),
               *sys.argv[1:], "--child", mode, "--result", result]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(result) as f:
            return json.load(f)


def main() -> None:
    args = parse_args()
    if args.child:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        modes = {"pp": child_pp, "tp": child_tp}
        result = {mode: modes[mode](args, device) for mode in args.child.split("+")}
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump(result, f)
        return

    import logging

    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    print(f"model: Llama hidden={args.hidden} layers={args.layers} seq={args.seq}, {args.batch} samples per"
          f" microbatch, {args.device}, {args.precision}")
    # each in fresh processes; under --smoke pp and tp=2 share one launch (a smoke run's figures mean nothing)
    both = launch(args, "pp+tp", 2) if args.smoke else {}
    pp = both.get("pp") or launch(args, "pp", 2)["pp"]
    print("\n1F1B, p=2         step (s)   idle measured   theory (p-1)/(m+p-1)   measured / theory")
    rows = []
    for m, row in pp.items():
        theory = 1 / (int(m) + 1)
        print(f"  m={m:<3}           {row['step_s']:8.3f}   {row['idle']:13.3f}   {theory:20.3f}"
              f"   {row['idle'] / theory:17.2f}")
        rows.append([f"1F1B p=2 m={m}", row["step_s"], row["idle"], theory, row["idle"] / theory])
    single = launch(args, "tp", 1)["tp"]
    tp = both.get("tp") or launch(args, "tp", 2)["tp"]
    print(f"\nTP=2 step {tp['step_s']:.3f} s vs one process {single['step_s']:.3f} s:"
          f" ratio {tp['step_s'] / single['step_s']:.2f} (below 1 = faster than one process)")
    write_table("pipeline_bubble", "Pipeline bubble of disttrain_megatron's 1F1B",
                f"Llama hidden={args.hidden} layers={args.layers} seq={args.seq}, {args.batch} samples per microbatch,"
                f" {args.device}, {args.precision}", ["schedule", "step s", "idle measured", "idle theory",
                                                      "measured / theory"], rows,
                bars=("idle measured", "idle theory"), fmt={"step s": ".3f", "idle measured": ".3f",
                                                             "idle theory": ".3f", "measured / theory": ".2f"},
                notes=[f"TP=2 step {tp['step_s']:.3f} s vs one process {single['step_s']:.3f} s: ratio"
                       f" {tp['step_s'] / single['step_s']:.2f} (below 1 = faster than one process)"],
                out_dir=args.out_dir)


if __name__ == "__main__":
    main()
